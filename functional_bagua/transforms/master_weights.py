"""Parameters in bfloat16 or float16 stepped as if they were float32: a float32 master copy in
the state, or bfloat16 with stochastic rounding of each step.

A bfloat16 parameter ``p`` updated by ``p + u`` loses every ``u`` smaller than half its step
(``|u| < 2^-9 |p|``): late in training, most of them. :func:`master_weights` keeps the inner
transform on float32 values instead, in one of two ways, for every bfloat16 and float16
parameter (float32 and float64 ones pass through untouched):

- ``"float32"``: the state keeps ``m``, a float32 copy of ``p``; the inner transform runs on
  ``m`` (its gradients cast to float32, so its own state is float32 too) and::

      m' = m + u                 (float32)
      p' = round(m')             (to p's dtype, to nearest)

  6 bytes per parameter (2 in ``p``, 4 in ``m``) instead of float32 training's 4, and the
  parameter is always the rounding of a float32 trajectory (as mixed-precision training
  keeps it).
- ``"stochastic_rounding"`` (bfloat16 parameters): nothing kept; the inner transform runs on
  ``p`` as float32 and::

      p' = stochastic_round(p + u)       (float32 sum, rounded to bfloat16 unbiased)

  so ``E[p'] = p + u``: small updates move the parameter on average, with no memory beyond
  the parameter (as heavyball's ``param_ecc`` and torchao's ``bf16_stochastic_round``). The
  random bits are :func:`~functional_bagua.random_bits16` of the seed and the step count, at
  the places of the parameter's values among those of the parameters rounded (in the tree's
  order): the same on every device, eager or compiled, and after a resumed checkpoint.

The update returned for such a parameter is ``p' - p`` in float32, which
:func:`~functional_bagua.apply_updates` (and ``fb.Optimizer``'s in-place add) adds in float32
and rounds once into ``p``'s dtype: ``p'`` exactly, wherever the difference of the two numbers of
``p``'s dtype is exact in float32 (unless ``p'`` lands within about ``2^-15 |p|`` (bfloat16) or
``2^-12 |p|`` (float16) of 0 in one step: then one step of ``p'``'s dtype off, and the next
step starts again from the master copy). A parameter that is not finite stays so.

The rounding to nearest is computed on the float32 bits (:func:`round_to_nearest`), so a
compiled update rounds as the eager one (inductor would fold a plain ``.to(dtype).float()``
away). Under :func:`~functional_bagua.schedule_free`, ``fb.Optimizer.eval()`` moves each such
parameter by the float32 rule (from the parameter and the float32 ``z``, rounded), and after
``train()`` the next step lands on the master copy's trajectory again. torch's ``GradScaler``
refuses float16 gradients (``"Attempting to unscale FP16 gradients"``), with torch.optim as
here: with float16 parameters, scale the loss by a constant ``S`` and unscale inside, in
float32 (``master_weights(fb.chain(fb.scale(1 / S), fb.adamw(...)))``), or train in bfloat16,
which needs no loss scaling.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from functional_bagua import tree
from functional_bagua.base import GradientTransformation
from functional_bagua.compiling import run_compiled
from functional_bagua.flat import split_like
from functional_bagua.hyperparams import accepts_schedules
from functional_bagua.numerics import zero_count
from functional_bagua.transforms.low_precision import (
    PARAMETER_STREAM,
    back_to_back,
    batches_of,
    round_to_nearest,
    rounding_stream,
    stochastically_rounded_from,
)
from functional_bagua.tree import PyTree

MODES = ("float32", "stochastic_rounding")
LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeightsState(NamedTuple):
    """``count``: the updates taken (with the seed, the stream of the stochastic rounding);
    ``master``: per parameter, its float32 copy (bfloat16 and float16 parameters; ``None`` for
    the others), in ``"float32"`` mode; ``None`` in ``"stochastic_rounding"`` mode; ``inner``: the inner transform's state (float32 for the
    low-precision parameters)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    master: Any
    inner: Any


def _is_low_precision(p: Optional[torch.Tensor]) -> bool:
    return p is not None and p.dtype in LOW_PRECISION


def _as_float32(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.to(torch.float32)


def _values(param_leaves: list, copies: list) -> list:
    """The values the inner transform steps: the master copies, else the parameters (the
    low-precision ones as float32)."""
    return [c if c is not None else _as_float32(p) if _is_low_precision(p) else p for p, c in zip(param_leaves, copies)]


def _rounded(stepped: list, start: int, dtype: torch.dtype, to_nearest: bool, stream: Optional[torch.Tensor]) -> list:
    """Each of ``stepped`` (float32 parameters of ``dtype``, following one another in ``stream``
    from index ``start``) rounded to ``dtype``, as float32: to nearest, or stochastically to
    bfloat16 with the bits of their values' places in ``stream`` (module docstring); computed back
    to back in one pass, eagerly by a compiled kernel (the same bits as op by op:
    :func:`~functional_bagua.compiling.run_compiled`)."""
    flat = back_to_back(stepped)
    if to_nearest:
        return split_like(run_compiled(round_to_nearest, flat, static=(dtype,)), stepped)  # float32, exact in dtype
    assert stream is not None  # made where the rounding is stochastic
    at = torch.full((), start, dtype=torch.int64, device=flat.device)  # an input: no compile per start
    rounded = run_compiled(stochastically_rounded_from, flat, at, stream.to(flat.device))
    return [r.to(torch.float32) for r in split_like(rounded, stepped)]


def _copies(spec: Any, master: Any) -> list:
    """The master copy of each parameter of ``spec`` (``None`` where there is none: all of them
    in ``"stochastic_rounding"`` mode, whose state holds ``None``)."""
    if master is None:
        return [None] * spec.num_leaves
    return tree.leaves_matching(spec, master, "the state's master copies", "params")


@accepts_schedules(static_args=("inner",))  # built_from: fb.Optimizer shows the inner alias's lr
def master_weights(inner: GradientTransformation, mode: str = "float32", *, seed: int = 0) -> GradientTransformation:
    """``inner`` stepping bfloat16 and float16 parameters through float32 values (module
    docstring): a float32 master copy in the state, or stochastic rounding of each step.

    Args:
        inner: any transform (an alias such as ``fb.adamw``, a chain; wrap it in
            :func:`~functional_bagua.low_precision_state` to store its float32 state compressed).
        mode: ``"float32"`` (a float32 copy of each such parameter in the state) or
            ``"stochastic_rounding"`` (bfloat16 parameters only; no copy).
        seed: the stochastic rounding's seed, in ``[0, 2^31)``.

    Returns:
        A GradientTransformation whose state is a :class:`MasterWeightsState`; its ``update``
        needs ``params``.

    Example::

        model = model.to(torch.bfloat16)
        opt = fb.Optimizer(model.parameters(), fb.master_weights(fb.adamw(1e-3)))
    """
    if mode not in MODES:
        raise ValueError(f"master_weights: mode must be one of {MODES}, got {mode!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"master_weights: seed must be an int in [0, 2^31), got {seed!r}")
    keeps_copy = mode == "float32"

    def init(params: PyTree) -> MasterWeightsState:
        leaves, spec = tree.flatten(params)
        if not keeps_copy:
            for i, p in enumerate(leaves):
                if p is not None and p.dtype == torch.float16:
                    raise TypeError(
                        f"master_weights: parameter {tree.leaf_name(spec, i)!r} is float16; stochastic rounding is "
                        "made for bfloat16 parameters: use mode='float32' (a float32 master copy) for float16 ones"
                    )
        master = (
            spec.unflatten([p.detach().to(torch.float32) if _is_low_precision(p) else None for p in leaves])
            if keeps_copy
            else None
        )
        values = spec.unflatten(_values(leaves, _copies(spec, master)))
        return MasterWeightsState(zero_count(params), master, inner.init(values))

    def update(
        grads: PyTree, state: MasterWeightsState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, MasterWeightsState]:
        if params is None:
            raise ValueError("master_weights needs the parameters: call update(grads, state, params)")
        if not isinstance(state, MasterWeightsState):
            raise ValueError(
                f"master_weights: got a state of type {type(state).__name__}, expected MasterWeightsState; pass "
                "the state this transform's init made"
            )
        param_leaves, spec = tree.flatten(params)
        grad_leaves = tree.leaves_matching(spec, grads, "grads", "params")
        inner_grads = spec.unflatten(
            [_as_float32(g) if _is_low_precision(p) else g for g, p in zip(grad_leaves, param_leaves)]
        )
        master_leaves = _copies(spec, state.master)
        value_leaves = _values(param_leaves, master_leaves)
        inner_updates, inner_state = inner.update(inner_grads, state.inner, spec.unflatten(value_leaves))
        update_leaves = tree.leaves_matching(spec, inner_updates, "the inner transform's updates", "params")
        stream = (
            None if keeps_copy else rounding_stream(seed, state.count, PARAMETER_STREAM)
        )  # only rounding draws bits
        updates, masters = [], []
        for i, (p, copy) in enumerate(zip(param_leaves, master_leaves)):
            if keeps_copy and p is not None and (copy is not None) != _is_low_precision(p):
                raise ValueError(
                    f"master_weights: parameter {tree.leaf_name(spec, i)!r} is {p.dtype}, but the state was made for "
                    f"{'a bfloat16 or float16' if copy is not None else 'a float32 or float64'} one: call init again "
                    "for parameters of other dtypes"
                )
        stepped: dict[int, torch.Tensor] = {}  # per low-precision parameter's number, p + u in float32
        starts: dict[int, int] = {}  # the index of its first value in the rounding's stream
        rounded_so_far = 0
        stepping: dict[tuple, list[int]] = {}  # the parameters rounded together: one dtype and device
        for number, (p, u, value, copy) in enumerate(zip(param_leaves, update_leaves, value_leaves, master_leaves)):
            if u is None or not _is_low_precision(p):
                updates.append(u)
                masters.append(copy)
                continue
            stepped[number] = value + u.to(torch.float32)
            starts[number], rounded_so_far = rounded_so_far, rounded_so_far + p.numel()
            masters.append(stepped[number] if keeps_copy else None)
            updates.append(None)  # below: the rounded step minus p
            stepping.setdefault((p.dtype, p.device), []).append(number)
        for (dtype, _), numbers in stepping.items():
            # eagerly, the parameters back to back in passes over many at once, with the numbers of
            # rounding each alone (low_precision.batches_of)
            sizes, firsts = [stepped[n].numel() for n in numbers], [starts[n] for n in numbers]
            for batch in batches_of(numbers, sizes, firsts):
                rounded = _rounded([stepped[n] for n in batch], starts[batch[0]], dtype, keeps_copy, stream)
                for n, target in zip(batch, rounded):
                    updates[n] = target - param_leaves[n].to(torch.float32)
        new_state = MasterWeightsState(state.count + 1, spec.unflatten(masters) if keeps_copy else None, inner_state)
        return spec.unflatten(updates), new_state

    return GradientTransformation(init, update)
