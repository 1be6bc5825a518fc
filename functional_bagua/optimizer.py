"""A ``torch.optim.Optimizer`` that runs a GradientTransformation: for loops written for torch.optim.

Most training hands an optimizer object to a loop someone else wrote (torch's lr schedulers,
``GradScaler``, DDP, trainers). :class:`Optimizer` gives any chain that reach; inside, each step is
the pure update of the chain (or torch's fused kernel where one computes it, below)::

    grads = {i: p.grad for i, p in enumerate(group["params"])}     # None where there is no .grad
    updates, state = tx.update(grads, state, params)
    p.add_(updates[i])                          # apply_updates_: for every parameter, in place

Built from a factory and its hyperparameters, as a torch.optim class is::

    opt = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

each param group runs ``inject_hyperparams(factory)(**hyperparameters)``: its numbers appear in the
group (``group["lr"]``, ``group["betas"]``), and what a scheduler writes there is the value the
next step uses: it is copied into the state's tensors before the update, outside any graph, so
``torch.compile(opt.step)`` reads it as data and never recompiles for a new lr.
Groups may override hyperparameters, as torch's do; the factory receives each in the type of
its default (``lr=1`` as 1.0, ``betas`` given as a list as a tuple), so a scheduler moves every
number it would move in torch. Built from a transform
(``fb.Optimizer(params, fb.adamw(lr=1e-3))``), every group runs that transform, or the one its
``"tx"`` entry names, and shows the numbers it was built with that a scheduler may write:

- an alias's float hyperparameters (``lr``, ``betas``, ``weight_decay``; and
  :func:`~functional_bagua.scale_by_learning_rate`'s rate, as ``lr``), also of an alias
  inside a :func:`~functional_bagua.chain` or given to another as its inner transform
  (``fb.lookahead(fb.adamw(1e-3))``), where exactly one alias takes the name
  (:mod:`functional_bagua.adjustable`). When a group's value changes (a scheduler, a
  checkpoint, a value given in the group), it is validated as the alias validates it, and the
  transform is built again with a 0-dim tensor for it, which later values are written into
  (a saved group lists those under ``"numbers_as_tensors"``, so that a resumed run reads them
  so too); one whose state would change its structure (``fb.sgd``'s momentum from 0 after the
  first step) raises a ValueError naming it;
- the numbers of a transform made by :func:`~functional_bagua.inject_hyperparams` that no
  schedule drives.

A transform made of building blocks (``fb.chain(fb.scale_by_adam(), fb.scale(-1e-3))``) has
none: its group holds no ``"lr"``, and reading one (as torch's schedulers do) raises a
``KeyError`` that names the numbers the group does show and the two forms that show an ``"lr"``:
an alias (or :func:`~functional_bagua.scale_by_learning_rate`) in the chain, or the factory form
above.

Built from a :func:`~functional_bagua.partition`, it has one param group per label (``group["label"]``),
each running that label's transform; the labels' function receives ``{name: tensor}`` when the
parameters come with names (``model.named_parameters()``), else the list of tensors. Groups may
also each bring their own transform and no default be given: ``fb.Optimizer([{"params": ...,
"tx": fb.adam(1e-3)}, ...])``.

Where torch has a fused kernel for a group's transform (``fb.adamw``, ``fb.adam``, ``fb.sgd``
with Python-number hyperparameters: :mod:`functional_bagua.kernels`), ``step`` runs it in place
(the numbers of ``torch.optim.AdamW(fused=True)``, bit for bit), unless ``fused=False``; the
kernel runs eagerly also inside ``torch.compile(opt.step)``, where the pure updates of the other
groups are compiled.

A group keeps only the new state its transform returns, so it gives the old one up
(:mod:`functional_bagua.ownership`): rules that can compute their new state in the old tensors
do (Adam's moments, ``mu.lerp_(g, 1 - b1)``: the same bits as the pure update, as torch.optim's
in-place steps), so those entries of ``optimizer.state[p]`` are stepped in place (others, such
as step counts, are replaced). As with torch.optim, an error raised part-way through a step may
leave such state part-stepped. Where a group's transform is a chain ending in a multiplication
by a number (``scale_by_learning_rate(lr)``, as most aliases' chains end, also where such a
chain is the last link of another, ``fb.chain(fb.clip_by_global_norm(1.0), fb.adamw())``; a
number a scheduler wrote in is read then), ``step`` runs the links before it and adds their updates with that
number as ``alpha`` (``p.add_(u, alpha=-lr)``, as torch.optim's steps): one pass fewer, and
the product is not rounded apart (the bits of torch.optim's form, not of ``u * -lr`` added).
A chain ending in :func:`~functional_bagua.schedule_free`'s averaging has it step the
parameters ``y`` and its ``z`` in place as the ``schedulefree`` package does (``y.lerp_(z,
c)``, ``y.add_(d, alpha=...)``, ``z.add_(d, alpha=-lr)``) where its tensors allow (dense
float32 or float64 tensors of at least one dimension; the others, a 0-dim parameter say, take
the pure step, their update added); so do
:func:`~functional_bagua.prodigy`'s, :func:`~functional_bagua.dadapt_adam`'s,
:func:`~functional_bagua.ademamix`'s, :func:`~functional_bagua.laprop`'s and
:func:`~functional_bagua.adopt`'s steps, as their references write them (``p.addcdiv_(mu, denom, value=-dlr)``; LaProp's decoupled decay then
``p.mul_(1 - wd lr)``; AdEMAMix's, :func:`~functional_bagua.add_decayed_weights` between it and
the learning rate, first; where their factors are numbers: on the CPU, and on a GPU for
schedule-free and the rules written per tensor, whose scalars the optimizer holds on the CPU; a
:func:`~functional_bagua.leafwise` rule offers this with ``write_leaf``). A link offers this as
``update.apply_in_place(updates, state, params, alpha)``: ``p <- p + alpha u`` for its update
``u``, its state and the parameters given up, or ``None``, nothing changed, to decline
(:func:`_tail_of`); with a weight decay between it and the rate, ``scaled_by=`` is passed too:
``p <- p * scaled_by + alpha u``. Either way the parameters are the pure update's to a rounding, and
``torch.compile(opt.step)``, which traces the whole chain, gives the pure update's numbers.
Around each group's step, the group's dict for what its checks accepted is kept
(:func:`functional_bagua.accepted.kept_in`): a :func:`~functional_bagua.leafwise` rule that
stepped its whole state in place records there what its checks accepted, and its next steps on
the same tensors skip them. A transform
built with numbers is built again with tensors once a scheduler changed one (a compiled step
reads them as data); its eager step then runs the transform built with the group's numbers of
that step, built with the check that validates them (also a chain of aliases; where the state's
structure allows it, checked once per kind of numbers), and writes its step as above. An alias
given a tensor (``lr=torch.tensor(...)``, :func:`~functional_bagua.hyperparams.reading_tensors`)
is built each step from the values it holds, read as Python numbers on the CPU
(``update.built_now``).

Beside parameters on a GPU, the eager step holds on the CPU the step counts and float64 scalars
of the transforms that take them there (the rules written per tensor, schedule-free's averaging
weights, injected hyperparameters: :func:`~functional_bagua.numerics.takes_cpu_scalars`), as
torch.optim holds its ``step`` on the CPU: their factors are computed without waiting for the
GPU and reach torch's multi-tensor kernels as numbers, one kernel per operation (0-dim GPU
factors that differ per tensor would take one kernel per tensor), and schedule-free's and
those rules' steps are written into the parameters as on the CPU. A step compiled from the
first (the state made while traced) keeps them on the device, as the pure transform does; a
group stepped by torch's fused kernel keeps its counts where that kernel reads them.

A group's state is made at its first use (its first step, as torch.optim's), so a model cast or
moved after the optimizer is built steps on its new dtype and device. Reading the state
(``state_dict()``, ``optimizer.state``) does not make it. Parameters that do not require
gradients then get no state; one that gets a gradient later (unfrozen, or absent from the
checkpoint loaded) gets its state at that step, the others' kept, as in torch.optim.

``optimizer.state[p]`` is, as in torch.optim, a dict of the parameter's tensors in the chain's
state (``fb.adamw``'s first moment is ``"inner_state/1/mu"`` in a factory's optimizer, whose
chain sits in an injected-hyperparameters state); assigning an entry (``opt.state[p][name] =
t.to(device)``, what trainers do to move the state) replaces that tensor in the chain's state.

``state_dict()`` is in torch's format: ``{"state": {index: {name: tensor}}, "param_groups": [...]}``,
each parameter's entries named by their path in the chain's state, as in ``optimizer.state``;
state that belongs to no single parameter (step counters of schedules, injected
hyperparameters, schedule-free's count and averaging weights, Prodigy's ``d``) is kept in its
group under ``"shared_state"``. ``load_state_dict`` restores it exactly, so a resumed run is the
uninterrupted one bit for bit. A function in a group (ADOPT's ``clip_lambda``, a schedule given
as ``lr``) is code, not state: it is left out of the saved group (so that ``torch.load``, whose
default reads tensors and plain values only, reads the file), and the loading optimizer keeps
its own.

A group running :func:`~functional_bagua.schedule_free` (``fb.schedule_free_adamw``) trains at
``y`` and evaluates at the average ``x``: ``optimizer.eval()`` moves its parameters to ``x``,
``optimizer.train()`` back to ``y``, as the ``schedulefree`` package's optimizers (Hugging Face's
``Trainer`` calls both where they exist; for other groups they do nothing). ``step()`` in
evaluation mode raises; the mode is saved with the group (``"train_mode"``), so a checkpoint
saved in evaluation mode resumes there.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from functional_bagua import accepted, checkpoint, checks, kernels, numerics, ownership, tree
from functional_bagua.accepted import KeptViews
from functional_bagua.adjustable import Adjustable
from functional_bagua.base import GradientTransformation, OptState, apply_updates_, chain
from functional_bagua.hyperparams import InjectHyperparamsState, inject_hyperparams, number_kind, same_state_structure
from functional_bagua.numerics import SCALAR_DTYPE, holds_tensor, is_real_number, number_now
from functional_bagua.parameter_state import NAME, GroupLayout, ParameterStates, Position, positions
from functional_bagua.transforms.schedule_free import (
    schedule_free_eval_params,
    schedule_free_states,
    schedule_free_train_params,
)
from functional_bagua.transforms.wrappers import Partitioned, partitioned
from functional_bagua.tree import copy_into

Factory = Callable[..., GradientTransformation]
TENSOR_NUMBERS = "numbers_as_tensors"  # a saved group's entry: the numbers its transform read from tensors


class ParamGroup(dict):
    """One of torch's param groups (a dict), whose missing entry is named when read: torch's
    schedulers read ``group["lr"]``, which a transform made of building blocks does not show."""

    def __missing__(self, key: Any) -> Any:
        shown = sorted(k for k in self if k != "params")
        raise KeyError(
            f"{NAME}: this param group holds no {key!r}; its transform shows {shown or 'no numbers'}. A torch "
            "scheduler needs 'lr': build the transform from an alias (fb.adamw(1e-3)) or put "
            "fb.scale_by_learning_rate(1e-3) in the chain, or use the factory form "
            "fb.Optimizer(params, fb.adamw, lr=1e-3)"
        )


@dataclasses.dataclass
class _Group:
    """What the optimizer keeps beside one of torch's param groups."""

    tx: GradientTransformation
    state: Optional[OptState] = None  # made at the group's first step
    tracked: frozenset[int] = frozenset()  # the positions the state holds parameters for
    layout: Optional[GroupLayout] = None  # where each tensor of the state belongs
    written: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # assigned through .state
    kernel: Optional[tuple] = None  # (the factory's numbers, the kernel they give), see _kernel_of
    numbers: Optional[_Shown] = None  # a transform built with numbers: those its group shows
    tail: Optional[tuple] = None  # (the transform, its _tail_of), see _applied_by_its_last_link
    accepted: "_Accepted" = dataclasses.field(default_factory=lambda: _Accepted())  # see step
    views: KeptViews = dataclasses.field(default_factory=KeptViews)  # see step


class _Accepted(dict):
    """What the checks of a group's steps accepted, by transform name
    (:mod:`functional_bagua.accepted`): a copy or a pickle starts empty (it holds the tensors
    of this object's state)."""

    def __reduce__(self) -> tuple:
        return (_Accepted, ())


@dataclasses.dataclass
class _Shown:
    """The adjustable numbers of a group's transform built with numbers, as the group shows them
    (:mod:`functional_bagua.adjustable`). Until a group's number changes, the transform runs as
    built; at the first change it is built again with a 0-dim tensor for each changed number,
    which later changes are written into (:func:`_follow_numbers`)."""

    found: Adjustable
    runs_with: dict[str, Any]  # the values the transform now runs with, as the group held them
    tensors: dict[str, Any] = dataclasses.field(default_factory=dict)  # what it was built again with
    # built again with tensors: the transform built with the numbers they hold now (all numbers),
    # which the eager step runs (_eager_transform), and per kind of numbers whether its state
    # has the structure of the one built with tensors
    eager: Optional[GradientTransformation] = None
    eager_keeps: dict[tuple, bool] = dataclasses.field(default_factory=dict)

    def transform_now(self, built: GradientTransformation) -> GradientTransformation:
        """The transform reading this record's tensors (those it was built again with, and those
        the group itself holds); ``built`` where there are none."""
        held = {k: v for k, v in self.runs_with.items() if holds_tensor(v)}
        values = {**held, **self.tensors}
        return self.found.with_numbers(values) if values else built


class Optimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` over a GradientTransformation (module docstring).

    Args:
        params: the parameters (or ``named_parameters()``), or param groups (dicts with
            ``"params"`` and hyperparameters to override, or a ``"tx"`` of their own when ``tx`` is
            a transform or ``None``), as torch.optim takes them.
        tx: a factory of transforms (``fb.adamw``, ``fb.sgd``, any function of hyperparameters
            returning one), a GradientTransformation (a :func:`~functional_bagua.partition` gives a
            group per label), or ``None`` when every group brings its ``"tx"``.
        fused: ``None`` runs torch's fused kernel in place where one computes a group's transform,
            ``False`` never (the pure update), ``True`` always (a ValueError for a group without).
        **hyperparameters: the factory's arguments (``lr=1e-3, weight_decay=0.01``); none with a
            transform.

    Example::

        opt = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-3)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    """

    def __init__(
        self,
        params: Iterable[Any],
        tx: Union[Factory, GradientTransformation, None] = None,
        *,
        fused: Optional[bool] = None,
        **hyperparameters: Any,
    ) -> None:
        self._factory_defaults: dict[str, Any] = {}
        _refuse_optimizer_class(tx)
        if tx is None or isinstance(tx, GradientTransformation):
            if hyperparameters:
                raise TypeError(
                    f"{NAME}: hyperparameters {sorted(hyperparameters)} given without a factory; pass the "
                    "factory (fb.Optimizer(params, fb.adamw, lr=1e-3)) or build them into the transform"
                )
        elif callable(tx):
            self._factory_defaults = _defaults_of(tx, hyperparameters)
            hyperparameters = {**self._factory_defaults, **hyperparameters}
        else:
            raise TypeError(f"{NAME}: tx must be a GradientTransformation or a factory of one, got {type(tx).__name__}")
        self._tx = tx
        # the names the factory takes (those it is given, where it takes **kwargs)
        self._factory_takes = set(hyperparameters)
        self.fused = fused
        self._set_eager_parts()
        self._groups: list[_Group] = []  # beside each of torch's param groups
        super().__init__(params, hyperparameters)
        self.state = ParameterStates(self)  # type: ignore[assignment]

    def _set_eager_parts(self) -> None:
        # eager even inside a compiled step, so that no graph reads the group's numbers (made here:
        # torch.compiler imports dynamo, too heavy for import time)
        written: dict = {}  # see _write_hyperparameters
        self._write_hyperparameters = torch.compiler.disable(functools.partial(_write_hyperparameters, written=written))
        self._run_kernel = torch.compiler.disable(_run_kernel)
        self._make_state = torch.compiler.disable(_make_state)
        self._grow_state = torch.compiler.disable(_grow_state)
        self._kernel = torch.compiler.disable(self._kernel_of)  # Python decisions (the factory is called)
        self._follow_numbers = torch.compiler.disable(_follow_numbers)

    @property
    def _from_factory(self) -> bool:
        return self._tx is not None and not isinstance(self._tx, GradientTransformation)

    # ---- groups ---------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, as torch.optim does; its transform is built here (its state at its first
        use). A group run by a :func:`~functional_bagua.partition` becomes one group per label.
        On an error the optimizer is left as it was.

        Args:
            param_group: ``{"params": ..., **hyperparameters}`` (or ``"tx"``: the group's transform).
        """
        before = len(self.param_groups)
        try:
            self._add_groups(dict(param_group))
        except BaseException:
            del self.param_groups[before:], self._groups[before:]
            raise

    def _add_groups(self, param_group: dict[str, Any]) -> None:
        group_tx = param_group.pop("tx", None)
        index = len(self.param_groups)
        if group_tx is not None and self._from_factory:
            raise ValueError(f"{NAME}: a param group's 'tx' needs the optimizer built from a transform, not a factory")
        if group_tx is not None and not isinstance(group_tx, GradientTransformation):
            raise TypeError(
                f"{NAME}: param group {index}'s 'tx' must be a GradientTransformation, got {type(group_tx).__name__}"
            )
        tx = group_tx if group_tx is not None else self._tx
        if tx is None:
            raise ValueError(
                f"{NAME}: param group {index} has no 'tx' and the optimizer no transform to run; give every group "
                "its own ({'params': ..., 'tx': fb.adamw(1e-3)}) or pass one for all: fb.Optimizer(params, tx)"
            )
        parts = partitioned(tx) if isinstance(tx, GradientTransformation) else None
        for label_group, label_tx in [(param_group, tx)] if parts is None else _split_by_label(param_group, parts):
            given = set(label_group)
            super().add_param_group(label_group)
            self.param_groups[-1] = ParamGroup(self.param_groups[-1])
            self._set_up_group(len(self.param_groups) - 1, label_tx, given)

    def _set_up_group(self, index: int, tx: Union[Factory, GradientTransformation], given: set[str]) -> None:
        group = self.param_groups[index]
        if not isinstance(tx, GradientTransformation):
            tx = inject_hyperparams(tx)(**self._factory_arguments(group))
        if "value_fn" in inspect.signature(tx.update).parameters:
            raise TypeError(
                f"{NAME}: param group {index}'s transform evaluates the loss at other parameters "
                "(update(..., value_fn=...): fb.lbfgs), which a step from .grad cannot give; run it in a functional "
                "loop, tx.update(grads, state, params, value_fn=loss_of), or use torch.optim.LBFGS with a closure"
            )
        self._groups.append(_Group(tx))
        if self.fused and self._kernel(index) is None:
            raise ValueError(
                f"{NAME}: fused=True, but torch has no fused kernel for param group {index}'s transform "
                "(only fb.adamw, fb.adam and fb.sgd with number hyperparameters have one); pass fused=None"
            )
        if not self._from_factory:
            injected = getattr(tx.update, "adjustable", {})  # an injected transform's numbers
            found = Adjustable.of(tx) if not injected else None  # those of one built with numbers
            shown = {k: _numbers(v) for k, v in injected.items()}
            if found is not None:
                shown = {k: _as_shown(v) for k, v in found.numbers.items()}
                self._groups[-1].numbers = _Shown(found, dict(shown))
            for name in [k for k in group if k not in given and k in self.defaults and k not in shown]:
                del group[name]  # torch copied another group's number in: this transform has no such one
            for name, value in shown.items():  # for schedulers; one given in the group replaces the built one
                if name not in given:
                    group[name] = value
                self.defaults.setdefault(name, group[name])  # what OneCycleLR looks for ("betas")

    def _factory_arguments(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group's entries that the factory takes (torch's groups may hold others), each in
        the type of the factory's default (``lr=1`` as 1.0, ``betas`` given as a list as a
        tuple), so that a number the default makes a tensor stays one a scheduler can change."""
        takes = self._factory_takes
        return {k: _like(v, self._factory_defaults.get(k)) for k, v in group.items() if k in takes}

    # ---- state, made at its first use -------------------------------------------------------------

    def _state(self, i: int) -> OptState:
        """Group ``i``'s state, made now if it is not yet: over the parameters that require
        gradients, on their dtype and device of now."""
        if self._groups[i].state is None:
            self._make_state(self, i, None)
        return self._with_written(self._groups[i])

    @staticmethod
    def _with_written(group: _Group) -> OptState:
        """The group's state with the tensors assigned through ``optimizer.state`` put in (at once)."""
        if group.written:
            leaves, spec = tree.flatten(group.state)
            for j, tensor in group.written.items():
                leaves[j] = tensor
            group.written.clear()
            group.state = spec.unflatten(leaves)
        return group.state

    def _group_state(self, i: int) -> Optional[tuple[list, GroupLayout]]:
        """The leaves of group ``i``'s state (``None`` included) and its layout; ``None`` before
        the state is made (reading it does not make it: torch.optim's state is empty until the
        first step, and a model may still be cast)."""
        group = self._groups[i]
        if group.state is None:
            return None
        leaves, spec = tree.flatten(self._with_written(group))
        if group.layout is None or group.layout.spec != spec:
            group.layout = GroupLayout.of(group.state)
        return leaves, group.layout

    def _write_leaves(self, i: int, position: int, changed: dict[str, torch.Tensor]) -> None:
        """Replace the named tensors of the parameter at ``position`` in group ``i``'s state,
        before the state's next use (read through its layout, which a view was made from)."""
        group = self._groups[i]
        assert group.layout is not None
        where = group.layout.where[position]
        group.written.update({where[name]: tensor for name, tensor in changed.items()})
        group.accepted.clear()  # the records hold the state replaced

    def _has_state(self) -> bool:
        """Whether the optimizer reads as one that has stepped (``bool(optimizer.state)``): every
        group's state made, or a group that holds no ``"lr"``. torch.distributed.checkpoint steps
        an optimizer that reads as fresh, every group, with zero gradients and ``lr`` set to 0
        where a group holds one; a transform's fixed numbers (weight decay) would move its
        parameters. The groups without ``"lr"`` are made now instead; the others stay empty."""
        if all(group.state is not None for group in self._groups):
            return True
        fixed = [i for i, group in enumerate(self.param_groups) if "lr" not in group]
        if not fixed or torch.compiler.is_compiling():
            return False
        for i in fixed:
            self._state(i)
        return True

    # ---- schedule-free: training and evaluation weights ----------------------------------------

    @torch.no_grad()
    def train(self) -> None:
        """Put the parameters of schedule-free groups (:func:`~functional_bagua.schedule_free`)
        back at their training weights ``y = lerp(x, z, 1 - b1)`` after :meth:`eval`, as the
        ``schedulefree`` package's optimizers do (trainers such as Hugging Face's call it when
        it exists). Other groups, and groups before their first step, are left as they are.
        An optimizer starts in training mode (the reference's starts in evaluation mode and
        refuses to step before ``train()``; here the first step needs no call)."""
        self._set_mode(True)

    @torch.no_grad()
    def eval(self) -> None:
        """Put the parameters of schedule-free groups at their evaluation weights
        ``x = lerp(y, z, 1 - 1/b1)`` (:func:`~functional_bagua.schedule_free_eval_params`), to
        evaluate or save them; :meth:`step` refuses to run until :meth:`train`. Other groups are
        left as they are."""
        self._set_mode(False)

    def _set_mode(self, train: bool) -> None:
        for i, group in enumerate(self.param_groups):
            if self._groups[i].state is None or group.get("train_mode", True) == train:
                continue
            state = self._state(i)
            if not schedule_free_states(state):
                continue
            params = {k: p.detach() for k, p in zip(positions(len(group["params"])), group["params"])}
            moved = (schedule_free_train_params if train else schedule_free_eval_params)(state, params)
            copy_into(params, moved)
            group["train_mode"] = train

    # ---- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every group from the parameters' ``.grad`` (module docstring).

        Args:
            closure: re-evaluates the model and returns the loss (called with gradients enabled).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # read past dynamo's handling of ``optimizer.param_groups`` (written for torch's own
        # optimizers' plain-dict groups, it fails on a dict subclass)
        groups = self.__dict__["param_groups"]
        for i, (group, ours) in enumerate(zip(groups, self._groups)):
            keys = positions(len(group["params"]))
            grads = dict(zip(keys, checks.read_each("grad", group["params"])))
            if all(g is None for g in grads.values()):
                continue  # as torch.optim: a group without gradients is left as it is, its state too
            if group.get("train_mode", True) is False:
                raise RuntimeError(
                    f"{NAME}: param group {i} is in evaluation mode (optimizer.eval() put its parameters at the "
                    "schedule-free evaluation weights x); call optimizer.train() before optimizer.step()"
                )
            if ours.numbers is not None:
                self._follow_numbers(self, i)
            state = self._state(i)
            if not ours.tracked.issuperset(keys) and any(
                g is not None and k not in ours.tracked for k, g in grads.items()
            ):
                state = self._grow_state(self, i, grads)
            if isinstance(state, InjectHyperparamsState):
                self._write_hyperparameters(state, group)
            kernel = self._kernel(i)
            if kernel is not None and not any(g is not None and g.is_sparse for g in grads.values()):
                # with GradScaler's scale and inf flag where it gave them (_step_supports_amp_scaling)
                amp = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
                ours.state = self._run_kernel(kernel, grads, state, group["params"], *amp)
                continue  # on the parameters themselves, as torch.optim's fused step
            scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
            if scale is not None or found_inf is not None:  # GradScaler counted on a kernel: unscale here
                if found_inf is not None and bool(found_inf):
                    continue  # skipped, as the kernel skips a step with an inf
                if scale is not None:
                    grads = _unscaled(grads, scale)
            params = ours.views.of(keys, group["params"])  # the last step's views, where still the same
            with accepted.kept_in(ours.accepted):  # what the step's checks accepted, for the next step
                self._step_group(ours, grads, state, params)
        return loss

    @staticmethod
    def _step_group(ours: _Group, grads: dict, state: OptState, params: dict) -> None:
        """A group's step from its gradients, its state given up, into its parameters."""
        if _applied_by_its_last_link(ours, grads, state, params):
            return
        # the group keeps only the new state: the old one is given up (ownership module), so the
        # rules that can compute their new state in its tensors, as torch.optim's steps do
        updates, ours.state = ownership.update_giving_state(ours.tx, grads, state, params)
        apply_updates_(params, updates)  # in place: the numbers of apply_updates, one pass

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """What ``torch.amp.GradScaler.step`` asks: whether this step takes the scale and the inf
        flag itself (as torch's fused optimizers do), so that the scaler skips its own unscaling
        pass over the gradients. True when every group with gradients runs torch's kernel (on
        dense gradients); else the scaler unscales, and skips a step with an inf, as for any
        optimizer."""
        for i, group in enumerate(self.param_groups):
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if grads and self._groups[i].numbers is not None:
                self._follow_numbers(self, i)  # as step will first: the kernel of the numbers now
            if grads and (self._kernel(i) is None or any(g.is_sparse for g in grads)):
                return False
        return True

    def _kernel_of(self, i: int) -> Optional[kernels.KernelSpec]:
        """torch's fused kernel for group ``i`` with its numbers now, if one computes its transform
        and ``fused`` allows it."""
        if self.fused is False:
            return None
        if self._from_factory:
            factory = self._tx
            assert factory is not None and not isinstance(factory, GradientTransformation)
            arguments = self._factory_arguments(self.param_groups[i])
            if any(holds_tensor(v) for v in arguments.values()):
                return None  # torch's kernels here take numbers (kernels.spec_of): no need to build it
            numbers = tuple(sorted(arguments.items()))
            return self._kernel_for(i, numbers, lambda: factory(**arguments))
        shown = self._groups[i].numbers
        if shown is not None and shown.tensors:  # built again with tensors: the kernel of the numbers now
            if any(holds_tensor(v) for v in shown.runs_with.values()):
                return None
            now = tuple(sorted(shown.runs_with.items()))
            return self._kernel_for(i, now, lambda: shown.found.with_numbers(shown.runs_with))
        return kernels.spec_of(self._groups[i].tx)

    def _kernel_for(
        self, i: int, numbers: tuple, build: Callable[[], GradientTransformation]
    ) -> Optional[kernels.KernelSpec]:
        """The kernel of the transform ``build`` makes with ``numbers``; built again only when
        the group's numbers change (a scheduler's new lr)."""
        known = self._groups[i].kernel
        if known is not None and _same_numbers(known[0], numbers):
            return known[1]
        spec = kernels.spec_of(build())
        self._groups[i].kernel = (numbers, spec)
        return spec

    def __getstate__(self) -> dict[str, Any]:
        """The chains and their states too (torch.optim keeps only defaults, state and
        param_groups), without what belongs to this object alone: the eager wrappers, hooks and
        a ``step`` that a scheduler wrapped (``__setstate__`` makes them anew, as torch's does)."""
        own = {
            "step",
            "_write_hyperparameters",
            "_run_kernel",
            "_make_state",
            "_grow_state",
            "_kernel",
            "_follow_numbers",
        }
        return {k: v for k, v in self.__dict__.items() if k not in own and not k.endswith("_hooks")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._set_eager_parts()
        for ours in self._groups:  # a copy's transforms read the copy's tensors, not the original's
            if ours.numbers is not None:
                ours.tx = ours.numbers.transform_now(ours.tx)

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's format (module docstring): per-parameter state by global index, and the groups;
        torch's state-dict hooks run around it."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        start = 0
        for i, group in enumerate(self.param_groups):
            made = self._group_state(i)
            shared = {}  # a group not made yet has no state, as torch's before the first step
            if made is not None:
                leaves, layout = made
                for position, entries in layout.per_parameter(leaves).items():
                    per_param[start + position] = entries
                shared = layout.shared(leaves)
            # a function in a group (ADOPT's clip_lambda, a schedule given as a number's value) is
            # code, not state: left out, so that torch.load(weights_only=True) reads the file, and
            # load_state_dict keeps this optimizer's own
            packed = {k: v for k, v in group.items() if k != "params" and not _holds_code(v)}
            packed["params"] = list(range(start, start + len(group["params"])))
            packed["shared_state"] = shared
            shown = self._groups[i].numbers
            if shown is not None and shown.tensors:  # so that a resumed run computes as this one
                packed[TENSOR_NUMBERS] = sorted(shown.tensors)
            groups.append(packed)
            start += len(group["params"])
        state_dict = {"state": per_param, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = post_hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (copies of its tensors, on this state's devices;
        floating-point ones in this state's dtype, as torch.optim casts them to the parameters');
        torch's load hooks run around it.

        Args:
            state_dict: a state dict of an :class:`Optimizer` over the same groups and chains;
                another optimizer's raises a ValueError naming the difference.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or any("shared_state" not in g for g in groups):
            raise ValueError(
                f"{NAME}: this state dict was not saved by fb.Optimizer (its param groups have no 'shared_state'); "
                "load a state dict from fb.Optimizer.state_dict() over the same parameters and chain"
            )
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)
        ):
            raise ValueError(
                f"{NAME}: the state dict has groups of {[len(g['params']) for g in groups]} parameters, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}; load it into an optimizer built the same way"
            )
        loaded = [self._loaded_group(i, saved, state_dict["state"]) for i, saved in enumerate(groups)]
        for ours, (state, tracked), saved, group in zip(self._groups, loaded, groups, self.param_groups):
            ours.state, ours.tracked, ours.layout = state, tracked, None  # all read: now assigned
            ours.written.clear()
            ours.accepted.clear()  # the records hold the state replaced
            group.update({k: v for k, v in saved.items() if k not in ("params", "shared_state", TENSOR_NUMBERS)})
        for i, (ours, saved) in enumerate(zip(self._groups, groups)):
            if ours.numbers is not None:  # the saved numbers, as they ran (tensors where they were)
                _follow_numbers(self, i, force=saved.get(TENSOR_NUMBERS, ()))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _transform_for_saved(self, i: int, saved: dict[str, Any]) -> GradientTransformation:
        """Group ``i``'s transform with the numbers of the saved group (whose state it made)."""
        ours = self._groups[i]
        shown = ours.numbers
        if shown is None:
            return ours.tx
        device = self.param_groups[i]["params"][0].device
        forced = set(saved.get(TENSOR_NUMBERS, ()))
        values = {
            k: _held_as_tensors(k, saved[k], device)
            for k, was in shown.runs_with.items()
            if k in saved and (k in forced or _differs(saved[k], was))
        }
        return shown.found.with_numbers({**shown.tensors, **values}) if values else ours.tx

    def _loaded_group(
        self, i: int, saved: dict[str, Any], per_param: dict[int, dict[str, Any]]
    ) -> tuple[Optional[OptState], frozenset[int]]:
        """Group ``i``'s state from a saved group: made anew over the parameters the saved one
        held state for (those that required gradients when it was made), its tensors loaded;
        ``(None, ...)`` for a group saved before it was made."""
        entries = {at: per_param.get(index, {}) for at, index in enumerate(saved["params"])}
        if not saved["shared_state"] and not any(entries.values()):
            return None, frozenset()
        tracked = frozenset(at for at, held in entries.items() if held) or _requiring_grad(self.param_groups[i])
        template = _make_state(self, i, tracked, assign=False, tx=self._transform_for_saved(i, saved))
        layout = GroupLayout.of(template)
        flat = {}  # the template's keys (fb.state_dict's), the saved tensors
        for key, position, name, leaf in zip(layout.keys, layout.positions, layout.names, tree.flatten(template)[0]):
            if not isinstance(leaf, torch.Tensor):
                continue  # None, or a number the transform keeps as it is
            source = saved["shared_state"] if position is None else entries[position]
            if name not in source:
                raise ValueError(
                    f"{NAME}: the state dict has no {name!r} for group {i}; it was saved from another chain"
                )
            flat[key] = _cast_like(source[name], leaf)
        return checkpoint.load_state_dict(template, flat), tracked


def _defaults_of(factory: Factory, given: dict[str, Any]) -> dict[str, Any]:
    """The factory's keyword defaults (so that each group shows every hyperparameter, as torch's
    groups do: ``betas`` for a scheduler that cycles momentum); a TypeError for a name it lacks."""
    parameters = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(given) - set(parameters))
        if unknown:
            raise TypeError(
                f"{NAME}: {getattr(factory, '__name__', factory)} takes no {unknown}; it takes {list(parameters)}"
            )
    return {
        name: p.default
        for name, p in parameters.items()
        if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def _like(value: Any, default: Any) -> Any:
    """``value`` in the type of ``default`` where that is a float (an int given) or a tuple (a list
    given, its elements alike, ints among floats as floats: ``step_sizes=(1e-6, 50)``); else
    ``value`` as it is."""
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, tuple) and isinstance(value, (list, tuple)) and len(value) == len(default):
        numbers = 0.0 if any(isinstance(d, float) for d in default) else None  # (1e-6, 50): both floats
        return tuple(
            _like(v, numbers if isinstance(d, int) and not isinstance(d, bool) else d) for v, d in zip(value, default)
        )
    return value


def _split_by_label(
    param_group: dict[str, Any], parts: Partitioned
) -> Iterator[tuple[dict[str, Any], GradientTransformation]]:
    """One group per label of ``parts`` (those with parameters), with the label's transform; the
    labels come from ``{name: tensor}`` for named parameters, else from the list of tensors."""
    given = param_group["params"]
    entries = [given] if isinstance(given, torch.Tensor) else list(given)
    named = bool(entries) and all(isinstance(e, tuple) for e in entries)
    tensors = [e[1] if named else e for e in entries]
    params: Any = {e[0]: e[1] for e in entries} if named else tensors
    labels = parts.leaf_labels(params)
    leaves = tree.flatten(params)[0]
    label_of = {id(leaf): label for leaf, label in zip(leaves, labels)}
    for label, tx in parts.transforms.items():
        chosen = [e for e, t in zip(entries, tensors) if label_of[id(t)] == label]
        if chosen:
            yield {**param_group, "params": chosen, "label": label}, tx


def _make_state(
    optimizer: Optimizer,
    i: int,
    tracked: Optional[frozenset[int]],
    assign: bool = True,
    tx: Optional[GradientTransformation] = None,
) -> OptState:
    """Group ``i``'s state over the parameters at positions ``tracked`` (``None``: those that
    require gradients), made by ``tx`` (the group's transform by default), kept as the group's
    with ``assign`` (eager: a compiled step that makes it reads numbers the state holds as Python
    values until then); made eagerly, its scalars on the CPU where the group runs no kernel of
    torch's (:func:`_scalars_on_host`; made while traced, they stay on the device)."""
    params = optimizer.param_groups[i]["params"]
    tracked = tracked if tracked is not None else _requiring_grad(optimizer.param_groups[i])
    ours = optimizer._groups[i]
    tx = ours.tx if tx is None else tx
    state = tx.init({k: p.detach() if k in tracked else None for k, p in zip(positions(len(params)), params)})
    if not torch.compiler.is_compiling() and optimizer._kernel(i) is None:
        state = _scalars_on_host(state, params)
    if assign:
        ours.state, ours.tracked = state, tracked
    return state


_HOST = torch.device("cpu")


def _scalars_on_host(state: Any, params: list, host: torch.device = _HOST) -> Any:
    """``state`` with the 0-dim scalars of its parts that take them on the CPU
    (:func:`~functional_bagua.numerics.takes_cpu_scalars`: the leafwise rules, schedule-free's
    averaging, injected hyperparameters) moved there from another device: step counts
    (integers) and float64 numbers (bias-correction products, averaging weights,
    hyperparameters; those of a 0-dim parameter, which could be its float64 moments, excepted),
    as torch.optim keeps its ``step`` on the CPU. An eager step then computes its factors on the
    CPU without waiting for the device and hands them to torch's multi-tensor kernels as numbers
    (``foreach``): one kernel per op, where a 0-dim GPU operand that differs per tensor runs one
    kernel per tensor. Other parts are left as they are.

    Args:
        state: a group's state, as its transform's ``init`` made it (trees of the parameters
            keyed by their position in the group).
        params: the group's parameters.
        host: where the scalars go (the CPU; another device in the tests, which run on the CPU).
    """

    def scalar(leaf: torch.Tensor, position: Optional[int]) -> torch.Tensor:
        hosted = (
            leaf.dim() == 0
            and leaf.device != host
            and not leaf.requires_grad
            and (
                leaf.dtype in (torch.int32, torch.int64)
                or leaf.dtype == SCALAR_DTYPE
                and (position is None or params[position].dim() > 0)
            )
        )
        return leaf.to(host) if hosted else leaf

    def field(value: Any, position: Optional[int] = None) -> Any:
        """A field of a state that takes CPU scalars: its tensors (per parameter, keyed by position)."""
        if isinstance(value, torch.Tensor):
            return scalar(value, position)
        if isinstance(value, dict):
            return {k: field(v, k if isinstance(k, Position) else position) for k, v in value.items()}
        if type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value):  # betas, as a tuple
            return tuple(scalar(v, position) for v in value)
        return walk(value)  # another transform's state inside (an injected transform's)

    def walk(node: Any) -> Any:
        if hasattr(node, "_fields"):  # a transform's state (a NamedTuple)
            if numerics.takes_cpu_scalars_in(node) and all(_all_take_cpu_scalars(v) for v in node):
                return type(node)(*(field(v) for v in node))
            return type(node)(*(walk(v) for v in node))
        if isinstance(node, (tuple, list)):  # a chain's states
            return type(node)(walk(v) for v in node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(state)


def _all_take_cpu_scalars(node: Any) -> bool:
    """Whether every transform's state inside ``node`` that holds tensors takes CPU scalars
    (:func:`~functional_bagua.numerics.takes_cpu_scalars`): an injected transform's numbers go
    to the CPU only where what it injects them into takes them there (PSGD-Kron, compiled, would
    meet a CPU hyperparameter beside its batched GPU tensors)."""
    if hasattr(node, "_fields"):
        if not numerics.takes_cpu_scalars_in(node) and any(isinstance(t, torch.Tensor) for t in tree.flatten(node)[0]):
            return False
        return all(_all_take_cpu_scalars(v) for v in node)
    if isinstance(node, (tuple, list)):
        return all(_all_take_cpu_scalars(v) for v in node)
    if isinstance(node, dict):
        return all(_all_take_cpu_scalars(v) for v in node.values())
    return True


def _grow_state(optimizer: Optimizer, i: int, grads: dict[int, Optional[torch.Tensor]]) -> OptState:
    """Group ``i``'s state with state added for the parameters that have a gradient but none
    yet (frozen when it was made, or not in the checkpoint it was loaded from), as torch.optim
    makes a parameter's state at its first step: their tensors fresh from ``init``, every other
    tensor (the other parameters', the shared counters and hyperparameters) kept."""
    kept = optimizer._group_state(i)
    assert kept is not None  # step made it
    old_leaves, old_layout = kept
    ours = optimizer._groups[i]
    tracked = ours.tracked | {k for k, g in grads.items() if g is not None}
    grown = _make_state(optimizer, i, tracked, assign=False)
    layout = GroupLayout.of(grown)
    merged = []
    for position, name, fresh in zip(layout.positions, layout.names, tree.flatten(grown)[0]):
        j = old_layout.where.get(position, {}).get(name)
        merged.append(fresh if j is None or old_leaves[j] is None else old_leaves[j])
    ours.state, ours.tracked, ours.layout = layout.spec.unflatten(merged), tracked, layout
    return ours.state


def _applied_by_its_last_link(ours: _Group, grads: dict, state: OptState, params: dict) -> bool:
    """Eagerly, where the group's transform is a chain that ends in a step written into the
    parameters (:func:`_tail_of`), also inside :func:`~functional_bagua.inject_hyperparams`
    (the factory form: the chain built with this step's hyperparameters, its ``step_parts``):
    the links before it, their state given up, then that step written into the parameters: the
    updates added with the last link's number as ``alpha`` (``scale_by_learning_rate``:
    ``p.add_(u, alpha=-lr)``, as torch.optim's steps, instead of a pass scaling the updates and
    one adding them), or a link's own ``apply_in_place`` (schedule-free's ``y`` and ``z``
    stepped in place; Prodigy's ``p.addcdiv_(mu, denom, value=-dlr)``, as the references step
    them), and where that declines, the link as the chain runs it, its updates added with
    ``alpha``. True when it stepped so."""
    if torch.compiler.is_compiling() or any(g is not None and g.is_sparse for g in grads.values()):
        return False  # traced: the whole chain (nothing built while tracing)
    step_parts = getattr(ours.tx.update, "step_parts", None)
    if step_parts is not None and isinstance(state, InjectHyperparamsState):
        tx, wrapped = step_parts(state, params)  # the chain built for this step (or kept)
        _step_built(ours, tx, grads, state.inner_state, params, wrapped)
        return True
    if not isinstance(state, tuple):
        return False
    # built again with tensors (a scheduler changed a number): the numbers' transform; an alias
    # reading tensors: built from them now, with the numbers they hold
    built_now = getattr(ours.tx.update, "built_now", None)
    built = _eager_transform(ours, params) or (built_now(params) if built_now is not None else None)
    if built is not None:
        _step_built(ours, built, grads, state, params, lambda new: new)
        return True
    tail = _cached_tail(ours, ours.tx)
    return tail is not None and _step_into(ours, tail, grads, state, params, lambda new: new)


def _step_built(
    ours: _Group,
    tx: GradientTransformation,
    grads: dict,
    state: tuple,
    params: dict,
    wrapped: Callable[[Any], OptState],
) -> None:
    """The step of ``tx``, a transform built for this step whose state ``state`` is: its end
    written into the parameters where it can be (:func:`_step_into`), else ``tx`` as it is (not
    built again), its updates added; the group's new state ``wrapped``."""
    tail = _cached_tail(ours, tx)
    if tail is not None and _step_into(ours, tail, grads, state, params, wrapped):
        return
    updates, new_state = ownership.update_giving_state(tx, grads, state, params)
    ours.state = wrapped(new_state)
    apply_updates_(params, updates)


def _eager_transform(ours: _Group, like: dict) -> Optional[GradientTransformation]:
    """Where the group's transform was built again with tensors (:func:`_follow_numbers`: a
    scheduler changed a number), the transform built with the numbers they hold now, which its
    eager step runs as the alias built with them runs (fused factors, a step written into the
    parameters: the alias's bits, also inside a chain), where its state has the structure of
    the one built with tensors (checked once per kind of numbers, on meta tensors like
    ``like``); else ``None``."""
    shown = ours.numbers
    if shown is None or shown.eager is None:
        return None
    kinds = tuple((name, _kinds_of(value)) for name, value in shown.runs_with.items())
    keeps = shown.eager_keeps.get(kinds)
    if keeps is None:
        keeps = shown.eager_keeps[kinds] = same_state_structure(shown.eager, ours.tx, like)
    return shown.eager if keeps else None


def _kinds_of(value: Any) -> Any:
    """What a factory may build another state structure for, of a number (a tuple's each)."""
    if isinstance(value, tuple):
        return tuple(_kinds_of(v) for v in value)
    return number_kind(value) if is_real_number(value) else type(value)


def _cached_tail(ours: _Group, tx: GradientTransformation) -> Optional["_Tail"]:
    """:func:`_tail_of` ``tx``, kept in the group while its transform is ``tx``."""
    if ours.tail is None or ours.tail[0] is not tx:
        ours.tail = (tx, _tail_of(tx))
    return ours.tail[1]


class _Tail(NamedTuple):
    """The end of a chain whose step can be written into the parameters (:func:`_tail_of`)."""

    head: GradientTransformation  # the links before ``link`` (before the last link, with ``inner``)
    link: Optional[GradientTransformation]
    factor: Optional[Callable[[], Any]]
    after: Optional[GradientTransformation]
    decayed: Optional[GradientTransformation]
    inner: Optional["_Tail"] = None  # the last link a chain itself (chain(clip, fb.adamw(...))): its tail


def _step_into(
    ours: _Group, tail: _Tail, grads: dict, state: tuple, params: dict, wrapped: Callable[[Any], OptState]
) -> bool:
    """The step of a chain's ``tail`` (:func:`_tail_of`) written into ``params``, the chain's
    new state (``wrapped``: as the group keeps it) set; False, nothing done, where the last
    link's numbers are not numbers now."""
    numbers = _numbers_of(tail)
    if numbers is None:
        return False  # a rate held on a device: the chain as it is
    _write(ours, tail, numbers, grads, state, params, wrapped)
    return True


def _numbers_of(tail: _Tail) -> Optional[tuple]:
    """``(alpha, multiplier, scaled_by)`` of the step ``tail`` writes (:func:`_tail_of`): ``p <-
    (p * scaled_by + alpha u) * multiplier`` (``None`` for a factor of 1); ``None`` where one
    of them is not a number now (held on a device)."""
    if tail.inner is not None:
        return _numbers_of(tail.inner)
    multiplier = scaled_by = None
    if tail.after is not None:  # p <- (p + alpha u) * multiplier
        alpha, multiplier = (number_now(v) for v in tail.after.update.scaled_after())  # type: ignore[attr-defined]
        if multiplier is None:
            return None
    else:
        alpha = number_now(tail.factor()) if tail.factor is not None else 1.0
    if alpha is None:
        return None
    if tail.decayed is not None:  # p <- p * scaled_by + alpha u, scaled_by = 1 - lr wd (alpha = -lr)
        decay = number_now(tail.decayed.update.decay())  # type: ignore[attr-defined]
        if decay is None:
            return None
        scaled_by = 1.0 + alpha * decay if decay != 0 else None
    return alpha, multiplier, scaled_by


def _write(
    ours: _Group,
    tail: _Tail,
    numbers: tuple,
    grads: dict,
    state: tuple,
    params: dict,
    wrapped: Callable[[Any], OptState],
) -> None:
    """:func:`_step_into`'s step, its ``numbers`` read (:func:`_numbers_of`)."""
    alpha, multiplier, scaled_by = numbers
    head, link, _, after, decayed, inner = tail
    # the links before `link` (before the last link, with `inner`)
    k = len(head.update.transforms)  # type: ignore[attr-defined]
    updates, head_state = ownership.update_giving_state(head, grads, state[:k], params)
    if inner is not None:  # the last link a chain: its own tail on the head's updates, in its state
        ours.state = wrapped((*head_state, *state[k:]))
        _write(ours, inner, numbers, updates, state[k], params, lambda new: wrapped((*head_state, new)))
        return
    # the new state kept before the parameters move: a raise past here leaves no stepped moment
    # beside an old count (a scaling link's own state is empty: kept as it was)
    ours.state = wrapped((*head_state, *state[k:]))
    if link is None:
        apply_updates_(params, updates, alpha)
        return
    stepped: list = []  # with ``after``: the parameters the link steps (an update each), multiplied after
    if after is not None:
        param_leaves, spec = tree.flatten(params)
        update_leaves = tree.leaves_matching(spec, updates, "the updates", "the parameters")
        stepped = [p for p, u in zip(param_leaves, update_leaves) if u is not None]
    # scaled_by only where there is one: a link written to the four-argument form still steps
    scaling = {} if scaled_by is None else {"scaled_by": scaled_by}
    link_state = link.update.apply_in_place(updates, state[k], params, alpha, **scaling)  # type: ignore[attr-defined]
    declined = link_state is None
    if declined:  # the link as the chain would run it, on the head's updates
        with ownership.giving_state(link.update):
            owned = ownership.returns_fresh_updates(head)
            updates, link_state = ownership.update_owning(link, owned, updates, state[k], params)
        if after is not None:  # and the last link, whose update is then added whole
            updates, _ = after.update(updates, state[k + 1], params)
            alpha = 1.0
        if decayed is not None:  # and the decay (stateless), the sum then added with alpha
            updates, _ = decayed.update(updates, state[k + 1], params)
    ours.state = wrapped((*head_state, link_state, *state[k + 1 :]))
    if declined:
        apply_updates_(params, updates, alpha)
    elif stepped and multiplier is not None:
        torch._foreach_mul_(stepped, multiplier)


def _tail_of(tx: GradientTransformation) -> Optional[_Tail]:
    """The :class:`_Tail` ``(head, link, factor, after, decayed, inner)`` where ``tx`` is a
    chain whose step can be written into the parameters: ``link`` a link with
    ``update.apply_in_place`` (its state and the parameters given up; it steps ``p <- p *
    scaled_by + alpha * u`` for its update ``u``, ``scaled_by`` 1 where not given), last or
    followed by a last link that multiplies by a number; ``factor`` that link's number
    (``update.factor``: :func:`~functional_bagua.transforms.scaling.factor_of`), ``None`` where
    there is none (``alpha`` 1); ``link`` ``None`` where the last link multiplies and the one
    before has no ``apply_in_place`` (the head's updates added with ``alpha``). ``after``: a
    last link whose step is ``p <- (p + alpha u) m`` (``update.scaled_after() -> (alpha, m)``,
    LaProp's decoupled decay), after a link with ``apply_in_place``: that link writes with
    ``alpha``, then the parameters it stepped are multiplied by ``m``. ``decayed``: a weight
    decay between ``link`` and the multiplying link (``update.decay() -> wd``:
    :func:`~functional_bagua.add_decayed_weights`, ``u + wd p``), which ``link`` then writes
    as ``scaled_by = 1 + alpha wd`` (``p.mul_(1 - lr wd)`` before its step, as AdamW-like
    references decay); else ``None``. ``head`` chains the links before ``link`` (before the
    multiplying link where ``link`` is ``None``). ``inner``: where the last link is a chain
    itself (``fb.chain(fb.clip_by_global_norm(1.0), fb.ademamix())``), its own tail, ``head``
    the links before it. The whole is ``None`` where ``tx`` has no such end."""
    links = getattr(tx.update, "transforms", None)
    if not links:
        return None
    *before, last = links
    if getattr(last.update, "transforms", None):  # a chain at the end: its own tail, after the links before it
        inner = _tail_of(last)
        return None if inner is None else _Tail(chain(*before), None, None, None, None, inner)
    if not before:
        return None

    def in_place(link: GradientTransformation) -> bool:
        return getattr(link.update, "apply_in_place", None) is not None

    if getattr(last.update, "scaled_after", None) is not None and in_place(before[-1]):
        return _Tail(chain(*before[:-1]), before[-1], None, last, None)
    factor = getattr(last.update, "factor", None)
    if factor is None:
        return _Tail(chain(*before), last, None, None, None) if in_place(last) else None
    if in_place(before[-1]):
        return _Tail(chain(*before[:-1]), before[-1], factor, None, None)
    if len(before) >= 2 and getattr(before[-1].update, "decay", None) is not None and in_place(before[-2]):
        return _Tail(chain(*before[:-2]), before[-2], factor, None, before[-1])
    return _Tail(chain(*before), None, factor, None, None)


def _requiring_grad(group: dict[str, Any]) -> frozenset[int]:
    return frozenset(k for k, p in enumerate(group["params"]) if p.requires_grad)


def _run_kernel(
    kernel: kernels.KernelSpec,
    grads: dict,
    state: OptState,
    params: list,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> OptState:
    """torch's fused kernel, in place, on the parameters with a gradient (unscaling them and
    skipping on an inf where GradScaler gave ``grad_scale`` / ``found_inf``); the state after it
    (an injected-hyperparameters wrapper counts the update, unless it was skipped)."""
    stepped = {k: p for k, p in enumerate(params) if grads[k] is not None}
    inner = state.inner_state if isinstance(state, InjectHyperparamsState) else state
    kernels.run(kernel, {k: grads[k] for k in stepped}, inner, stepped, grad_scale, found_inf)
    if not isinstance(state, InjectHyperparamsState):
        return state
    done = 1 if found_inf is None else 1 - found_inf.to(state.count.device, state.count.dtype)
    return tree.replaced(state, count=state.count + done)


def _cast_like(saved: Any, leaf: torch.Tensor) -> Any:
    """A saved floating-point tensor in the dtype of the state's (a model cast between save and load)."""
    if isinstance(saved, torch.Tensor) and saved.is_floating_point() and leaf.is_floating_point():
        return saved.to(leaf.dtype)
    return saved


def _numbers(held: Any) -> Any:
    """A hyperparameter's value (a number, a 0-dim tensor, or a tuple of them) as Python numbers."""
    if isinstance(held, tuple):
        return tuple(_numbers(h) for h in held)
    return held.item() if isinstance(held, torch.Tensor) else held


def _unscaled(grads: dict, scale: torch.Tensor) -> dict:
    """The gradients times ``1 / scale`` in their own shapes and dtypes, as GradScaler's own
    unscaling computes them (the reciprocal in float64, then float32)."""
    inverse = scale.double().reciprocal().float().reshape(())
    return {k: None if g is None else g.mul(inverse.to(g.device)).to(g.dtype) for k, g in grads.items()}


def _as_shown(value: Any) -> Any:
    """A number as the transform takes it: a list (``betas=[0.9, 0.99]``) as a tuple, as torch's
    groups hold it; a numpy number as Python's (an alias's fused kernel takes those only); numbers
    and tensors as they are (a scheduler fills a tensor in place)."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_shown(v) for v in value)
    if is_real_number(value) and not isinstance(value, (int, float)):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def _differs(held: Any, was: Any) -> bool:
    """Whether a group's value is not the one its transform runs with: another number, or another
    tensor object (a tensor changed in place is the same tensor, which the transform reads)."""
    if held is was:  # the usual case: the very number (or tensor) it runs with
        return False
    if isinstance(held, (tuple, list)) and isinstance(was, tuple):
        return len(held) != len(was) or any(_differs(h, w) for h, w in zip(held, was))
    if isinstance(held, torch.Tensor) or isinstance(was, torch.Tensor):
        return held is not was
    if is_real_number(held) and is_real_number(was):  # by value: a numpy number runs as the Python one it equals
        return float(held) != float(was)
    return type(held) is not type(was) or held != was


def _follow_numbers(optimizer: Optimizer, i: int, force: Any = ()) -> None:
    """Make group ``i``'s transform (built with numbers) run with the numbers its group holds now
    (what a scheduler, ``load_state_dict`` or the user wrote there). New values are validated as
    the alias validates its arguments (its ValueError, naming the argument). The first time a
    number changes (or where ``force`` names it: a checkpoint's group ran it so), the transform
    is built again with a 0-dim tensor for it (a tensor the group holds is taken as it is), and
    from then on a new value is written into that tensor: a compiled step reads it as data. A
    transform whose state would change its shape (``fb.sgd``'s momentum from 0, which keeps no
    buffer) raises a ValueError naming the number. Eager, also inside a compiled step."""
    ours, group = optimizer._groups[i], optimizer.param_groups[i]
    shown = ours.numbers
    assert shown is not None
    changed = {k: group[k] for k, was in shown.runs_with.items() if k in group and _differs(group[k], was)}
    forced = [k for k in force if k in shown.runs_with and k not in shown.tensors and k not in changed]
    if not changed and not forced:
        return
    for name, value in changed.items():
        _check_kind(name, value)
    now = {**shown.runs_with, **{k: _as_shown(v) for k, v in changed.items()}}
    numbers_now = {k: v for k, v in now.items() if not holds_tensor(v)}
    checked = shown.found.with_numbers(numbers_now)  # the alias's checks
    if len(numbers_now) == len(now):  # the transform whose kernel _kernel_of looks up: built once
        ours.kernel = (tuple(sorted(now.items())), kernels.spec_of(checked))
    device = group["params"][0].device
    fresh = [k for k, v in changed.items() if k not in shown.tensors or holds_tensor(v)] + forced
    tensors = {**shown.tensors, **{k: _held_as_tensors(k, now[k], device) for k in fresh}}
    tx = ours.tx
    if fresh:  # checked before anything changes: a refused value leaves the group as it ran
        tx = shown.found.with_numbers(tensors)
        if ours.state is not None:
            _check_same_state_structure(optimizer, i, tx, fresh)
    for name in changed.keys() - set(fresh):
        _fill(name, tensors[name], now[name])
    shown.tensors, shown.runs_with, ours.tx = tensors, now, tx
    shown.eager = checked if len(numbers_now) == len(now) else None  # the numbers' own transform


def _check_kind(name: str, value: Any) -> None:
    """A TypeError unless ``value`` is a number, a one-element tensor, or a tuple of those (or ``None``)."""
    if isinstance(value, (tuple, list)):
        for v in value:
            if v is not None:
                _check_kind(name, v)
        return
    if isinstance(value, torch.Tensor) and value.numel() == 1 or is_real_number(value):
        return
    raise TypeError(f"{NAME}: param group {name!r} holds {value!r}; a number (or a tuple of them) was expected")


def _held_as_tensors(name: str, value: Any, device: torch.device) -> Any:
    """A number (a tuple's each) as the 0-dim tensor a transform built again reads; a tensor as it is."""
    if isinstance(value, (tuple, list)):
        return tuple(None if v is None else _held_as_tensors(name, v, device) for v in value)
    if isinstance(value, torch.Tensor):
        return value
    _check_kind(name, value)
    return torch.tensor(float(value), dtype=SCALAR_DTYPE, device=device)


def _fill(name: str, tensors: Any, value: Any) -> None:
    if isinstance(tensors, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(tensors):
            raise ValueError(f"{NAME}: param group {name!r} holds {value!r}; {len(tensors)} values were expected")
        for t, v in zip(tensors, value):
            if t is not None:
                _fill(name, t, v)
        return
    _check_kind(name, value)
    tensors.fill_(float(value))


def _check_same_state_structure(optimizer: Optimizer, i: int, tx: GradientTransformation, names: list) -> None:
    """A ValueError if ``tx`` (group ``i``'s transform built with new numbers) keeps a state of
    another structure than the group's (made on the meta device: nothing is allocated)."""
    ours, params = optimizer._groups[i], optimizer.param_groups[i]["params"]
    meta = {
        k: torch.empty_like(p, device="meta") if k in ours.tracked else None
        for k, p in zip(positions(len(params)), params)
    }
    if tree.flatten(tx.init(meta))[1] != tree.flatten(ours.state)[1]:
        raise ValueError(
            f"{NAME}: param group {i}'s {names} changed to {[optimizer.param_groups[i][k] for k in names]}, which "
            "needs another optimizer state than the one its transform was built with (fb.sgd keeps no momentum "
            "buffer for momentum=0); build the transform with a nonzero value, or use the factory form "
            "fb.Optimizer(params, fb.sgd, lr=..., momentum=...), whose state holds every number"
        )


def _holds_code(value: Any) -> bool:
    """Whether a group's ``value`` is a function, or a tuple or list holding one."""
    return callable(value) or (isinstance(value, (tuple, list)) and any(callable(v) for v in value))


def _write_hyperparameters(state: InjectHyperparamsState, group: dict[str, Any], written: dict) -> None:
    """The group's numbers (what a scheduler wrote) into the state's hyperparameter tensors; run
    eagerly inside a compiled ``step``, so that the graph reads the tensors, never the numbers
    (a new lr is then neither baked in nor a recompilation). ``written`` remembers, by tensor
    (its id, and a weak reference to tell a new tensor at a reused id), the number this wrote and
    the tensor's version counter after it: a tensor that still holds it is not written again (on
    a GPU each write is a kernel launch); any other in-place write to it (a loaded checkpoint, a
    hand-set value) bumps the counter, and the group's number is written anew."""
    for name, held in state.hyperparams.items():
        value = group.get(name)
        if value is None or callable(value):
            continue
        for tensor, number in zip(tree.flatten(held)[0], tree.flatten(value)[0]):
            if not isinstance(tensor, torch.Tensor):
                continue
            if isinstance(number, torch.Tensor):  # a scheduler may change it in place: no cache
                tensor.fill_(number)
                continue
            known = written.get(id(tensor))
            if known is None or known[0]() is not tensor or known[1:] != (number, tensor._version):
                tensor.fill_(number)
                if known is None:  # a new tensor: forget those no longer alive
                    for gone in [k for k, (ref, *_) in written.items() if ref() is None]:
                        del written[gone]
                written[id(tensor)] = (weakref.ref(tensor), number, tensor._version)


def _refuse_optimizer_class(tx: Any) -> None:
    """A torch.optim class given as ``tx``: a TypeError naming its alias's factory, where there is one."""
    if not (isinstance(tx, type) and issubclass(tx, torch.optim.Optimizer)):
        return
    import functional_bagua

    alias = "sparse_adam" if tx.__name__ == "SparseAdam" else tx.__name__.lower()
    if hasattr(functional_bagua, alias):
        fix = f"pass its alias's factory, fb.Optimizer(params, fb.{alias}, lr=...), or use the class itself"
    else:
        fix = "pass a transform or a factory of one (fb.Optimizer(params, fb.adamw, lr=...)), or use the class itself"
    raise TypeError(f"{NAME}: tx is the optimizer class {tx.__name__}; {fix}")


def _same_numbers(a: tuple, b: tuple) -> bool:
    """Whether two sorted ``(name, value)`` tuples of factory arguments are equal; a tensor value
    (a hyperparameter given as a tensor) never counts as equal, so the alias is built again."""
    if len(a) != len(b):
        return False
    for (name_a, x), (name_b, y) in zip(a, b):
        if name_a != name_b or type(x) is not type(y) or holds_tensor(x) or holds_tensor(y) or x != y:
            return False
    return True
