"""torch's hand-fused optimizer kernels, for the aliases that have one.

``torch._fused_adam_``, ``torch._fused_adamw_`` and ``torch._fused_sgd_`` (what
``torch.optim.Adam/AdamW/SGD(fused=True)`` run) update parameters and moments in place, one
kernel per list of tensors. On a flat buffer the list has one tensor per group, so the whole
optimizer step is one kernel: the fastest update these machines have (benchmarks/RESULTS.md).

An alias built with plain-number hyperparameters records which kernel computes it, with the
kernel's arguments, in one place (:func:`tag`); :func:`functional_bagua.fuse_inplace` uses the
kernel when asked. The kernel finds the moments it updates in the alias's state by their type
(:class:`~functional_bagua.ScaleByAdamState`, :class:`~functional_bagua.TraceState`), wherever the
chain puts them. The kernel's numbers are those of ``torch.optim``'s fused optimizers (bitwise,
elementwise on the flat buffer) and within float rounding of the pure update.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union, cast

import optree
import torch

from functional_bagua import tree
from functional_bagua.base import GradientTransformation
from functional_bagua.transforms.adam import ScaleByAdamState, ScaleByAmsgradState
from functional_bagua.transforms.momentum import TraceState
from functional_bagua.tree import PyTree

STEP_DTYPE = torch.float32  # torch's fused kernels read the step count as a float tensor


class KernelSpec(NamedTuple):
    """``kind``: "adam", "adamw" or "sgd"; ``hyper``: the kernel's keyword arguments."""

    kind: str
    hyper: dict


MOMENTS = {
    "adam": (ScaleByAdamState, ScaleByAmsgradState),
    "adamw": (ScaleByAdamState, ScaleByAmsgradState),
    "sgd": (TraceState,),
}


def tag(tx: GradientTransformation, kind: str, **hyper: Any) -> GradientTransformation:
    """Record on ``tx`` that torch's ``kind`` kernel computes it with ``hyper`` (the kernel's
    keyword arguments: the one place the kernel reads them from).

    Args:
        tx: the alias's transform.
        kind: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        **hyper: the kernel's keyword arguments (``lr``, ``beta1``, ..., ``maximize``).

    Returns:
        ``tx``.
    """
    tx.update.fused_kernel = KernelSpec(kind, hyper)  # type: ignore[attr-defined]
    return tx


def spec_of(tx: GradientTransformation) -> Optional[KernelSpec]:
    """The kernel recorded on ``tx`` by :func:`tag`, if any."""
    return getattr(tx.update, "fused_kernel", None)


def run(
    spec: KernelSpec,
    grads: dict,
    state: tuple,
    params: dict,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """One optimizer step in place: ``params`` and ``state`` (the alias's own, from its ``init``
    over these parameters or flat buffers) are overwritten; ``grads`` are read only. Only the
    keys of ``params`` are stepped (a state may hold more). The per-tensor bookkeeping (step
    counts) is one multi-tensor op, so the step costs about what ``torch.optim``'s fused one does.

    ``grad_scale`` and ``found_inf`` are what ``torch.amp.GradScaler`` gives an optimizer whose
    step takes them (``_step_supports_amp_scaling``): the kernel divides the gradients by the
    scale as it reads them, and where ``found_inf`` is nonzero it changes nothing and the step
    counts go back, as torch's fused optimizers do."""
    moments = moments_of(spec.kind, state)
    for keys in _by_device_and_dtype(params):  # what one kernel call takes (torch.optim groups so too)
        device = params[keys[0]].device
        scale = None if grad_scale is None else grad_scale.to(device, non_blocking=True)
        inf = None if found_inf is None else found_inf.to(device, non_blocking=True)
        _run_on(spec, moments, keys, grads, params, scale, inf)


def _by_device_and_dtype(params: dict) -> list[list]:
    groups: dict[tuple, list] = {}
    for k, p in params.items():
        groups.setdefault((p.device, p.dtype), []).append(k)
    return list(groups.values())


def _run_on(
    spec: KernelSpec,
    moments: Any,
    keys: list,
    grads: dict,
    params: dict,
    grad_scale: Optional[torch.Tensor],
    found_inf: Optional[torch.Tensor],
) -> None:
    as_real = _reals if any(params[k].is_complex() for k in keys) else lambda tensors: tensors
    p, g = as_real([params[k] for k in keys]), as_real([grads[k] for k in keys])
    amp: dict[str, Any] = dict(grad_scale=grad_scale, found_inf=found_inf)
    if spec.kind == "sgd":
        _sgd(spec.hyper, cast(Optional[TraceState], moments), keys, p, g, as_real, amp)
        return
    assert isinstance(moments, (ScaleByAdamState, ScaleByAmsgradState))  # moments_of raised if there were none
    counts = [moments.count[k] for k in keys]
    torch._foreach_add_(counts, 1)
    # on the parameters' device, as the kernel reads them (fb.Optimizer may hold its counts on the CPU)
    device = p[0].device
    steps = _stacked(counts).to(device, STEP_DTYPE).unbind() if len(counts) > 1 else [counts[0].to(device, STEP_DTYPE)]
    mu, nu = as_real([moments.mu[k] for k in keys]), as_real([moments.nu[k] for k in keys])
    max_nu = as_real([cast(ScaleByAmsgradState, moments).nu_max[k] for k in keys]) if spec.hyper["amsgrad"] else []
    kernel = torch._fused_adamw_ if spec.kind == "adamw" else torch._fused_adam_
    kernel(p, g, mu, nu, max_nu, list(steps), **spec.hyper, **amp)
    _undo_counts_if(found_inf, counts)


def _undo_counts_if(found_inf: Optional[torch.Tensor], counts: list) -> None:
    """Where ``found_inf`` is nonzero the kernel skipped the step: take back its count."""
    if found_inf is not None:
        torch._foreach_sub_(counts, [found_inf.to(counts[0].device, counts[0].dtype)] * len(counts))


FUNCTIONAL = {"adam": "_fused_adam", "adamw": "_fused_adamw", "sgd": "_fused_sgd"}


def runs_pure(spec: Optional[KernelSpec]) -> bool:
    """Whether :func:`run_pure` computes ``spec``'s alias: torch has a functional form of every
    kernel; SGD's first step with dampening needs a Python decision per step, so not that one."""
    return spec is not None and not (
        spec.kind == "sgd" and spec.hyper["momentum"] != 0 and spec.hyper["dampening"] != 0
    )


def run_pure(spec: KernelSpec, grads: dict, state: PyTree, params: dict) -> tuple[dict, PyTree]:
    """One optimizer step with the functional form of torch's kernel (``aten::_fused_adamw`` and
    its siblings: new tensors out, nothing overwritten), so it can run inside a traced, pure step:
    ``(new params, new state)``; the numbers of :func:`run` (``torch.optim``'s fused optimizers).

    Args:
        spec: the kernel of the alias (:func:`spec_of`); :func:`runs_pure` must hold.
        grads: the gradients, a dict of the buffers of ``params``.
        state: the alias's state (from its ``init`` over the same buffers).
        params: the parameters (not changed).
    """
    keys = list(params)
    moments: Any = moments_of(spec.kind, state)  # its fields are trees over the buffers
    p, g = [_real(params[k]) for k in keys], [_real(grads[k]) for k in keys]
    op = getattr(torch.ops.aten, FUNCTIONAL[spec.kind])
    if spec.kind == "sgd":
        traces = [] if moments is None or spec.hyper["momentum"] == 0 else [_real(moments.trace[k]) for k in keys]
        # without dampening a first step from a zero buffer is exactly a later one: b = m * 0 + g
        new_p, _, new_traces = op(p, g, traces, is_first_step=False, **spec.hyper)
        new_moments = None
        if moments is not None:
            count = {k: moments.count[k] + 1 for k in keys}
            trace = (
                dict(zip(keys, (_back(t, moments.trace[k]) for t, k in zip(new_traces, keys))))
                if traces
                else moments.trace
            )
            new_moments = tree.replaced(moments, count=count, trace=trace)
    else:
        assert moments is not None  # moments_of raised if there were none
        count = {k: moments.count[k] + 1 for k in keys}
        steps = [count[k].to(STEP_DTYPE) for k in keys]
        amsgrad = spec.hyper["amsgrad"]
        max_nu = [_real(moments.nu_max[k]) for k in keys] if amsgrad else []
        mu, nu = [_real(moments.mu[k]) for k in keys], [_real(moments.nu[k]) for k in keys]
        new_p, _, new_mu, new_nu, new_max = op(p, g, mu, nu, max_nu, steps, **spec.hyper)
        fields = dict(
            count=count,
            mu={k: _back(t, moments.mu[k]) for t, k in zip(new_mu, keys)},
            nu={k: _back(t, moments.nu[k]) for t, k in zip(new_nu, keys)},
        )
        if amsgrad:
            fields["nu_max"] = {
                k: _back(t, cast(ScaleByAmsgradState, moments).nu_max[k]) for t, k in zip(new_max, keys)
            }
        new_moments = tree.replaced(moments, **fields)
    new_state = _replacing(state, moments, new_moments)
    return {k: _back(t, params[k]) for t, k in zip(new_p, keys)}, new_state


def _replacing(state: PyTree, old: Any, new: Any) -> PyTree:
    """``state`` with its moments ``old`` replaced by ``new``."""
    if old is None:
        return state
    types = (type(old),)
    return optree.tree_map(
        lambda s: new if s is old else s, state, is_leaf=lambda s: isinstance(s, types), none_is_leaf=True
    )


def _back(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A kernel output as ``like``'s kind of tensor (complex buffers went in as real views)."""
    return torch.view_as_complex(t) if like.is_complex() else t


def moments_of(kind: str, state: PyTree) -> Optional[Union[ScaleByAdamState, ScaleByAmsgradState, TraceState]]:
    """The one state of ``kind``'s moment type in ``state`` (a sgd without momentum has none:
    ``None``); a ValueError if there are several, or none where the kernel needs them.

    Args:
        kind: the kernel's kind.
        state: the alias's state, any tree of states.
    """
    types = MOMENTS[kind]
    found = [
        s
        for s in optree.tree_leaves(state, is_leaf=lambda s: isinstance(s, types), none_is_leaf=True)
        if isinstance(s, types)
    ]
    if len(found) > 1:
        raise ValueError(f"torch's {kind} kernel: the state holds {len(found)} {types[0].__name__}s; it updates one")
    if not found and kind != "sgd":
        raise ValueError(f"torch's {kind} kernel: the state holds no {types[0].__name__} to update")
    return found[0] if found else None


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex buffer as its real view (each number as two reals), as torch.optim steps complex
    parameters; the kernels are elementwise, so this is the complex update."""
    return torch.view_as_real(t) if t.is_complex() else t


def _reals(tensors: list) -> list:
    return [_real(t) for t in tensors]


def _sgd(
    hyper: dict, moments: Optional[TraceState], keys: list, p: list, g: list, as_real: Callable, amp: dict
) -> None:
    if hyper["momentum"] == 0 or moments is None:
        torch._fused_sgd_(p, g, [], is_first_step=False, **hyper, **amp)
        return
    # the kernel's first step copies the gradient into the momentum buffer: one call per kind of entry
    counts = [moments.count[k] for k in keys]
    # which entries start from zero; while a CUDA graph is captured (after its warm-up steps, so
    # none does) the host cannot read device memory
    first = [False] * len(keys) if _capturing() else (_stacked(counts) == 0).tolist()
    traces = as_real([moments.trace[k] for k in keys])
    for is_first_step in (True, False):
        chosen = [i for i, f in enumerate(first) if f == is_first_step]
        if chosen:
            torch._fused_sgd_(
                [p[i] for i in chosen],
                [g[i] for i in chosen],
                [traces[i] for i in chosen],
                is_first_step=is_first_step,
                **hyper,
                **amp,
            )
    torch._foreach_add_(counts, 1)
    _undo_counts_if(amp["found_inf"], counts)


def _stacked(counts: list) -> torch.Tensor:
    """``counts`` (0-dim tensors) as one vector, on the first one's device: taken there one by one
    only where they are on several (a trainer moved part of the state)."""
    try:
        return torch.stack(counts)
    except RuntimeError:
        return torch.stack([c.to(counts[0].device) for c in counts])


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
