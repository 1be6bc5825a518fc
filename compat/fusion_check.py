"""Does stepping a run of parameters as one tensor change an optimizer's result? Try it once.

Fusion is exact for elementwise updates: if every output element depends only on the same
element of the parameter, gradient and state (plus scalars such as ``step`` and ``lr``), then

    update([p_1; ...; p_n], [g_1; ...; g_n], [s_1; ...; s_n]) == [update(p_1, g_1, s_1); ...]

bit for bit. Optimizers with per-tensor math (a per-parameter gradient-norm clip, a trust ratio
``||p|| / ||u||``, a factored second moment) break it. We cannot read an optimizer's code, so we
test it: :func:`fusion_changes_step` runs the optimizer three steps on copies of a few members of
a run, once tensor by tensor and once fused, with gradients and parameters whose norms differ by
orders of magnitude (so that norm-dependent math cannot agree by accident), and compares the bits
of the parameters and of every state tensor.

The probe runs on a shadow of the optimizer (same class, same attributes, its own param groups
and state, no step hooks), so the real optimizer, its state and its hooks are untouched.

The same two runs also tell how much per-tensor work the optimizer's step does, which decides
whether fusion pays when gradients arrive fresh (:func:`probe`, ``work_per_param``).

A verdict holds for the hyperparameters it was found with, up to what schedules change every
step: :func:`hyperparameter_kinds` is what the caller keys it by. Any change of a hyperparameter
asks for a new probe (a clip threshold lowered from ``inf`` to ``0.1`` starts clipping), except
for the values torch's schedulers move every step (``lr``, ``momentum``, ``betas``,
``weight_decay``), for which only the sign counts (turning momentum or decay on asks again); see ``SCHEDULED``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import OrderedDict, defaultdict
from itertools import cycle
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROBE_STEPS = 3
PROBE_MEMBERS = 3
# ...and more members until the fused probe tensor holds this many elements. CPU kernels run a
# vectorized loop plus a scalar tail, and where the two round differently (bfloat16/float16,
# seen with SGD's ``add_(b, alpha=a)``; runs.fusable_on_its_device keeps those dtypes unfused on
# the CPU anyway) members smaller than one vector (up to 64 bytes) are all tail when stepped
# apart and mostly vectorized when fused: the probe must be long enough to contain vectors.
PROBE_MIN_NUMEL = 512
# norms far apart, the first two already on both sides of any usual clip threshold (a run may
# have only two members)
GRAD_NORMS = (1e4, 1e-4, 1.0)
PARAM_NORMS = (1e2, 1e-2, 1.0)
HALF_GRAD_NORMS = (1e2, 1e-2, 1.0)  # float16/bfloat16: 1e4 would overflow squared moments
PROBE_LR = 1e-3  # used when the group's lr is 0 (e.g. warmup starting at 0), which would hide everything
SINGLE_OP_WORK = 2  # a single-tensor op costs about two slots of a foreach op's list on the CPU


class ProbeResult(NamedTuple):
    """What the probe found. ``reason``: why fusing would change the result (``None``: it would
    not). ``work_per_param``: the per-tensor work of one unfused step per parameter, in slots of
    a foreach op's tensor list (a single-tensor op counts ``SINGLE_OP_WORK``): torch's foreach
    SGD without momentum does 1 (one ``_foreach_add_``), its for-loop SGD 2, foreach Adam 12."""

    reason: Optional[str]
    work_per_param: float


NOT_HYPERPARAMETERS = ("params", "param_names")
# What torch's lr schedulers change every step (LambdaLR ... OneCycleLR and CyclicLR with
# cycle_momentum, which cycles ``momentum`` or ``betas``), the usual other names of the betas, and
# weight decay, which schedules of other libraries move: for these only the sign is kept, so that a schedule does not ask for a probe on every step. Elementwise optimizers
# use them elementwise; per-tensor math switched on by their size alone is not known to exist.
SCHEDULED = ("lr", "momentum", "betas", "b1", "b2", "beta1", "beta2", "weight_decay")


def hyperparameter_kinds(group: dict) -> tuple:
    """A param group's hyperparameters as far as a probe's verdict depends on them: every value
    as it is (a per-tensor clip threshold moving from ``inf`` to ``0.1`` must be probed again),
    except the ``SCHEDULED`` numbers, kept by their sign, and tensors, kept by dtype, device
    and shape (reading their values would synchronise an accelerator on every step); unhashable
    values by their type.

        >>> hyperparameter_kinds({"params": [], "lr": 1e-3, "max_grad_norm": 0.5, "amsgrad": False})
        (('lr', (<class 'float'>, 1)), ('max_grad_norm', 0.5), ('amsgrad', False))
    """
    return tuple(
        (key, _sign_kind(value) if key in SCHEDULED else _kind(value))
        for key, value in group.items()
        if key not in NOT_HYPERPARAMETERS
    )


def _sign_kind(value: object) -> object:
    """A scheduled value by its sign (each element of a tuple such as ``betas``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value), (value > 0) - (value < 0)
    if isinstance(value, (tuple, list)):
        return type(value), tuple(map(_sign_kind, value))
    return _kind(value)


def _kind(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return torch.Tensor, value.dtype, value.device, tuple(value.shape)
    if isinstance(value, (tuple, list)):
        return type(value), tuple(map(_kind, value))
    if isinstance(value, float) and value != value:  # NaN != NaN: keep plans keyed by it stable
        return float, "nan"
    try:
        hash(value)
    except TypeError:
        return type(value)
    return value


def fusion_changes_step(optimizer: torch.optim.Optimizer, group: dict, run: list) -> Optional[str]:
    """Why stepping ``run`` (parameters of ``group``) as one flat tensor would change the result,
    or ``None`` if the fused and unfused probe steps agree bit for bit."""
    return probe(optimizer, group, run).reason


def probe(optimizer: torch.optim.Optimizer, group: dict, run: list) -> ProbeResult:
    """Step copies of a few members of ``run`` tensor by tensor and as one flat tensor (module
    docstring), compare the bits, and count the work of each after the first step: the fused
    step works on one tensor, the unfused one on ``k`` members, and ops that do not depend on
    the number of tensors (``step`` counters of foreach code, profiler records) cancel out of
    ``(unfused - fused) / (k - 1)``."""
    if group.get("fused"):
        return ProbeResult(
            "torch's fused=True kernel already steps all tensors in one launch, and its vectorized "
            "code rounds differently depending on where an element sits, so a flat tensor changes bits",
            0.0,
        )
    if group.get("differentiable"):
        return ProbeResult("differentiable=True builds an autograd graph through each parameter's update", 0.0)
    members = probe_members(run)
    gen = torch.Generator(device="cpu").manual_seed(0)  # drawn on the CPU whatever the default device
    half = members[0].element_size() <= 2
    start = [_random_like(p, norm, gen) for p, norm in zip(members, cycle(PARAM_NORMS))]
    grads = [
        [_random_like(p, norm, gen) for p, norm in zip(members, cycle(HALF_GRAD_NORMS if half else GRAD_NORMS))]
        for _ in range(PROBE_STEPS)
    ]
    states = [_clone_state(optimizer.state.get(p, {})) for p in members]

    separate = [torch.nn.Parameter(t.clone()) for t in start]
    separate_state = {p: _clone_state(s) for p, s in zip(separate, states)}
    fused = torch.nn.Parameter(torch.cat([t.reshape(-1) for t in start]))
    fused_state = {fused: _fuse_states(states)}
    separate_work, fused_work = _WorkCounter(), _WorkCounter()
    try:
        _run(optimizer, group, separate, separate_state, grads, separate_work)
    except Exception as e:  # the optimizer cannot step copies: do not fuse what we cannot check
        return ProbeResult(f"it failed on a probe step ({type(e).__name__}: {e})", 0.0)
    try:
        _run(
            optimizer,
            group,
            [fused],
            fused_state,
            [[torch.cat([g.reshape(-1) for g in gs])] for gs in grads],
            fused_work,
        )
    except Exception as e:
        return ProbeResult(f"its step fails on a fused tensor ({type(e).__name__}: {e})", 0.0)

    work = (separate_work.total - fused_work.total) / ((len(members) - 1) * (PROBE_STEPS - 1))
    if not _same_bits(fused.detach(), torch.cat([p.detach().reshape(-1) for p in separate])):
        return ProbeResult(
            "fused and unfused probe steps give different parameters (per-tensor math, or kernels "
            "whose rounding depends on an element's position, as CPU half-precision ones can)",
            work,
        )
    return ProbeResult(_state_difference(fused, fused_state[fused], [separate_state[p] for p in separate]), work)


class _WorkCounter(TorchDispatchMode):
    """Counts the work of the ATen ops run under it: the length of a foreach op's tensor list,
    :data:`SINGLE_OP_WORK` for any other op."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Optional[dict] = None,
    ) -> Any:
        is_foreach = func.__name__.startswith("_foreach_") and args and isinstance(args[0], (list, tuple))
        self.total += len(args[0]) if is_foreach else SINGLE_OP_WORK
        return func(*args, **(kwargs or {}))


def probe_members(run: list) -> list:
    """A few members to copy: the smallest of each number of dimensions first (shape-dependent
    math, such as factored moments, needs 1-D and 2-D), then the smallest others, at least
    ``PROBE_MEMBERS`` and, while the run has more, until they hold ``PROBE_MIN_NUMEL``
    elements; small, so the probe stays cheap even when the run holds an embedding table."""
    by_size = sorted(run, key=lambda p: p.numel())
    chosen = []
    for ndim in sorted({p.dim() for p in run}):
        chosen.append(next(p for p in by_size if p.dim() == ndim))
    chosen += [p for p in by_size if all(p is not c for c in chosen)]
    count, numel = 0, 0
    while count < len(chosen) and (count < PROBE_MEMBERS or numel < PROBE_MIN_NUMEL):
        numel += chosen[count].numel()
        count += 1
    return chosen[:count]


def _random_like(p: torch.Tensor, norm: float, gen: torch.Generator) -> torch.Tensor:
    """Random values of ``p``'s shape, dtype and device whose L2 norm is about ``norm``."""
    values = torch.randn(p.shape, generator=gen, dtype=torch.float64, device="cpu") * (norm / math.sqrt(p.numel()))
    return values.to(dtype=p.dtype, device=p.device)


def _clone_state(state: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


def _fuse_states(states: list) -> dict:
    """The state a fused parameter gets: parameter-shaped tensors concatenated, scalars from the
    first member (a run's members share them)."""
    fused = {}
    for key, value in states[0].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            fused[key] = torch.cat([s[key].reshape(-1) for s in states])
        else:
            fused[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return fused


def _shadow(optimizer: torch.optim.Optimizer, group: dict, params: list, state: dict) -> torch.optim.Optimizer:
    """An optimizer of the same class and attributes stepping ``params`` with ``group``'s
    hyperparameters and its own ``state``; no hooks, no link back to ``optimizer``."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(vars(optimizer))
    for patched in ("step", "fuse_step", "_bagua_fusion"):  # lr-scheduler wrapper, our own attributes
        shadow.__dict__.pop(patched, None)
    probe_group = {**group, "params": params}
    if isinstance(probe_group.get("lr"), (int, float)) and probe_group["lr"] == 0:
        probe_group["lr"] = PROBE_LR
    shadow.param_groups = [probe_group]
    shadow.state = defaultdict(dict, state)
    shadow._optimizer_step_pre_hooks = OrderedDict()
    shadow._optimizer_step_post_hooks = OrderedDict()
    return shadow


def _run(
    optimizer: torch.optim.Optimizer, group: dict, params: list, state: dict, grads_per_step: list, work: _WorkCounter
) -> None:
    """Step ``params`` on ``grads_per_step``; ``work`` counts every step but the first (which
    may create state)."""
    shadow = _shadow(optimizer, group, params, state)
    for i, grads in enumerate(grads_per_step):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        with work if i > 0 else contextlib.nullcontext():
            type(optimizer).step(shadow)
    state.clear()
    state.update(shadow.state)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (so equal NaNs count as equal, and -0.0 differs from 0.0)."""
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def _state_difference(fused: torch.Tensor, fused_state: dict, separate_states: list) -> Optional[str]:
    for s in separate_states:
        if set(s) != set(fused_state):
            return f"fused and unfused probe steps keep different state keys ({sorted(map(str, fused_state))} vs {sorted(map(str, s))})"
    for key, value in fused_state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != fused.shape:
                return f"its state {key!r} has shape {tuple(value.shape)}, not the parameter's (per-tensor state)"
            joined = torch.cat([s[key].reshape(-1) for s in separate_states])
            if not _same_bits(value, joined):
                return f"fused and unfused probe steps give different state {key!r} (per-tensor math)"
        elif isinstance(value, torch.Tensor):
            if not all(_same_bits(value, s[key]) for s in separate_states):
                return f"fused and unfused probe steps give different scalar state {key!r}"
        elif not all(_equal_values(value, s[key]) for s in separate_states):
            return f"fused and unfused probe steps give different state {key!r}"
    return None


def _equal_values(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False
