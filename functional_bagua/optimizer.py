"""A ``torch.optim.Optimizer`` that runs a GradientTransformation: for loops written for torch.optim.

Most training hands an optimizer object to a loop someone else wrote (torch's lr schedulers,
``GradScaler``, DDP, trainers). :class:`Optimizer` gives any chain that reach; inside, each step is
the pure update of the chain (or torch's fused kernel where one computes it, below)::

    grads = {i: p.grad for i, p in enumerate(group["params"])}     # None where there is no .grad
    updates, state = tx.update(grads, state, params)
    p.copy_(apply_updates(params, updates)[i])                      # for every parameter

Built from a factory and its hyperparameters, as a torch.optim class is::

    opt = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

each param group runs ``inject_hyperparams(factory)(**hyperparameters)``: its numbers appear in the
group (``group["lr"]``, ``group["betas"]``), and what a scheduler writes there is the value the
next step uses: it is copied into the state's tensors before the update, outside any graph, so
``torch.compile(opt.step)`` reads it as data and never recompiles for a new lr.
Groups may override hyperparameters, as torch's do. Built from a transform
(``fb.Optimizer(params, fb.chain(...))``), every group runs that transform, or the one its
``"tx"`` entry names; its hyperparameters are fixed, and the group holds no ``"lr"``, unless the
transform is made by :func:`~functional_bagua.inject_hyperparams`: then those no schedule
drives are in the group, as numbers a scheduler may write.

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

``optimizer.state[p]`` is, as in torch.optim, a dict of the parameter's tensors in the chain's
state (``fb.adamw``'s first moment is ``"inner_state/1/mu"`` in a factory's optimizer, whose
chain sits in an injected-hyperparameters state); assigning an entry (``opt.state[p][name] =
t.to(device)``, what trainers do to move the state) replaces that tensor in the chain's state.

``state_dict()`` is in torch's format: ``{"state": {index: {name: tensor}}, "param_groups": [...]}``,
each parameter's entries named by their path in the chain's state, as in ``optimizer.state``; state that belongs
to no single parameter (step counters of schedules, injected hyperparameters) is kept in its
group under ``"shared_state"``. ``load_state_dict`` restores it exactly, so a resumed run is the
uninterrupted one bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any, Callable, Optional, Union

import optree
import torch

from functional_bagua import checkpoint, kernels, tree
from functional_bagua.base import GradientTransformation, OptState, apply_updates
from functional_bagua.fusion import _copy_into
from functional_bagua.hyperparams import InjectHyperparamsState, inject_hyperparams
from functional_bagua.transforms.wrappers import Partitioned, partitioned

NAME = "fb.Optimizer"
Factory = Callable[..., GradientTransformation]


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
        if tx is None or isinstance(tx, GradientTransformation):
            if hyperparameters:
                raise TypeError(
                    f"{NAME}: hyperparameters {sorted(hyperparameters)} given without a factory; pass the "
                    "factory (fb.Optimizer(params, fb.adamw, lr=1e-3)) or build them into the transform"
                )
        elif callable(tx):
            hyperparameters = {**_defaults_of(tx, hyperparameters), **hyperparameters}
        else:
            raise TypeError(f"{NAME}: tx must be a GradientTransformation or a factory of one, got {type(tx).__name__}")
        self._tx = tx
        self.fused = fused
        # eager even inside a compiled step, so that no graph reads the group's numbers (made here:
        # torch.compiler imports dynamo, too heavy for import time)
        self._write_hyperparameters = torch.compiler.disable(_write_hyperparameters)
        self._run_kernel = torch.compiler.disable(_run_kernel)
        self._txs: list[GradientTransformation] = []  # one per param group
        self._states: list[OptState] = []
        super().__init__(params, hyperparameters)
        self.state = ParameterStates(self)  # type: ignore[assignment]

    @property
    def _from_factory(self) -> bool:
        return self._tx is not None and not isinstance(self._tx, GradientTransformation)

    # ---- groups ---------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, as torch.optim does; its transform is built (and its state initialized)
        here. A group run by a :func:`~functional_bagua.partition` becomes one group per label.

        Args:
            param_group: ``{"params": ..., **hyperparameters}`` (or ``"tx"``: the group's transform).
        """
        param_group = dict(param_group)
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
        if parts is None:
            self._add_group(param_group, tx)
            return
        for label_group, label_tx in _split_by_label(param_group, parts):
            self._add_group(label_group, label_tx)

    def _add_group(self, param_group: dict[str, Any], tx: Union[Factory, GradientTransformation]) -> None:
        """torch's checks and defaults, then the group's transform and state; on an error the
        optimizer is left as it was."""
        super().add_param_group(param_group)
        try:
            self._set_up_group(len(self.param_groups) - 1, tx)
        except BaseException:
            del self.param_groups[len(self._states) :]
            del self._txs[len(self._states) :]
            raise

    def _set_up_group(self, index: int, tx: Union[Factory, GradientTransformation]) -> None:
        group = self.param_groups[index]
        if not isinstance(tx, GradientTransformation):
            tx = inject_hyperparams(tx)(**self._factory_arguments(group))
        if "value_fn" in inspect.signature(tx.update).parameters:
            raise TypeError(
                f"{NAME}: param group {index}'s transform evaluates the loss at other parameters "
                "(update(..., value_fn=...): fb.lbfgs), which a step from .grad cannot give; run it in a functional "
                "loop, tx.update(grads, state, params, value_fn=loss_of), or use torch.optim.LBFGS with a closure"
            )
        self._txs.append(tx)
        if self.fused and self._kernel(index) is None:
            raise ValueError(
                f"{NAME}: fused=True, but torch has no fused kernel for param group {index}'s transform "
                "(only fb.adamw, fb.adam and fb.sgd with number hyperparameters have one); pass fused=None"
            )
        state = tx.init(_detached(group))
        if isinstance(state, InjectHyperparamsState):
            for name in getattr(tx.update, "adjustable", ()):
                group.setdefault(name, _numbers(state.hyperparams[name]))
        self._states.append(state)

    def _factory_arguments(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group's entries that the factory takes (torch's groups may hold others)."""
        accepted = self.defaults.keys()
        return {k: v for k, v in group.items() if k in accepted}

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
        for i, group in enumerate(self.param_groups):
            grads = {k: p.grad for k, p in enumerate(group["params"])}
            if all(g is None for g in grads.values()):
                continue  # as torch.optim: a group without gradients is left as it is, its state too
            state = self._states[i]
            if isinstance(state, InjectHyperparamsState):
                self._write_hyperparameters(state, group)
            kernel = self._kernel(i)
            if kernel is not None:  # on the parameters themselves, as torch.optim's fused step
                self._states[i] = self._run_kernel(kernel, grads, state, group["params"])
                continue
            params = _detached(group)
            updates, self._states[i] = self._txs[i].update(grads, state, params)
            _copy_into(params, apply_updates(params, updates))
        return loss

    def _kernel(self, i: int) -> Optional[kernels.KernelSpec]:
        """torch's fused kernel for group ``i`` with its numbers now, if one computes its transform
        and ``fused`` allows it."""
        if self.fused is False:
            return None
        if self._from_factory:
            assert self._tx is not None and not isinstance(self._tx, GradientTransformation)
            return kernels.spec_of(self._tx(**self._factory_arguments(self.param_groups[i])))
        return kernels.spec_of(self._txs[i])

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim keeps only defaults, state and param_groups; the chains and their states too
        return dict(self.__dict__)

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's format (module docstring): per-parameter state by global index, and the groups."""
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        start = 0
        for group, state in zip(self.param_groups, self._states):
            shared: dict[str, Any] = {}
            for _, position, name, leaf in _named_leaves(state):
                if position is None:
                    shared[name] = leaf
                else:
                    per_param.setdefault(start + position, {})[name] = leaf
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            packed["shared_state"] = shared
            groups.append(packed)
            start += len(group["params"])
        return {"state": per_param, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (copies of its tensors, on this state's devices).

        Args:
            state_dict: a state dict of an :class:`Optimizer` over the same groups and chains;
                another optimizer's raises a ValueError naming the difference.
        """
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
        per_param = state_dict["state"]
        for i, (saved, group) in enumerate(zip(groups, self.param_groups)):
            flat = {}  # this state's keys (fb.state_dict's), the saved tensors
            for key, position, name, _ in _named_leaves(self._states[i]):
                source = saved["shared_state"] if position is None else per_param.get(saved["params"][position], {})
                if name not in source:
                    raise ValueError(
                        f"{NAME}: the state dict has no {name!r} for group {i}; it was saved from another chain"
                    )
                flat[key] = source[name]
            self._states[i] = checkpoint.load_state_dict(self._states[i], flat)
            group.update({k: v for k, v in saved.items() if k not in ("params", "shared_state")})


class ParameterStates(MutableMapping):
    """``optimizer.state`` as torch.optim has it: parameter -> :class:`ParameterState`, a dict of
    its tensors in its group's chain state, named as in ``state_dict()``. Read from the chain's
    state at each access; an assignment (of an entry, or of a parameter's whole dict) replaces the
    tensors there. Parameters without entries of their own (a plain SGD) are not listed."""

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer

    def _where(self, param: Any) -> tuple[int, int]:
        for i, group in enumerate(self._optimizer.param_groups):
            for position, p in enumerate(group["params"]):
                if p is param:
                    return i, position
        raise KeyError(param)

    def __getitem__(self, param: Any) -> ParameterState:
        i, position = self._where(param)
        entries = {name: leaf for _, at, name, leaf in _named_leaves(self._optimizer._states[i]) if at == position}
        return self._view(i, position, entries)

    def items(self) -> list[tuple[torch.Tensor, ParameterState]]:  # type: ignore[override]
        """Every parameter's state, each group's state read once (``Mapping.items`` would read
        it once per parameter)."""
        out = []
        for i, group in enumerate(self._optimizer.param_groups):
            by_position: dict[int, dict[str, torch.Tensor]] = {}
            for _, at, name, leaf in _named_leaves(self._optimizer._states[i]):
                if at is not None:
                    by_position.setdefault(at, {})[name] = leaf
            out += [(group["params"][at], self._view(i, at, entries)) for at, entries in sorted(by_position.items())]
        return out

    def _view(self, i: int, position: int, entries: dict[str, torch.Tensor]) -> ParameterState:
        return ParameterState(entries, lambda changed: self._replace(i, position, changed))

    def __setitem__(self, param: Any, entries: Any) -> None:
        i, position = self._where(param)
        self._replace(i, position, dict(entries))

    def __delitem__(self, param: Any) -> None:
        raise TypeError(f"{NAME}: a parameter's state cannot be deleted: the chain's state has a fixed structure")

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, _ in self.items())

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _replace(self, i: int, position: int, changed: dict[str, Any]) -> None:
        """Group ``i``'s state with the named tensors of the parameter at ``position`` replaced."""
        keys, accessors, leaves, spec = checkpoint._keyed_leaves(self._optimizer._states[i])
        index = {
            checkpoint._key(accessor, skip=_is_parameter_key): j
            for j, (accessor, leaf) in enumerate(zip(accessors, leaves))
            if leaf is not None and _position(accessor) == position
        }
        for name, value in changed.items():
            if name not in index:
                raise KeyError(f"{NAME}: the parameter's state has no {name!r}; it has {sorted(index)}")
            old = leaves[index[name]]
            if not isinstance(value, torch.Tensor) or value.shape != old.shape:
                raise ValueError(
                    f"{NAME}: state entry {name!r} must stay a tensor of shape {tuple(old.shape)}, got "
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                )
            leaves[index[name]] = value
        self._optimizer._states[i] = spec.unflatten(leaves)


class ParameterState(dict):
    """One parameter's tensors in its chain's state (``optimizer.state[p]``); assigning an entry
    replaces that tensor in the chain's state as well."""

    def __init__(self, entries: dict[str, torch.Tensor], replace: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(entries)
        self._replace = replace

    def __setitem__(self, name: str, value: Any) -> None:
        self._replace({name: value})
        super().__setitem__(name, value)

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # a copy (deepcopy, pickle) is a plain dict, tied to no optimizer


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


def _run_kernel(kernel: kernels.KernelSpec, grads: dict, state: OptState, params: list) -> OptState:
    """torch's fused kernel, in place, on the parameters with a gradient; the state after it (an
    injected-hyperparameters wrapper counts the update)."""
    stepped = {k: p for k, p in enumerate(params) if grads[k] is not None}
    inner = state.inner_state if isinstance(state, InjectHyperparamsState) else state
    kernels.run(kernel, {k: grads[k] for k in stepped}, inner, stepped)
    return state._replace(count=state.count + 1) if isinstance(state, InjectHyperparamsState) else state


def _detached(group: dict[str, Any]) -> dict[int, torch.Tensor]:
    return {k: p.detach() for k, p in enumerate(group["params"])}


def _numbers(held: Any) -> Any:
    """An injected hyperparameter's value (a 0-dim tensor, or a tuple of them) as Python numbers."""
    if isinstance(held, tuple):
        return tuple(_numbers(h) for h in held)
    return held.item() if isinstance(held, torch.Tensor) else held


def _write_hyperparameters(state: InjectHyperparamsState, group: dict[str, Any]) -> None:
    """The group's numbers (what a scheduler wrote) into the state's hyperparameter tensors; run
    eagerly inside a compiled ``step``, so that the graph reads the tensors, never the numbers
    (a new lr is then neither baked in nor a recompilation)."""
    for name, held in state.hyperparams.items():
        value = group.get(name)
        if value is None or callable(value):
            continue
        for tensor, number in zip(tree.flatten(held)[0], tree.flatten(value)[0]):
            tensor.fill_(number)


def _is_parameter_key(entry: Any) -> bool:
    """A dict entry keyed by an int: the state trees are keyed by each parameter's position."""
    return isinstance(entry, optree.MappingEntry) and isinstance(entry.entry, int)


def _named_leaves(state: OptState) -> list[tuple[str, Optional[int], str, torch.Tensor]]:
    """Per tensor of ``state``: its key (:func:`~functional_bagua.state_dict`'s), the position of
    the parameter it belongs to (``None`` for shared state), and its name without that position
    (``"inner_state/1/mu"``)."""
    keys, accessors, leaves, _ = checkpoint._keyed_leaves(state)
    return [
        (
            key,
            _position(accessor),
            checkpoint._key(accessor, skip=_is_parameter_key),
            leaf,
        )
        for key, accessor, leaf in zip(keys, accessors, leaves)
        if leaf is not None
    ]


def _position(accessor: optree.PyTreeAccessor) -> Optional[int]:
    """The position of the parameter a state tensor belongs to; ``None`` for shared state."""
    return next((entry.entry for entry in accessor if _is_parameter_key(entry)), None)
