"""A ``torch.optim.Optimizer`` that runs a GradientTransformation: for loops written for torch.optim.

Most training hands an optimizer object to a loop someone else wrote (torch's lr schedulers,
``GradScaler``, DDP, trainers). :class:`Optimizer` gives any chain that reach; inside, each step is
the pure update of the chain::

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
``"tx"`` entry names; its hyperparameters are fixed, and the groups hold no ``"lr"``.

``state_dict()`` is in torch's format: ``{"state": {index: {name: tensor}}, "param_groups": [...]}``,
each parameter's entries named by their path in the chain's state (``"0/mu"``); state that belongs
to no single parameter (step counters of schedules, injected hyperparameters) is kept in its
group under ``"shared_state"``. ``load_state_dict`` restores it exactly, so a resumed run is the
uninterrupted one bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import optree
import torch

from functional_bagua import checkpoint, tree
from functional_bagua.base import GradientTransformation, OptState, apply_updates
from functional_bagua.fusion import _copy_into
from functional_bagua.hyperparams import InjectHyperparamsState, inject_hyperparams

NAME = "fb.Optimizer"
Factory = Callable[..., GradientTransformation]


class Optimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` over a GradientTransformation (module docstring).

    Args:
        params: the parameters, or param groups (dicts with ``"params"`` and hyperparameters to
            override, or a ``"tx"`` of their own when ``tx`` is a transform), as torch.optim takes them.
        tx: a factory of transforms (``fb.adamw``, ``fb.sgd``, any function of hyperparameters
            returning one), or a GradientTransformation.
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
        tx: Union[Factory, GradientTransformation],
        **hyperparameters: Any,
    ) -> None:
        if isinstance(tx, GradientTransformation):
            if hyperparameters:
                raise TypeError(
                    f"{NAME}: hyperparameters {sorted(hyperparameters)} given with a built transform; pass the "
                    "factory instead (fb.Optimizer(params, fb.adamw, lr=1e-3)) or build them into the transform"
                )
        elif callable(tx):
            hyperparameters = {**_defaults_of(tx, hyperparameters), **hyperparameters}
        else:
            raise TypeError(f"{NAME}: tx must be a GradientTransformation or a factory of one, got {type(tx).__name__}")
        self._tx = tx
        # eager even inside a compiled step (made here: torch.compiler imports dynamo, too heavy for import time)
        self._write_hyperparameters = torch.compiler.disable(_write_hyperparameters)
        self._txs: list[GradientTransformation] = []  # one per param group
        self._states: list[OptState] = []
        super().__init__(params, hyperparameters)

    # ---- groups ---------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, as torch.optim does; its transform is built (and its state initialized) here.

        Args:
            param_group: ``{"params": ..., **hyperparameters}`` (or ``"tx"`` with a transform).
        """
        group_tx = param_group.pop("tx", None)
        if group_tx is not None and not isinstance(self._tx, GradientTransformation):
            raise ValueError(f"{NAME}: a param group's 'tx' needs the optimizer built from a transform, not a factory")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if isinstance(self._tx, GradientTransformation):
            tx = group_tx if group_tx is not None else self._tx
            if not isinstance(tx, GradientTransformation):
                raise TypeError(f"{NAME}: param group 'tx' must be a GradientTransformation, got {type(tx).__name__}")
        else:
            tx = inject_hyperparams(self._tx)(**_hyperparameters_of(group))
        self._txs.append(tx)
        self._states.append(tx.init(_detached(group)))

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
            params = _detached(group)
            grads = {k: p.grad for k, p in enumerate(group["params"])}
            if all(g is None for g in grads.values()):
                continue  # as torch.optim: a group without gradients is left as it is, its state too
            state = self._states[i]
            if isinstance(state, InjectHyperparamsState):
                self._write_hyperparameters(state, group)
            updates, self._states[i] = self._txs[i].update(grads, state, params)
            _copy_into(params, apply_updates(params, updates))
        return loss

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


def _hyperparameters_of(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _detached(group: dict[str, Any]) -> dict[int, torch.Tensor]:
    return {k: p.detach() for k, p in enumerate(group["params"])}


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
            next((entry.entry for entry in accessor if _is_parameter_key(entry)), None),
            checkpoint._key(accessor, skip=_is_parameter_key),
            leaf,
        )
        for key, accessor, leaf in zip(keys, accessors, leaves)
        if leaf is not None
    ]
