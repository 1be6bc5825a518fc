"""Schedule-free learning (Defazio et al., 2024, "The Road Less Scheduled").

Three sequences replace a learning-rate schedule: ``z``, the base iterates an optimizer steps;
``x``, their weighted average, the weights to evaluate; and ``y``, the interpolation of the two
where the gradients are taken, the weights the model holds while it trains. With the direction
``d_t`` (the gradient, or Adam's normalized gradient, at ``y_t``) and the step number
``t = 1, 2, ...``::

    lr_t  = lr * min(1, t / warmup_steps)               (lr without warmup)
    w_t   = t^r * max(lr_1, ..., lr_t)^weight_lr_power
    c_t   = w_t / (w_1 + ... + w_t)                     (0 while every weight is 0)
    z_t   = z_{t-1} - lr_t d_t
    x_t   = (1 - c_t) x_{t-1} + c_t z_t
    y_t   = (1 - b1) z_t + b1 x_t

The step number ``t``, ``max(lr_1, ..., lr_t)`` and the sum of the weights are one each for all
the tensors of the transform, as the reference keeps them per param group (a tensor whose
gradient is missing, ``None``, at a step keeps its ``z`` and parameter, and the count still
advances). So ``c_t``, ``lr_t`` and the weight of ``d`` are computed once a step, and every
tensor is stepped with the same numbers: on the CPU as Python numbers, on a GPU as one 0-dim
tensor (no per-tensor scalar arithmetic, no sync). Two differences from the reference remain
where gradients are missing: a direction with statistics of its own (schedule-free AdamW's
second moment) counts its steps per tensor, as every transform here does, where the reference
bias-corrects with the group's count; and ``fb.Optimizer`` leaves a param group with no
gradient at all untouched, its count too, as torch.optim does, where the reference's ``step()``
advances the count.

Only ``y`` and ``z`` are stored (as the reference implementation stores them): ``x`` follows from
them, ``x = (y - (1 - b1) z) / b1``, and the step above is, written on ``y``::

    y_t = lerp(y_{t-1}, z_{t-1}, c_t) + lr_t (b1 (1 - c_t) - 1) d_t

so the update returned (added to the parameters ``y``) is
``u_t = c_t (z_{t-1} - y_{t-1}) + lr_t (b1 (1 - c_t) - 1) d_t``. Evaluate at
:func:`schedule_free_eval_params` (``x``), and go back to ``y`` with
:func:`schedule_free_train_params` before training on.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import optree
import torch

from functional_bagua import accepted, foreach, ownership, tree
from functional_bagua.accepted import AcceptedStep
from functional_bagua.base import GradientTransformation, apply_updates_, chain
from functional_bagua.foreach import updated
from functional_bagua.hyperparams import accepts_schedules
from functional_bagua.leaf_lists import LeafLists
from functional_bagua.numerics import (
    SCALAR_DTYPE,
    as_scalar,
    is_number,
    number_now,
    readable_now,
    takes_cpu_scalars,
    zero_count,
)
from functional_bagua.transforms.direction import refuse_a_step
from functional_bagua.transforms.leafwise import leafwise
from functional_bagua.tree import PyTree

Scalar = Union[float, torch.Tensor]


@takes_cpu_scalars  # its weights computed on the CPU are read as numbers (_numbers_now)
class ScheduleFreeState(NamedTuple):
    """``count`` (steps taken), ``lr_max`` (the largest ``lr_t`` so far), ``weight_sum``
    (``w_1 + ... + w_t``) and ``b1`` (the interpolation weight of the last step: the evaluation
    weights need it): one each, 0-dim (float64 but the count), on the parameters' device; ``z``:
    the base iterates, a tree like the parameters."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    lr_max: torch.Tensor
    weight_sum: torch.Tensor
    z: PyTree
    b1: torch.Tensor


class _BaseIterate(NamedTuple):
    """Per tensor: ``z``, the base iterate (the state of the per-tensor step)."""

    z: torch.Tensor


@accepts_schedules(static_args=("direction", "warmup_steps"))
def schedule_free(
    direction: GradientTransformation,
    lr: Scalar = 0.0025,
    b1: Scalar = 0.9,
    warmup_steps: int = 0,
    r: Scalar = 0.0,
    weight_lr_power: Scalar = 2.0,
) -> GradientTransformation:
    """Schedule-free averaging around a ``direction`` (module docstring).

    ``direction`` gives ``d_t`` from the gradients at the parameters the model holds (``y``):
    :func:`~functional_bagua.identity` for schedule-free SGD, a preconditioner such as
    :func:`~functional_bagua.scale_by_bias_corrected_rms` for schedule-free AdamW, followed by
    :func:`~functional_bagua.add_decayed_weights` for weight decay at ``y``. It must not include
    a learning rate: this transform takes the step ``-lr_t d_t`` itself (an alias such as
    ``fb.adamw`` is refused, with the way to compose it).

    Args:
        direction: the transform giving the direction ``d_t`` (not the step: no learning rate).
        lr: the learning rate ``lr`` (a number or a 0-dim tensor; a schedule is multiplied by
            the warmup).
        b1: the interpolation ``y = (1 - b1) z + b1 x``, in ``(0, 1)`` (the reference's
            ``betas[0]`` or ``momentum``).
        warmup_steps: the linear warmup of ``lr_t`` over the first steps (0: none).
        r: the power of ``t`` in the averaging weights ``w_t``.
        weight_lr_power: the power of the largest ``lr_t`` so far in ``w_t``.

    Returns:
        A GradientTransformation that needs ``params`` (the ``y`` the gradients were taken at);
        its state is the chain ``(direction's state, ScheduleFreeState)``.

    Example::

        tx = fb.schedule_free(fb.identity(), lr=1.0, b1=0.9)   # = fb.schedule_free_sgd(1.0)
        updates, state = tx.update(grads, state, params)
        eval_params = fb.schedule_free_eval_params(state, fb.apply_updates(params, updates))
    """
    refuse_a_step(
        "schedule_free",
        direction,
        "fb.schedule_free(fb.chain(fb.scale_by_bias_corrected_rms(), fb.add_decayed_weights(wd)), lr), "
        "or the aliases fb.schedule_free_adamw / fb.schedule_free_sgd",
    )
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"schedule_free: warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if is_number(b1) and not 0 < b1 < 1:
        raise ValueError(
            f"schedule_free: b1 must lie in (0, 1), got {b1}: the evaluation weights "
            "x = (y - (1 - b1) z) / b1 need b1 > 0, and b1 = 1 never moves y towards z"
        )
    if is_number(lr) and lr < 0:
        raise ValueError(f"schedule_free: Invalid learning rate: {lr}")
    return chain(direction, _averaging(lr, b1, warmup_steps, r, weight_lr_power))


def _averaging(lr: Scalar, b1: Scalar, warmup_steps: int, r: Scalar, weight_lr_power: Scalar) -> GradientTransformation:
    """The y/z/x step of the module docstring on a direction ``d`` (the chain's last link): the
    numbers of the step once, then every tensor's step with them (:func:`_stepped_with`)."""

    def init(params: PyTree) -> ScheduleFreeState:
        def scalar(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=SCALAR_DTYPE, device=tree.device_of(params))

        z = _stepped_with(0.0, 0.0, 0.0).init(params).z
        return ScheduleFreeState(zero_count(params), scalar(0.0), scalar(0.0), z, scalar(float(b1)))

    def numbers(state: Any) -> tuple:
        """This step's scalars: the new count, ``lr_max``, weight sum and ``b1``, and each tensor's
        step with them."""
        if not isinstance(state, ScheduleFreeState):
            raise ValueError(
                f"schedule_free: got a state of type {type(state).__name__}, expected ScheduleFreeState; pass "
                "the state this transform's init made (the second part of fb.schedule_free's chain state)"
            )
        count = state.count + 1
        held = (state.count, state.lr_max, state.weight_sum, state.b1)
        if all(isinstance(x, torch.Tensor) and readable_now(x) for x in held):
            hyperparameters = [number_now(x) for x in (lr, b1, r, weight_lr_power)]
            if all(x is not None for x in hyperparameters):  # eagerly on the CPU: Python numbers
                return _numbers_now(count, held, hyperparameters, warmup_steps)
        t = as_scalar(count)
        lr_t = lr * torch.clamp(t / warmup_steps, max=1.0) if warmup_steps else torch.ones_like(t) * lr
        lr_max = torch.maximum(state.lr_max, lr_t)
        weight = t**r * lr_max**weight_lr_power
        weight_sum = state.weight_sum + weight
        c = torch.where(weight_sum > 0, weight / torch.where(weight_sum > 0, weight_sum, 1.0), 0.0)
        along = lr_t * (b1 * (1 - c) - 1)  # the weight of d in u
        b1_now = torch.full_like(state.b1, b1) if is_number(b1) else torch.zeros_like(state.b1) + b1
        return (count, lr_max, weight_sum, b1_now), (_read(c), _read(along), _read(-lr_t))

    def update(
        d: PyTree, state: ScheduleFreeState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, ScheduleFreeState]:
        if params is None:
            raise ValueError("schedule_free needs the parameters: call update(grads, state, params)")
        (count, lr_max, weight_sum, b1_now), factors = numbers(state)
        step = _stepped_with(*factors)
        with ownership.giving_state(step.update if ownership.state_given_to(update) else None):  # z
            u, iterate = step.update(d, _BaseIterate(state.z), params)
        return u, ScheduleFreeState(count, lr_max, weight_sum, iterate.z, b1_now)

    def on_lists(x: LeafLists, state: ScheduleFreeState, overwrite: bool) -> tuple[list, ScheduleFreeState]:
        """The same on a chain's checked lists (:mod:`functional_bagua.leaf_lists`)."""
        (count, lr_max, weight_sum, b1_now), factors = numbers(state)
        step = _stepped_with(*factors)
        with ownership.giving_state(step.update if ownership.state_given_to(update) else None):  # z
            u, iterate = step.update.on_lists(x, _BaseIterate(state.z), overwrite)  # type: ignore[attr-defined]
        return u, ScheduleFreeState(count, lr_max, weight_sum, iterate.z, b1_now)

    def apply_in_place(
        d: PyTree, state: ScheduleFreeState, params: PyTree, alpha: float = 1.0, scaled_by: Optional[float] = None
    ) -> Optional[ScheduleFreeState]:
        """The step written into ``params`` (``y``) and the state's ``z``, both given up by the
        caller, as the reference steps them: ``y <- lerp(y, z, c) + along d``, ``z <- z - lr_t d``
        (three multi-tensor ops, nothing new; on what the last step's checks accepted, over one
        slice of the tensors after the other, :mod:`functional_bagua.accepted`). Tensors that cannot be written so
        (:func:`~functional_bagua.foreach.writable_part`: a 0-dim parameter, a bfloat16 one)
        take the pure step, their update added. ``None``, nothing changed, where
        the update is scaled (``alpha`` not 1) or the parameters are (``scaled_by`` given), the
        factors are not numbers now (traced, on a device) or no tensor can be written so."""
        if alpha != 1 or scaled_by is not None:
            return None
        (count, lr_max, weight_sum, b1_now), (c, along, minus_lr) = numbers(state)
        if not (is_number(c) and is_number(along) and is_number(minus_lr)):
            return None
        records = accepted.records_now()
        record = records.get(_RECORD) if records is not None else None
        d_leaves, spec = tree.flatten_like(d, record.spec if record is not None else None)
        ys = tree.leaves_matching(spec, params, "updates", "params")
        inputs = _accepted_inputs(records, spec, d_leaves, ys, state.z)
        if inputs is not None:  # what the checks accepted at the last step: y and z written as then,
            picked_ds, picked_ys, picked_zs, chunks = inputs  # a slice at a time (in the cache)
            for part in chunks:
                _step_y_and_z(picked_ys[part], picked_zs[part], picked_ds[part], c, along, minus_lr)
            return ScheduleFreeState(count, lr_max, weight_sum, state.z, b1_now)
        zs = tree.leaves_matching(spec, state.z, "updates", "the state's z")
        present = [i for i, g in enumerate(d_leaves) if g is not None]
        written = foreach.writable_part(  # its factors are numbers (above), on any device
            present, lambda chosen: [t for i in chosen for t in (ys[i], d_leaves[i], zs[i])], numbers_now=True
        )
        if not written:
            return None
        z = state.z
        if len(written) < len(present):  # the others' pure step first (their z given up), its update added
            chosen = set(written)
            others = spec.unflatten([g if i not in chosen else None for i, g in enumerate(d_leaves)])
            step = _stepped_with(c, along, minus_lr)
            with ownership.giving_state(step.update):
                u, iterate = step.update(others, _BaseIterate(z), params)
            apply_updates_(params, u)
            z = iterate.z  # the written ones' z the same tensors, stepped below
            zs = tree.leaves_matching(spec, z, "updates", "the state's z")
        picked_ys, picked_zs, picked_ds = ([column[i] for i in written] for column in (ys, zs, d_leaves))
        _step_y_and_z(picked_ys, picked_zs, picked_ds, c, along, minus_lr)
        if records is not None and len(written) == len(present):  # every tensor: kept for the next step
            given = [g is not None for g in d_leaves]
            record = AcceptedStep.after(spec, given, picked_ds, picked_ys, [picked_zs], z, [picked_zs])
            if record is not None:
                records[_RECORD] = record
        return ScheduleFreeState(count, lr_max, weight_sum, z, b1_now)

    update.apply_in_place = apply_in_place  # type: ignore[attr-defined]
    update.on_lists = on_lists  # type: ignore[attr-defined]
    update.input_name = "schedule_free"  # type: ignore[attr-defined]
    update.needs_params = True  # type: ignore[attr-defined]
    update.fresh_updates = True  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


def _step_y_and_z(ys: list, zs: list, ds: list, c: float, along: float, minus_lr: float) -> None:
    """``y <- lerp(y, z, c) + along d`` and ``z <- z - lr_t d`` in place, three multi-tensor ops
    (the reference's)."""
    torch._foreach_lerp_(ys, zs, c)
    torch._foreach_add_(ys, ds, alpha=along)
    torch._foreach_add_(zs, ds, alpha=minus_lr)


def _numbers_now(count: torch.Tensor, held: tuple, hyperparameters: list, warmup_steps: int) -> tuple:
    """:func:`_averaging`'s numbers of a step (the new state's scalars, and ``(c, along,
    -lr_t)``) in Python floats, as the reference computes them (``k ** r * lr_max **
    weight_lr_power``), from the step count, ``lr_max``, the weight sum and ``b1`` ``held`` (0-dim
    CPU tensors read now) and the hyperparameters ``(lr, b1, r, weight_lr_power)`` as numbers.
    The new scalars are new tensors but ``b1``, kept where it holds the same number."""
    lr, b1, r, weight_lr_power = hyperparameters
    t = float(held[0].item() + 1)
    lr_t = lr * min(t / warmup_steps, 1.0) if warmup_steps else lr
    lr_max = max(held[1].item(), lr_t)
    weight = t**r * lr_max**weight_lr_power
    weight_sum = held[2].item() + weight
    c = weight / weight_sum if weight_sum > 0 else 0.0
    along = lr_t * (b1 * (1 - c) - 1)
    # b1 as it was where it is the same number (a 0-dim tensor nothing writes into)
    b1_now = held[3] if held[3].item() == b1 else torch.scalar_tensor(b1, dtype=SCALAR_DTYPE)
    scalars = (torch.scalar_tensor(x, dtype=SCALAR_DTYPE) for x in (lr_max, weight_sum))
    return (count, *scalars, b1_now), (c, along, -lr_t)


def _stepped_with(c: Scalar, along: Scalar, minus_lr: Scalar) -> GradientTransformation:
    """Each tensor's step with this step's numbers: ``u = c (z - y) + along d``, ``z <- z - lr_t d``
    (run grouped, one multi-tensor op per operation, by :func:`~functional_bagua.leafwise`)."""

    def init_leaf(p: torch.Tensor) -> _BaseIterate:
        return _BaseIterate(p.detach().clone())

    def update_leaf(d: torch.Tensor, s: _BaseIterate, y: Optional[torch.Tensor]) -> tuple[torch.Tensor, _BaseIterate]:
        assert y is not None  # needs_params
        u = (s.z - y).mul_(_on_device_of(c, y))
        along_here = _on_device_of(along, y)
        u = u.add_(d, alpha=along_here) if is_number(along_here) else u.add_(d * along_here)
        step = _on_device_of(minus_lr, y)  # z + step d, in z where it was given up (read above)
        z = updated(s.z, "add", d, alpha=step) if is_number(step) else updated(s.z, "add", step * d)
        return u, _BaseIterate(z)

    return leafwise(_BaseIterate, init_leaf, update_leaf, name="schedule_free", needs_params=True, fresh_updates=True)


def _on_device_of(x: Any, like: Any) -> Any:
    """``x`` (a number, or a 0-dim tensor) where the tensors ``like`` are (a GPU's scalar for CPU
    tensors: a copy; a CPU scalar for a GPU's tensors is read as a number by torch)."""
    if isinstance(x, torch.Tensor) and x.device != like.device and x.device.type != "cpu":
        return x.to(like.device)
    return x


def _read(x: Any) -> Any:
    """A 0-dim CPU tensor as a Python number, eagerly (no device sync: it is on the host), so that
    the multi-tensor ops take it as a scalar (one fused multiply-add instead of two ops); else as
    it is (traced, on a GPU, or differentiated through: :func:`~functional_bagua.numerics.readable_now`)."""
    if isinstance(x, torch.Tensor) and x.dim() == 0 and readable_now(x):
        return x.item()
    return x


def schedule_free_states(state: Any) -> list[ScheduleFreeState]:
    """The :class:`ScheduleFreeState` s inside ``state`` (a chain's, an optimizer group's, nested
    at any depth), in the order of its leaves.

    Args:
        state: any transform's state.
    """

    def is_schedule_free(node: Any) -> bool:
        return isinstance(node, ScheduleFreeState)

    leaves = optree.tree_leaves(state, is_leaf=is_schedule_free, none_is_leaf=True)
    return [leaf for leaf in leaves if is_schedule_free(leaf)]


def schedule_free_eval_params(state: Any, params: PyTree) -> PyTree:
    """The evaluation weights ``x = (y - (1 - b1) z) / b1`` (``lerp(y, z, 1 - 1/b1)``, as the
    reference's ``optimizer.eval()``) from the parameters ``y`` and a schedule-free state.

    Args:
        state: the state of a transform built with :func:`schedule_free` (alone, in a chain, an
            alias such as :func:`~functional_bagua.schedule_free_adamw`, or fused: then ``params``
            are the flat buffers).
        params: the parameters the model trains with (``y``), the tree ``state`` was made for.

    Returns:
        ``x``, a new tree; a parameter without state (no gradient yet) is given back as it is.

    Raises:
        ValueError: when ``state`` holds no schedule-free state, or more than one.
    """
    return _interpolated(state, params, "eval", lambda b1: 1 - 1 / b1)


def schedule_free_train_params(state: Any, eval_params: PyTree) -> PyTree:
    """The training weights ``y = (1 - b1) z + b1 x`` back from the evaluation weights ``x``
    (``lerp(x, z, 1 - b1)``, as the reference's ``optimizer.train()``).

    Args:
        state: the schedule-free state (as for :func:`schedule_free_eval_params`).
        eval_params: ``x``, as :func:`schedule_free_eval_params` gave it.

    Returns:
        ``y``, a new tree.
    """
    return _interpolated(state, eval_params, "train", lambda b1: 1 - b1)


def _interpolated(state: Any, params: PyTree, mode: str, weight_of: Any) -> PyTree:
    """``lerp(p, z, weight_of(b1))`` per parameter, ``z`` and ``b1`` from the schedule-free state
    that holds that parameter (several under a :func:`~functional_bagua.partition`)."""
    who = f"schedule_free_{mode}_params"
    found = schedule_free_states(state)
    if not found:
        raise ValueError(
            f"{who}: the state holds no schedule-free state; pass the state of a transform built with "
            "fb.schedule_free (fb.schedule_free_adamw, fb.schedule_free_sgd), made by its init for these params"
        )
    p_leaves, spec = tree.flatten(params)
    z_leaves: list[Any] = [None] * len(p_leaves)
    weights: list[Any] = [None] * len(p_leaves)
    for sf in found:
        weight = _weight(weight_of(sf.b1))
        for i, z in enumerate(tree.leaves_matching(spec, sf.z, "the schedule-free state's z", "the params")):
            if z is None:
                continue
            if z_leaves[i] is not None:
                raise ValueError(f"{who}: two schedule-free states hold parameter {tree.leaf_name(spec, i)!r}")
            z_leaves[i], weights[i] = z, weight
    return spec.unflatten(
        [p if z is None or p is None else _lerp(p, z, w) for p, z, w in zip(p_leaves, z_leaves, weights)]
    )


def _lerp(p: torch.Tensor, z: torch.Tensor, weight: Any) -> torch.Tensor:
    """``lerp(p, z, weight)`` in ``z``'s dtype, rounded to ``p``'s: a bfloat16 parameter whose
    ``z`` is float32 (under :func:`~functional_bagua.master_weights`) moves by the float32 rule."""
    wide = p.to(z.dtype)
    return torch.lerp(wide, z, weight if is_number(weight) else weight.to(wide)).to(p.dtype)


def _weight(weight: torch.Tensor) -> Any:
    """The interpolation weight as a Python number where it can be read (the reference's lerp
    weight, not rounded to a low-precision parameter's dtype; one read per state), else as it is
    (moved to each parameter's device and dtype by the caller)."""
    if torch.compiler.is_compiling():
        return weight
    return float(weight)


# where its y and z step keeps what its checks accepted (functional_bagua.accepted); its inner
# z step is a leafwise rule named "schedule_free" too, with keys of its own
_RECORD = ("schedule_free", "y and z written")


def _accepted_inputs(records: Optional[dict], spec: Any, d_leaves: list, ys: list, z: Any) -> Optional[tuple]:
    """The updates, parameters and ``z`` tensors of the leaves with an update and the record's
    chunks (:func:`~functional_bagua.accepted.in_cache_chunks`), where the last step's checks
    accepted these (``records[_RECORD]``, :func:`~functional_bagua.accepted.kept_inputs`; ``z``
    the tree that step stepped); else ``None``."""
    kept = accepted.kept_inputs(records, _RECORD, spec, d_leaves, ys, z)
    return None if kept is None else (kept[1], kept[2], kept[0].columns[0], kept[0].chunks)
