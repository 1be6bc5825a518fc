"""Bagua's ``bagua.torch_api.contrib.fuse.optimizer``: the fused optimizer
(:mod:`functional_bagua.compat.fuse`) under Bagua's module path, and that module's helpers for
tensors lying back to back in memory and for a torch optimizer's per-parameter state:

- :func:`calculate_mutual_groups`: for several lists of tensors of one length (the parameters
  and each of their state tensors, say), the groups of positions whose tensors lie back to back,
  in address order, in every list, so that all of them can be viewed as one flat tensor each;
  :func:`group_tensors` gives such a group's storage and size, ``_create_tensor`` a flat
  tensor over it, ``_can_reuse_tensor`` whether a tensor already is that flat tensor.
- :func:`flatten_tensors_with_closure` moves tensors reached through a getter (``p.data``,
  ``p.grad.data``, ``optimizer.state[p][name].data``) into one flat buffer, each becoming a view
  of it; :func:`flatten_params_and_states` does so for every param group's parameters, gradients
  and state tensors, per tensor type (Bagua's ``do_flatten``).
- :func:`get_optimizer_param_states` splits the parameters' state into tensors (one list per
  name) and scalars (one value per name, the same for every parameter); :func:`get_tensor_state`
  reads one tensor; :func:`infer_state_tensors` cuts the state of a flat parameter back into
  views shaped like its members'; :func:`sync_param_group_scalars` copies a group's settings.

Bagua's fused optimizer kept a second optimizer over flat parameters
(:func:`make_optimizer_instance` makes such a copy, as Bagua's);
:func:`~functional_bagua.compat.fuse.fuse_optimizer` here steps the optimizer itself on flat views, with
no second copy. The steps of Bagua's design that act on the copy, ``do_fuse`` (build its flat
parameters), ``sync_optimizer_state`` (write its state back) and ``check_optimizer`` (compare the
attributes it cloned), therefore have nothing to act on: each raises a NotImplementedError that
names :func:`~functional_bagua.compat.fuse.fuse_step`, which does the whole step.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch

from functional_bagua.compat.fuse import fuse_optimizer, fuse_step, is_fused_optimizer
from functional_bagua.compat.utils import check_contiguous, get_flattened_tensor

__all__ = [
    "fuse_optimizer",
    "fuse_step",
    "is_fused_optimizer",
    "check_contiguous",
    "check_optimizer",
    "calculate_mutual_groups",
    "do_fuse",
    "flatten_params_and_states",
    "flatten_tensors_with_closure",
    "get_flattened_tensor",
    "get_optimizer_param_states",
    "get_tensor_state",
    "group_tensors",
    "infer_state_tensors",
    "make_optimizer_instance",
    "sync_optimizer_state",
    "sync_param_group_scalars",
]

LOGGER = logging.getLogger(__name__)


def _end(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size()


def _is_contiguous_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether one of ``a`` and ``b`` starts where the other ends."""
    return a.data_ptr() == _end(b) or b.data_ptr() == _end(a)


def _find_continuous_tensors(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The positions of ``tensors`` grouped into runs that lie back to back, each run in address
    order and of at least two tensors; the runs in address order."""
    by_address = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    runs: list[list[int]] = []
    current: list[int] = []
    for i in by_address:
        if current and tensors[i].data_ptr() != _end(tensors[current[-1]]):
            runs.append(current)
            current = []
        current.append(i)
    runs.append(current)
    return [run for run in runs if len(run) > 1]


def _intersect(a: Sequence[list[int]], b: Sequence[list[int]]) -> list[list[int]]:
    """The groups of ``a`` that ``b`` also has, in ``a``'s order."""
    return [group for group in a if group in b]


def calculate_mutual_groups(tensors_list: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
    """The runs of ``_find_continuous_tensors`` that every list of ``tensors_list`` has
    (module docstring); ``[]`` for no lists. Every list must have the same length (an
    AssertionError otherwise, as Bagua's).

    Args:
        tensors_list: lists of tensors, position ``i`` of each list belonging together.
    """
    if not tensors_list:
        return []
    size = len(tensors_list[0])
    groups = None
    for tensors in tensors_list:
        assert len(tensors) == size, "Tensors to calculate mutual groups must have equal size."
        found = _find_continuous_tensors(tensors)
        groups = found if groups is None else _intersect(groups, found)
    return groups or []


def group_tensors(tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> Optional[tuple]:
    """``(storage, numel, dtype, device)`` of the tensors at ``indices``, which must lie back to
    back (an AssertionError otherwise, as Bagua's): what ``_create_tensor`` makes one flat
    tensor of; ``None`` for no indices.

    Args:
        tensors: tensors.
        indices: the positions of a group, as :func:`calculate_mutual_groups` gives them.
    """
    if not indices:
        return None
    grouped = [tensors[i] for i in indices]
    assert check_contiguous(grouped), "tensors grouped must be contiguous"
    first = grouped[0]
    return first.untyped_storage(), sum(t.numel() for t in grouped), first.dtype, first.device


def _create_tensor(storage: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements of ``dtype`` over ``storage`` from its start (no copy)."""
    with torch.no_grad():
        flat = torch.empty(0, dtype=dtype, device=device)
        return flat.set_(storage, 0, (numel,), (1,))


def _can_reuse_tensor(
    tensor: Optional[torch.Tensor], storage: Any, numel: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``tensor`` already is the flat tensor :func:`_create_tensor` would make: on the same
    storage, with ``numel`` elements of ``dtype`` on ``device``."""
    if tensor is None:
        return False
    return (
        tensor.untyped_storage().data_ptr() == storage.data_ptr()
        and tensor.numel() == numel
        and tensor.dtype == dtype
        and tensor.device == device
    )


def flatten_tensors_with_closure(
    tensors: Sequence[Any],
    getter_closure: Callable[[Any], torch.Tensor],
    setter_closure: Callable[[Any, torch.Tensor], None],
) -> None:
    """Move the tensors ``getter_closure`` reads from ``tensors`` into one flat buffer: each gets,
    through ``setter_closure``, a view of the buffer holding its values, in order, so that they lie
    back to back. Nothing happens where they already do (or for no tensors).

    Args:
        tensors: the objects that hold the tensors (parameters, say).
        getter_closure: ``getter(obj) -> tensor`` (``lambda p: p.data``); the tensors must share
            dtype and device.
        setter_closure: ``setter(obj, view)`` (``lambda p, t: setattr(p, "data", t)``).

    Example::

        flatten_tensors_with_closure(params, lambda p: p.data, lambda p, t: setattr(p, "data", t))
    """
    if not tensors:
        return
    current = [getter_closure(t) for t in tensors]
    if check_contiguous(current):
        return
    flat = get_flattened_tensor(current)
    assert flat is not None
    offset = 0
    with torch.no_grad():
        for holder, tensor in zip(tensors, current):
            view = flat[offset : offset + tensor.numel()].view(tensor.shape)
            view._bagua_flattened_tensor = flat  # type: ignore[attr-defined]  # as Bagua marks it
            setter_closure(holder, view)
            offset += tensor.numel()


def flatten_params_and_states(optimizer: torch.optim.Optimizer) -> None:
    """Lay each param group's parameters, per tensor type, back to back in one buffer, and their
    gradients (made as zeros where missing) and each of their state tensors in buffers of the same
    layout (:func:`flatten_tensors_with_closure`), so that runs of them can be stepped as one. A
    type whose parameters' state does not have the same names everywhere is left as it is (an
    error logged, :func:`get_optimizer_param_states`).

    Args:
        optimizer: a torch optimizer (state made or not).
    """
    for group in optimizer.param_groups:
        by_type: dict[str, list[torch.Tensor]] = {}
        for param in group["params"]:
            by_type.setdefault(param.type(), []).append(param)
        for params in by_type.values():
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            state_tensors, _ = get_optimizer_param_states(optimizer, params)
            if state_tensors is None:
                continue
            flatten_tensors_with_closure(params, _data, _set_data)
            flatten_tensors_with_closure(params, _grad_data, _set_grad_data)
            for name in state_tensors:
                flatten_tensors_with_closure(
                    params,
                    functools.partial(_state_data, optimizer, name),
                    functools.partial(_set_state_data, optimizer, name),
                )


def _data(p: torch.Tensor) -> torch.Tensor:
    return p.data


def _set_data(p: torch.Tensor, t: torch.Tensor) -> None:
    p.data = t


def _grad_data(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.data


def _set_grad_data(p: torch.Tensor, t: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.data = t


def _state_data(optimizer: torch.optim.Optimizer, name: str, p: torch.Tensor) -> torch.Tensor:
    return optimizer.state[p][name].data


def _set_state_data(optimizer: torch.optim.Optimizer, name: str, p: torch.Tensor, t: torch.Tensor) -> None:
    optimizer.state[p][name].data = t


def get_tensor_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, name: str) -> Any:
    """``optimizer.state[param][name]``, an error logged where it is not a tensor.

    Args:
        optimizer: a torch optimizer.
        param: one of its parameters.
        name: the state's name (``"exp_avg"``).
    """
    value = optimizer.state[param][name]
    if not isinstance(value, torch.Tensor):
        LOGGER.error(f"state {name} expected to be a tensor")
    return value


def get_optimizer_param_states(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> tuple[Optional[dict[str, list[torch.Tensor]]], Optional[dict[str, Any]]]:
    """The state of ``params`` as ``({name: [tensor of each parameter]}, {name: scalar})``: a name
    whose values are tensors (for some parameter) gives a list, one whose values are not (a Python
    number) gives its one value; ``(None, None)``, with an error logged, where a parameter lacks a
    name another has or the scalars differ between parameters (Bagua compared them against a value
    it never set, so it let differing scalars through).

    Args:
        optimizer: a torch optimizer.
        params: some of its parameters.
    """
    states = [optimizer.state[p] for p in params]
    tensor_names = sorted({k for s in states for k, v in s.items() if isinstance(v, torch.Tensor)})
    scalar_names = sorted({k for s in states for k, v in s.items() if not isinstance(v, torch.Tensor)})
    for name in tensor_names + scalar_names:
        if any(name not in s for s in states):
            LOGGER.error(f"Unexpected parameter state {name}, failed not fuse optimizer.")
            return None, None
    scalars = {}
    for name in scalar_names:
        values = [s[name] for s in states]
        if any(v != values[0] for v in values):
            LOGGER.error(f"Parameter state '{name}' does not match, failed not fuse optimizer.")
            return None, None
        scalars[name] = values[0]
    return {name: [s[name] for s in states] for name in tensor_names}, scalars


def infer_state_tensors(
    optimizer: torch.optim.Optimizer, fused_param: torch.Tensor, original_params: Sequence[torch.Tensor], name: str
) -> Optional[list[torch.Tensor]]:
    """The state ``name`` of a flat parameter (``fused_param``, its members ``original_params``
    back to back) cut into views shaped like each member's own state ``name`` (or, where a member
    has none, like the member); ``None``, with a warning logged, where the dtypes or the total
    size do not fit.

    Args:
        optimizer: the optimizer holding the flat parameter's state.
        fused_param: the flat parameter.
        original_params: its members, in order.
        name: the state's name.
    """
    fused_state = get_tensor_state(optimizer, fused_param, name)
    likes = [get_tensor_state(optimizer, p, name) if name in optimizer.state[p] else p for p in original_params]
    if any(like.dtype != fused_state.dtype for like in likes):
        LOGGER.warning(
            "Fused optimizer failed to recover original parameter state, due to ambiguous parameter state datatype."
        )
        return None
    if sum(like.numel() for like in likes) != fused_state.numel():
        LOGGER.warning(
            "Fused optimizer failed to recover original parameter state, due to ambiguous parameter state size."
        )
        return None
    views, offset = [], 0
    for like in likes:
        views.append(fused_state.narrow(0, offset, like.numel()).view(like.shape))
        offset += like.numel()
    return views


def sync_param_group_scalars(src_group: dict, dst_group: dict) -> None:
    """``dst_group`` given ``src_group``'s settings: every entry but ``"params"`` copied, and the
    entries ``src_group`` lacks set to ``None``.

    Args:
        src_group: a param group.
        dst_group: the param group to change.
    """
    for key, value in src_group.items():
        if key != "params":
            dst_group[key] = value
    for key in dst_group:
        if key not in src_group:
            dst_group[key] = None


def make_optimizer_instance(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over the same parameters, with param groups of its own (the same
    settings) and no state (Bagua's helper).

    Args:
        optimizer: a torch optimizer.
    """
    new = copy.copy(optimizer)
    new.param_groups = []
    for group in optimizer.param_groups:
        new.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": list(group["params"])})
    new.state = defaultdict(dict)
    return new


def _no_second_optimizer(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"{name}: this layer's fused optimizer keeps no second, flat optimizer for {name} to act on "
        "(module docstring); call fuse_step(optimizer) (or optimizer.fuse_step()), which does the whole fused step"
    )


def do_fuse(optimizer: torch.optim.Optimizer) -> None:
    """Bagua's step that built the second optimizer's flat parameters (a NotImplementedError:
    module docstring).

    Args:
        optimizer: a fused optimizer.
    """
    raise _no_second_optimizer("do_fuse")


def sync_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Bagua's step that wrote the second optimizer's state back (a NotImplementedError: module
    docstring).

    Args:
        optimizer: a fused optimizer.
    """
    raise _no_second_optimizer("sync_optimizer_state")


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Bagua's check of the attributes cloned into the second optimizer (a NotImplementedError:
    module docstring).

    Args:
        optimizer: a fused optimizer.
    """
    raise _no_second_optimizer("check_optimizer")
