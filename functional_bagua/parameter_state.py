r"""``optimizer.state`` for :class:`~functional_bagua.Optimizer`: torch's per-parameter view of a
chain's state.

A chain's state is one tree per param group, keyed by each parameter's position in the group
(``{0: mu_0, 1: mu_1, ...}`` inside ``ScaleByAdamState``; the keys are :class:`Position`\ s). torch's code (trainers moving the state
to a device, torch.distributed.checkpoint, logging) reads ``optimizer.state[p]``: a dict of the
tensors of ``p``. :class:`GroupLayout` records once, per group, which tensor of the flattened
state belongs to which parameter and under which name; :class:`ParameterStates` reads and
replaces tensors through it, so that a read costs one flatten of the group's state and a
write one flatten and unflatten.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any, Callable, NamedTuple, Optional, Protocol

import optree
import torch

from functional_bagua import checkpoint
from functional_bagua.base import OptState

NAME = "fb.Optimizer"


class GroupLayout(NamedTuple):
    """Per tensor of a group's state, in flatten order: its key (``fb.state_dict``'s), the
    position of the parameter it belongs to (``None`` for shared state: step counters of
    schedules, injected hyperparameters) and its name without that position (``"inner_state/1/mu"``)."""

    spec: optree.PyTreeSpec
    keys: list[str]
    positions: list[Optional[int]]
    names: list[str]
    where: dict[Optional[int], dict[str, int]]  # position -> name -> leaf index

    @classmethod
    def of(cls, state: OptState) -> GroupLayout:
        keys, accessors, _, spec = checkpoint._keyed_leaves(state)
        entries = [_position_entry(a) for a in accessors]
        positions = [None if e is None else e.entry for e in entries]
        names = [checkpoint._key(a, skip=_is(e)) for a, e in zip(accessors, entries)]
        where: dict[Optional[int], dict[str, int]] = {}
        for j, (position, name) in enumerate(zip(positions, names)):
            where.setdefault(position, {})[name] = j
        return cls(spec, keys, positions, names, where)

    def of_parameter(self, leaves: list, position: int) -> dict[str, torch.Tensor]:
        """name -> tensor of the parameter at ``position`` (``None`` leaves left out)."""
        return {
            name: leaves[j] for name, j in self.where.get(position, {}).items() if isinstance(leaves[j], torch.Tensor)
        }

    def per_parameter(self, leaves: list) -> dict[int, dict[str, torch.Tensor]]:
        """position -> {name: tensor}, for the parameters with tensors of their own, in order."""
        entries = {at: self.of_parameter(leaves, at) for at in sorted(a for a in self.where if a is not None)}
        return {at: held for at, held in entries.items() if held}

    def shared(self, leaves: list) -> dict[str, torch.Tensor]:
        """name -> tensor of the state that belongs to no single parameter."""
        return {
            name: leaf
            for position, name, leaf in zip(self.positions, self.names, leaves)
            if position is None and isinstance(leaf, torch.Tensor)
        }


class StateOwner(Protocol):
    """What :class:`ParameterStates` needs of the optimizer."""

    param_groups: list[dict[str, Any]]

    def _group_state(self, i: int) -> Optional[tuple[list, GroupLayout]]: ...

    def _write_leaves(self, i: int, position: int, changed: dict[str, torch.Tensor]) -> None: ...

    def _has_state(self) -> bool: ...


class ParameterStates(MutableMapping):
    """``optimizer.state`` as torch.optim has it: parameter -> :class:`ParameterState`, a dict of
    its tensors in its group's chain state, named as in ``state_dict()``. Read from the chain's
    state at each access; an assignment (of an entry, or of a parameter's whole dict) replaces the
    tensors there. Reading never makes a group's state: before the first step it is empty, as
    torch's. Parameters without tensors of their own (a plain SGD, a frozen parameter) are not
    listed, but the mapping is true once the state is made (torch.distributed.checkpoint reads
    an empty one as an optimizer that has not stepped yet; see ``Optimizer._has_state``)."""

    def __init__(self, owner: StateOwner) -> None:
        self._owner = owner
        self._places: dict[int, tuple[int, int]] = {}  # id(parameter) -> (group, position)

    def _where(self, param: Any) -> tuple[int, int]:
        place = self._places.get(id(param))
        groups = self._owner.param_groups
        if place is None or place[0] >= len(groups) or not _holds(groups[place[0]], place[1], param):
            self._places = {id(p): (i, at) for i, g in enumerate(groups) for at, p in enumerate(g["params"])}
            place = self._places.get(id(param))
            if place is None:
                raise KeyError(param)
        return place

    def __getitem__(self, param: Any) -> ParameterState:
        i, position = self._where(param)
        made = self._owner._group_state(i)
        if made is None:  # as torch's before the first step: nothing yet
            return ParameterState({}, self._refuse_before_first_step)
        leaves, layout = made
        return self._view(i, position, layout.of_parameter(leaves, position))

    def __contains__(self, param: object) -> bool:
        """Whether ``param`` has tensors of its own in the state (as in torch's, where a
        parameter that never stepped has none)."""
        try:
            return bool(self[param])
        except KeyError:
            return False

    def items(self) -> list[tuple[torch.Tensor, ParameterState]]:  # type: ignore[override]
        """Every parameter's state, each group's state flattened once."""
        out = []
        for i, group in enumerate(self._owner.param_groups):
            made = self._owner._group_state(i)
            if made is None:
                continue
            leaves, layout = made
            out += [(group["params"][at], self._view(i, at, held)) for at, held in layout.per_parameter(leaves).items()]
        return out

    def __setitem__(self, param: Any, entries: Any) -> None:
        self[param].update(entries)

    def __delitem__(self, param: Any) -> None:
        raise TypeError(f"{NAME}: a parameter's state cannot be deleted: the chain's state has a fixed structure")

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, _ in self.items())

    def __len__(self) -> int:
        return len(self.items())

    def __bool__(self) -> bool:
        return self._owner._has_state()

    @staticmethod
    def _refuse_before_first_step(changed: dict[str, Any]) -> None:
        raise KeyError(f"{NAME}: the parameter has no state before the optimizer's first step")

    def _view(self, i: int, position: int, entries: dict[str, torch.Tensor]) -> ParameterState:
        return ParameterState(entries, lambda changed: self._owner._write_leaves(i, position, changed))


class ParameterState(dict):
    """One parameter's tensors in its chain's state (``optimizer.state[p]``); assigning an entry
    (``[name] =``, ``update``) replaces that tensor in the chain's state as well."""

    def __init__(self, entries: dict[str, torch.Tensor], replace: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(entries)
        self._replace = replace

    def __setitem__(self, name: str, value: Any) -> None:
        self.update({name: value})

    def update(self, *args: Any, **kwargs: Any) -> None:
        changed = dict(*args, **kwargs)
        for name, value in changed.items():
            if name not in self:
                raise KeyError(f"{NAME}: the parameter's state has no {name!r}; it has {sorted(self)}")
            old = dict.__getitem__(self, name)
            if not isinstance(value, torch.Tensor) or value.shape != old.shape:
                raise ValueError(
                    f"{NAME}: state entry {name!r} must stay a tensor of shape {tuple(old.shape)}, got "
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                )
        self._replace(changed)
        super().update(changed)

    def setdefault(self, name: str, value: Any = None) -> Any:
        if name not in self:
            self[name] = value
        return self[name]

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{NAME}: entries of a parameter's state cannot be removed: the chain's state has a fixed structure"
        )

    __delitem__ = pop = popitem = clear = _refuse

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # a copy (deepcopy, pickle) is a plain dict, tied to no optimizer


def _holds(group: dict[str, Any], position: int, param: Any) -> bool:
    params = group["params"]
    return position < len(params) and params[position] is param


def _is(entry: Optional[optree.MappingEntry]) -> Callable[[Any], bool]:
    return lambda other: other is entry


def _position_entry(accessor: optree.PyTreeAccessor) -> Optional[optree.MappingEntry]:
    """The entry of the path to a state tensor that names its parameter (a :class:`Position`
    key); ``None`` for shared state."""
    return next((e for e in accessor if isinstance(e, optree.MappingEntry) and type(e.entry) is Position), None)


class Position(int):
    """A parameter's position in its group, as the key of the trees the optimizer hands its
    chains: an int that says what it is, so that the state's per-parameter entries are told
    from other int keys on the way (a partition's int labels)."""

    __slots__ = ()


_POSITIONS: dict[int, tuple[Position, ...]] = {}


def positions(n: int) -> tuple[Position, ...]:
    """The keys of a group of ``n`` parameters (made once per ``n``: a step asks every time)."""
    kept = _POSITIONS.get(n)
    if kept is None:
        kept = _POSITIONS[n] = tuple(Position(k) for k in range(n))
    return kept
