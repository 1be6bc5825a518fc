"""Bagua's fused optimizer, rebuilt for torch 2.x: any optimizer steps runs of parameters as one.

    optimizer = fuse_optimizer(torch.optim.Adadelta(model.parameters(), lr=1.0))
    loss.backward()
    optimizer.fuse_step()        # the same result as optimizer.step(), bit for bit

Why it is exact. For an elementwise optimizer the update of element ``j`` of a parameter reads
only element ``j`` of the parameter, its gradient and its state, plus scalars shared by the
whole step (``lr``, ``step``). So for a run of parameters ``p_1 .. p_n`` lying back to back in
memory, with their gradients and state tensors lying back to back the same way,

    step([p_1; ...; p_n], [g_1; ...; g_n], [s_1; ...; s_n]) == [step(p_1, g_1, s_1); ...; step(p_n, g_n, s_n)]

and the left side costs a few kernel launches instead of a few per parameter. ``fuse_step``
finds such runs, hands the optimizer one flat view per run (a ``Parameter`` sharing the
storage) with a flat gradient and flat state, calls the optimizer's own ``step`` once, and
writes scalar state (``step`` counters) back to every member.

What makes a run (:mod:`functional_bagua.compat.runs`): consecutive parameters of one param
group that have a dense gradient, lie back to back in one storage (``do_flatten=True`` arranges
that once, per (group, device, dtype): :mod:`functional_bagua.compat.flatten`), and whose state has the same keys, kinds and scalar
values. Gradients and state tensors that are not back to back yet (a fresh ``backward`` after
``zero_grad(set_to_none=True)``, a ``load_state_dict``) are copied into the group's flat buffers
and re-pointed there. Everything else (no gradient, sparse, a gradient of another dtype
(``p.grad_dtype``), a 0-dim parameter, odd state and, on the CPU, a parameter above 32k
elements, whose own kernels are long enough already, or in bfloat16/float16, whose kernels round
differently by position) is stepped as it is, in the same ``step`` call. On the CPU a run
reaches the optimizer in 4 MiB pieces, so a for-loop optimizer's temporaries stay small. The
plan is kept between steps and re-checked with a few pointer comparisons per parameter; a plain
``step()`` in between just makes the next ``fuse_step`` plan again.

Optimizers with per-tensor math (per-parameter norms, clipping, trust ratios) are not
elementwise. The first time a group would be fused, ``fuse_step`` steps copies of a few of its
parameters both ways (:mod:`functional_bagua.compat.fusion_check`); if the bits differ it warns
once and steps that group unfused from then on. The verdict is kept per kind of hyperparameters
(:func:`~functional_bagua.compat.fusion_check.hyperparameter_kinds`): a new ``lr`` (or
``momentum``, ``betas``, ``weight_decay``, of the same sign) keeps it, any other change (a clip
threshold from ``inf`` to ``0.1``) asks for a new probe. Fusion never changes a result silently.

Fresh gradients cost a copy. After ``zero_grad(set_to_none=True)`` every gradient is a new
tensor, which the fused step first copies into the flat gradient: about one foreach slot per
parameter, and checking the plan costs about as much again. An optimizer whose own step does
less per-tensor work than ``FRESH_GRADS_MIN_WORK`` (the same probe counts it; torch's SGD
without momentum is one ``_foreach_add_``, or one ``add_`` per tensor in its for-loop version)
is no faster fused then, so ``fuse_step`` steps such a group as ``step()`` would whenever its
gradients are fresh, and fused when they are in place.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch

from functional_bagua.compat import fusion_check
from functional_bagua.compat.flatten import FlattenedGroup, Home, warn_not_flat
from functional_bagua.compat.fusion_check import ProbeResult, hyperparameter_kinds, probe
from functional_bagua.compat.runs import Run, candidate_runs
from functional_bagua.flat import span

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer", "fused_steps"]

_grad_of = attrgetter("grad")
_NO_STATE: dict = {}  # what a plan check reads for a parameter without state (never written)
# Per-tensor work per parameter (foreach slots, see fusion_check.ProbeResult) below which an
# optimizer's step is cheaper unfused than copying fresh gradients into the flat buffer: fused
# with fresh gradients, torch's SGD without momentum (1 slot foreach, 2 for-loop) was no faster
# than step(), SGD with momentum (3) was (benchmarks/RESULTS.md, the fuse_step section).
FRESH_GRADS_MIN_WORK = 3

_Optimizer = TypeVar("_Optimizer", bound=torch.optim.Optimizer)


def fuse_optimizer(optimizer: _Optimizer, do_flatten: bool = True, check_flatten: bool = True) -> _Optimizer:
    """Give ``optimizer`` a fused step, ``optimizer.fuse_step(closure=None)``, and return it.

    Args:
        optimizer: any ``torch.optim.Optimizer``, torch's or your own.
        do_flatten: move each param group's trainable parameters into one buffer per (device,
            dtype) now (``p.data`` becomes a view; the ``Parameter`` objects stay the same), and
            their gradients and state tensors into buffers of the same layout. On the CPU a
            parameter above 32k elements stays where it is (it is stepped on its own; a flat
            copy would only cost memory). Without it, ``fuse_step`` fuses only parameters that
            already lie back to back (e.g. flattened by someone else).
        check_flatten: before each ``fuse_step``, check that the flattened parameters still
            view their buffers; if one does not (``p.data`` was replaced), warn once and flatten
            again. Either way the result stays correct: a parameter that moved away is just
            stepped on its own. Only meaningful with ``do_flatten``.

    ``optimizer.step()`` keeps working unfused, and the two can be mixed freely. Fusing the same
    optimizer twice raises ``RuntimeError``. ``optimizer._bagua_fused_count`` counts, like
    Bagua's, the param groups that were stepped fused, summed over ``fuse_step`` calls.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = fuse_optimizer(torch.optim.Adadelta(model.parameters(), lr=1.0))
        >>> model(torch.ones(3, 4)).sum().backward()
        >>> optimizer.fuse_step()
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fuse_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_fused_optimizer(optimizer):
        raise RuntimeError(f"this {type(optimizer).__name__} is already fused; fuse_optimizer was called twice on it")
    fusion = _Fusion(optimizer, do_flatten=do_flatten, check_flatten=check_flatten)
    # Bagua's API: the fused step and its counter live on the optimizer object itself
    vars(optimizer).update(_bagua_fusion=fusion, _bagua_fused_count=0, fuse_step=fusion.step)
    return optimizer


def is_fused_optimizer(optimizer: object) -> bool:
    """Whether ``fuse_optimizer`` was applied to ``optimizer``.

    Args:
        optimizer: any object; ``False`` for anything but an optimizer :func:`fuse_optimizer` returned.
    """
    return isinstance(getattr(optimizer, "_bagua_fusion", None), _Fusion)


def fuse_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None) -> Any:
    """``optimizer.fuse_step(closure)`` for an optimizer returned by :func:`fuse_optimizer`:
    one optimizer step, with runs of parameters stepped as one tensor. Returns the closure's loss.

    With a closure, the closure is evaluated once before the step (its gradients are what gets
    fused); an optimizer that calls the closure again (e.g. LBFGS) re-evaluates it from then on.

    Args:
        optimizer: an optimizer returned by :func:`fuse_optimizer` (a RuntimeError otherwise).
        closure: as for ``optimizer.step``: a function that recomputes the gradients and returns the
            loss, or ``None``; without one, this returns what the optimizer's own ``step()`` returns.
    """
    if not is_fused_optimizer(optimizer):
        raise RuntimeError(
            f"fuse_step needs an optimizer passed through fuse_optimizer first; got a plain {type(optimizer).__name__}"
        )
    return vars(optimizer)["_bagua_fusion"].step(closure)


@contextlib.contextmanager
def fused_steps(optimizer: _Optimizer) -> Iterator[_Optimizer]:
    """Within the block, ``optimizer.step`` means ``optimizer.fuse_step``: for code that calls
    ``step()`` itself, such as ``GradScaler.step``::

        scaler.scale(loss).backward()
        with fused_steps(optimizer):
            scaler.step(optimizer)       # unscale, skip on inf/NaN, else a fused step
        scaler.update()

    Args:
        optimizer: an optimizer returned by :func:`fuse_optimizer` (a RuntimeError otherwise); its
            own ``step`` attribute is restored when the block exits.

    Yields:
        ``optimizer``.
    """
    if not is_fused_optimizer(optimizer):
        raise RuntimeError(
            f"fused_steps needs an optimizer passed through fuse_optimizer; got {type(optimizer).__name__}"
        )
    own = vars(optimizer)  # an instance attribute "step" shadows the class's (as lr schedulers' wrappers do)
    had_own_step = "step" in own
    original = own.get("step")
    own["step"] = _FusedAlias(own["_bagua_fusion"], original)
    try:
        yield optimizer
    finally:
        if had_own_step:
            own["step"] = original
        else:
            del own["step"]


class _FusedAlias:
    """``optimizer.step`` inside :func:`fused_steps`; remembers the step it stands in for."""

    def __init__(self, fusion: "_Fusion", original: Optional[Callable]) -> None:
        self.fusion, self.original = fusion, original

    def __call__(self, closure: Optional[Callable] = None, **kwargs: Any) -> Any:
        if kwargs:  # e.g. grad_scaler=..., for optimizers with their own AMP handling
            raise TypeError(f"fuse_step takes only a closure, got {sorted(kwargs)}")
        return self.fusion.step(closure)


class _GroupPlan:
    """How one param group is stepped: ``runs`` fused, ``alone`` as they are. It holds while the
    group has the same parameters with the same kinds of hyperparameters, the same ones have
    gradients, and every run holds (:meth:`Run.holds`).

    Args:
        param_ids: the ids of the group's parameters when planned.
        kinds: :func:`hyperparameter_kinds` of the group when planned.
        values: the group's values when planned (the objects themselves, see :meth:`same_hyperparameters`).
        runs: the runs stepped fused.
        alone: the parameters stepped as they are.
        cheap: every run's optimizer work per parameter is below :data:`FRESH_GRADS_MIN_WORK`.
    """

    def __init__(self, param_ids: tuple, kinds: tuple, values: tuple, runs: list, alone: list, cheap: bool) -> None:
        self.param_ids, self.kinds, self.values = param_ids, kinds, values
        self.runs, self.alone, self.cheap = runs, alone, cheap
        self.alone_has_grad = [p.grad is not None for p in alone]
        self.first_grad_seen: Optional[weakref.ref] = None  # the first member's gradient at the last fuse_step

    def holds(self, param_ids: tuple, kinds: tuple, state: dict, grads: list) -> bool:
        """Whether the group is still as planned (class docstring), its runs' members having the
        gradients ``grads`` (one list per run, :meth:`Run.moved_gradients`). Reads only."""
        return (
            self.param_ids == param_ids
            and self.kinds == kinds
            and list(map(is_not, map(_grad_of, self.alone), repeat(None))) == self.alone_has_grad
            and all(run.holds(_states_of(run.params, state), run_grads) for run, run_grads in zip(self.runs, grads))
        )

    def gradients_are_fresh(self) -> bool:
        """Whether the group's gradients are new tensors (after ``zero_grad(set_to_none=True)``): the
        first member's decides, fresh unless it is its flat view or the one the last ``fuse_step``
        saw (it survived ``zero_grad(set_to_none=False)``; the fused path then moves it into the flat
        buffer, and later steps find it in place)."""
        first = self.runs[0]
        grad = first.params[0].grad
        if grad is None or grad is first.grads.members[0]:
            return False
        return self.first_grad_seen is None or self.first_grad_seen() is not grad

    def remember_gradients(self) -> None:
        grad = self.runs[0].params[0].grad
        self.first_grad_seen = None if grad is None else weakref.ref(grad)

    def same_hyperparameters(self, group: dict) -> bool:
        """Whether ``group``'s hyperparameters have the kinds they were planned with: at once when
        every value is the object it was, else by computing the kinds. Only for deciding to step
        unfused: the identity test misses a value changed in place (a list's item), and missing it
        only leaves the group unfused, which is exact."""
        values = tuple(group.values())
        if len(values) == len(self.values) and all(map(is_, values, self.values)):
            return True
        return self.kinds == hyperparameter_kinds(group)


class _Fusion:
    """The fused step of one optimizer (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, do_flatten: bool, check_flatten: bool) -> None:
        # a weak reference: the optimizer holds us (and fuse_step), and a cycle would keep its
        # buffers alive until the garbage collector runs
        self._optimizer = weakref.ref(optimizer)
        self.do_flatten, self.check_flatten = do_flatten, check_flatten
        self.flattened: dict = {}  # group index -> (ids of the group's params, FlattenedGroup)
        self.plans: dict = {}  # group index -> _GroupPlan of the last fused step
        self.probes: dict = {}  # (param ids, device, dtype, ndims) -> (hyperparameter kinds, ProbeResult)
        self.warned_reprobing: set = set()  # group indices warned about (see _probe)
        self.warned_not_flat = False
        self.warned_unfused: set = set()  # (group index, dtype, reason) already warned about
        if do_flatten:
            for index, group in enumerate(optimizer.param_groups):
                self._flatten(index, group)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError(
                "fuse_step was called after its optimizer was freed: keep a reference to the optimizer, "
                "not only to optimizer.fuse_step (it holds the optimizer weakly, as torch's lr schedulers do)"
            )
        return optimizer

    # ---- the step -------------------------------------------------------------------------

    def step(self, closure: Optional[Callable] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            closure = _evaluated_once(closure, loss)
        optimizer = self.optimizer
        fused = []
        for index, group in enumerate(optimizer.param_groups):
            planned = self._plan_to_fuse(index, group)
            if planned is not None:
                fused.append((group, *planned))
        vars(optimizer)["_bagua_fused_count"] += len(fused)
        plain_step = _plain_step(optimizer)
        with _runs_as_parameters(optimizer, fused) if fused else contextlib.nullcontext():
            result = plain_step(closure) if closure is not None else plain_step()
        return loss if closure is not None else result

    # ---- planning -------------------------------------------------------------------------

    def _plan_to_fuse(self, index: int, group: dict) -> Optional[tuple]:
        """``(plan, grads)``: the plan group ``index`` is stepped by this time and its runs'
        gradients (:meth:`Run.moved_gradients`), or ``None`` to step the group as ``step()``
        does: it has nothing to fuse, or its optimizer does little work per tensor (as probed for
        its current kinds of hyperparameters: turning momentum on makes it more) and its gradients
        are fresh, so that copying them into the flat buffer would cost what fusion saves."""
        plan = self.plans.get(index)
        if plan is not None and plan.cheap:
            fresh = plan.gradients_are_fresh()
            plan.remember_gradients()
            if fresh and plan.same_hyperparameters(group):
                return None
        plan, grads = self._plan(index, group)
        return (plan, grads) if plan.runs else None

    def _plan(self, index: int, group: dict) -> tuple:
        """``(plan, grads)``: the last step's plan if it still holds, else a new one (flattening
        the group again first if its parameters changed or, with ``check_flatten``, left their
        buffers), and the gradients its runs' members have now."""
        param_ids, kinds = tuple(map(id, group["params"])), hyperparameter_kinds(group)
        plan = self.plans.get(index)
        if plan is not None:
            grads = [run.moved_gradients() for run in plan.runs]
            if plan.holds(param_ids, kinds, self.optimizer.state, grads):
                return plan, grads
        if self.do_flatten:
            self._keep_flat(index, group, param_ids)
        plan = self.plans[index] = self._new_plan(index, group, param_ids, kinds)
        return plan, [run.moved_gradients() for run in plan.runs]

    def _new_plan(self, index: int, group: dict, param_ids: tuple, kinds: tuple) -> _GroupPlan:
        state = self.optimizer.state
        candidates, alone = candidate_runs(group["params"], state)
        runs, work = [], []
        for params in candidates:
            flat = span(params) if len(params) > 1 else None
            found = self._probe(index, group, params, param_ids, kinds) if flat is not None else None
            if flat is None or found is None or found.reason is not None:
                alone.extend(params)
                continue
            runs.append(Run(params, flat, state, self._home(index, params[0], flat.numel())))
            work.append(found.work_per_param)
        cheap = bool(work) and max(work) < FRESH_GRADS_MIN_WORK
        return _GroupPlan(param_ids, kinds, tuple(group.values()), runs, alone, cheap)

    def _probe(self, index: int, group: dict, params: list, param_ids: tuple, kinds: tuple) -> ProbeResult:
        """The probe's result for a run of ``params``: run once per group (its parameters),
        device, dtype and numbers of dimensions among the members (an optimizer may treat
        matrices per tensor and vectors elementwise, and the first run probed may hold only
        vectors), and again whenever the group's kinds of hyperparameters change (only the last
        verdict is kept, so a value that changes every step costs a probe per step, never
        memory); warns if fusion would change the result."""
        key = (param_ids, params[0].device, params[0].dtype, tuple(sorted({p.dim() for p in params})))
        known = self.probes.get(key)
        if known is not None and known[0] == kinds:
            return known[1]
        if known is not None:
            self._warn_reprobing(index, known[0], kinds)
        found = probe(self.optimizer, group, params)
        self.probes[key] = (kinds, found)
        warning = (index, params[0].dtype, found.reason)
        if found.reason is not None and warning not in self.warned_unfused:
            self.warned_unfused.add(warning)
            warnings.warn(
                f"fuse_step: {type(self.optimizer).__name__} param group {index} ({params[0].dtype}) stays "
                f"unfused: {found.reason}. fuse_step steps it tensor by tensor, as step() does.",
                RuntimeWarning,
                stacklevel=6,
            )
        return found

    def _warn_reprobing(self, index: int, old: tuple, new: tuple) -> None:
        """Say once per group which hyperparameters (other than :data:`fusion_check.SCHEDULED`, whose
        sign may change) made it probe again: a probe costs about as much as a few optimizer steps
        on a few small tensors, which adds up if a value changes every step."""
        before, after = dict(old), dict(new)
        changed = sorted(
            k for k in before.keys() | after.keys() if before.get(k) != after.get(k) and k not in fusion_check.SCHEDULED
        )
        if not changed or index in self.warned_reprobing:
            return
        self.warned_reprobing.add(index)
        warnings.warn(
            f"fuse_step: {type(self.optimizer).__name__} param group {index}: {changed} changed, so fuse_step "
            "probes again whether fusion is exact (a value such as a clip threshold can switch per-tensor math "
            "on). If these change every step, each fuse_step probes; only "
            f"{', '.join(fusion_check.SCHEDULED)} may change freely. This warning is shown once per group.",
            RuntimeWarning,
            stacklevel=7,
        )

    # ---- flat buffers ---------------------------------------------------------------------

    def _flatten(self, index: int, group: dict) -> None:
        self.flattened[index] = (tuple(map(id, group["params"])), FlattenedGroup(group["params"], self.optimizer.state))

    def _keep_flat(self, index: int, group: dict, param_ids: tuple) -> None:
        """Flatten a group that is new or whose parameter list changed; with ``check_flatten``,
        flatten again (warning once) a group whose parameters left their buffers."""
        known = self.flattened.get(index)
        if known is None or known[0] != param_ids:
            self._flatten(index, group)
        elif self.check_flatten and not known[1].intact():
            if not self.warned_not_flat:
                warn_not_flat(type(self.optimizer).__name__)
                self.warned_not_flat = True
            self._flatten(index, group)

    def _home(self, index: int, first: torch.Tensor, numel: int) -> Optional[Home]:
        """Where a run starting with ``first`` sits in group ``index``'s flat buffers, if it does."""
        known = self.flattened.get(index)
        return None if known is None else known[1].home(first, numel)


def _states_of(params: list, state: dict) -> list:
    """The ``optimizer.state`` dicts of ``params`` (``{}`` for none), without a lookup per parameter
    when the optimizer keeps no state at all (SGD without momentum)."""
    if not state:
        return [_NO_STATE] * len(params)
    return list(map(state.get, params, repeat(_NO_STATE)))


@contextlib.contextmanager
def _runs_as_parameters(optimizer: torch.optim.Optimizer, fused: list) -> Iterator[None]:
    """Within the block, each ``(group, plan, grads)`` of ``fused`` lists its runs' chunks (and
    then the parameters stepped alone) as its ``params``, and ``optimizer.state`` holds the chunks'
    state (the runs' gradients ``grads`` brought into their flat gradients first). On the way out,
    whatever happened inside, the groups get their own parameter lists back and every member takes
    its part of the state the optimizer left for the chunks."""
    state, handed, own = optimizer.state, [], []
    try:
        for group, plan, grads in fused:
            for run, run_grads in zip(plan.runs, grads):
                run.bring_in_grads(run_grads)
                for chunk, chunk_state in zip(run.chunks, run.chunk_states()):
                    state[chunk] = chunk_state
                handed.append(run)
            own.append((group, group["params"]))
            group["params"] = [chunk for run in plan.runs for chunk in run.chunks] + plan.alone
        yield
    finally:
        for group, params in own:
            group["params"] = params
        for run in handed:
            run.take_back(state, [state.pop(chunk, {}) for chunk in run.chunks], type(optimizer).__name__)


def _plain_step(optimizer: torch.optim.Optimizer) -> Callable:
    """The optimizer's own step (with any lr-scheduler wrapper), even inside fused_steps."""
    own = vars(optimizer).get("step")
    if isinstance(own, _FusedAlias):
        return own.original or type(optimizer).step.__get__(optimizer)
    return optimizer.step


def _evaluated_once(closure: Callable, loss: Any) -> Callable:
    """A closure whose first call returns ``loss`` (already computed) and later calls evaluate."""
    calls = [0]

    def once() -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return loss
        with torch.enable_grad():
            return closure()

    return once
