"""The process group a distributed transform talks to, and the checks made before any collective.

Every transform of :mod:`functional_bagua.distributed` resolves its group here (``None``: the
default group of ``torch.distributed.init_process_group``, which torchrun sets up) and checks at
``init`` (:class:`Agreement`) that all ranks built it with the same settings and hold the same
parameters (names, shapes, dtypes; values too where replicas must stay equal): a mismatch found
there is the same ValueError on every rank, where found later it would be a hang, an abort inside
gloo or silently wrong math.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from functional_bagua import tree
from functional_bagua.flat import FlatLayout
from functional_bagua.tree import PyTree

if dist.is_available():
    # torch.distributed.nn.functional's functions take ``group=group.WORLD`` as a default argument,
    # so whichever process group exists when that module is first imported stays referenced for
    # the life of the process. torch imports it lazily with torch._dynamo (the first torch.func
    # or torch.compile call), typically after init_process_group: destroy_process_group() then
    # leaves gloo's worker threads running, and one that releases a tensor while the interpreter
    # shuts down aborts the process ("terminate called without an active exception"). Imported
    # here, before any process group exists, the defaults are None.
    import torch.distributed.nn.functional  # noqa: F401


class Group(NamedTuple):
    """A process group with its size and this process's rank in it."""

    group: Any
    world_size: int
    rank: int


def resolve(group: Optional[dist.ProcessGroup], who: str) -> Group:
    """``group`` (or the default group) with its size and rank; a RuntimeError naming ``who`` if
    torch.distributed has no process group yet.

    Args:
        group: a ``torch.distributed`` process group, or ``None`` for the default group.
        who: the caller's name, which starts the error message.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "first (launch with torchrun, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)"
        )
    group = dist.group.WORLD if group is None else group
    return Group(group, dist.get_world_size(group), dist.get_rank(group))


def describe_leaves(params: PyTree) -> list:
    """``(name, shape, dtype, device type)`` of each leaf (``None`` leaves as ``(name, None, None, None)``).

    Args:
        params: a pytree of tensors; names are the leaves' paths, dtypes are strings such as
            ``"float32"`` and device types strings such as ``"cuda"``.
    """
    leaves, spec = tree.flatten(params)
    return [
        (name, None, None, None)
        if p is None
        else (name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.device.type)
        for name, p in zip(tree.leaf_names(spec), leaves)
    ]


def shapes_of(leaves: list) -> tuple:
    """``(shape, dtype)`` of each tensor leaf (``None`` for a ``None`` leaf): what decides the sizes of
    the messages a collective sends.

    Args:
        leaves: a list of tensors or ``None``.

    Returns:
        A tuple, hashable and comparable with ``==``.
    """
    return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in leaves)


class Agreement:
    """What every rank agreed on at ``init`` (one transform instance's view), so that ``update``
    can hold its input to it before any collective.

    ``init`` gathers from every rank the transform's name, its settings (``settings``: name ->
    value, e.g. ``{"compression": "fp16", "average": True}``) and the names, shapes and dtypes
    of the parameters, and, with ``same_values``, checks that every rank's parameter values
    equal rank 0's (one broadcast). Any difference raises the same ValueError on every rank, naming
    the rank and what differs. A difference found only inside a collective would instead abort
    a rank inside gloo, hang until the process-group timeout, or silently reduce mismatched data.

    ``update`` then calls :meth:`check` on the tensors it is about to send: if their shapes
    and dtypes are not those of a parameter tree checked at ``init``, this rank raises before
    sending anything (the other ranks then fail as soon as it exits, as with any dead rank).

    Args:
        who: the transform's name, compared across ranks and used in the messages.
        settings: the transform's settings, ``{name: value}``, compared across ranks (the values must
            be picklable and comparable with ``==``).
        same_values: also check at ``init`` that every rank's parameter values equal rank 0's.
    """

    def __init__(self, who: str, settings: dict, same_values: bool = False) -> None:
        self.who, self.settings, self.same_values = who, dict(settings), same_values
        self._checked: list = []  # shapes_of the parameter trees init checked

    def agree_on_chain(self, hyperparameters: dict, group: Optional[dist.ProcessGroup]) -> None:
        """Raise the same ValueError on every rank of ``group`` (a transform's ``group`` argument,
        resolved now) unless all built the chain around this transform with the same
        ``hyperparameters`` (``{where: value}``, as :func:`functional_bagua.base.hyperparameters_of`
        describes a chain; ``chain.init`` calls this after the transform's own ``init``, on every
        rank at the same point)."""
        check_same_everywhere({}, resolve(group, self.who), f"the chain around {self.who}", hyperparameters)

    def init(self, params: PyTree, group: Group) -> None:
        """Check across the ranks of ``group`` (class docstring) and remember the shapes and dtypes
        of ``params`` for :meth:`check`. Every rank must call it at the same point.

        Args:
            params: this rank's parameter tree.
            group: the resolved process group (:func:`resolve`).

        Raises:
            ValueError: the same on every rank, when the ranks differ.
        """
        check_same_everywhere(params, group, self.who, self.settings)
        if self.same_values:
            check_same_values(params, group, self.who)
        shapes = shapes_of(tree.flatten(params)[0])
        if shapes not in self._checked:
            self._checked.append(shapes)

    def check(self, leaves: list) -> None:
        """Raise unless ``leaves`` (the tensors about to be sent, one per parameter, in order) have
        the shapes and dtypes of a parameter tree ``init`` checked across ranks.

        Args:
            leaves: a list of the tensors about to be sent (or ``None``), in parameter order.

        Raises:
            RuntimeError: when ``init`` was never called.
            ValueError: when the shapes or dtypes are not those of a tree ``init`` checked.
        """
        shapes = shapes_of(leaves)
        if shapes in self._checked:
            return
        if not self._checked:
            raise RuntimeError(f"{self.who}: update before init; call state = tx.init(params) on every rank first")
        raise ValueError(
            f"{self.who}: this rank's update holds {_describe_shapes(shapes)}, but init checked "
            f"{_describe_shapes(self._checked[-1])} on every rank; every rank must update the parameters "
            "it passed to init (sending other sizes would hang or abort the other ranks)"
        )


def _describe_shapes(shapes: tuple) -> str:
    shown = ", ".join("None" if s is None else f"{s[0]} {str(s[1]).removeprefix('torch.')}" for s in shapes[:6])
    return f"{len(shapes)} tensors [{shown}{', ...' if len(shapes) > 6 else ''}]"


def check_same_everywhere(params: PyTree, group: Group, who: str, settings: dict) -> None:
    """Raise the same ValueError on every rank unless all ranks of ``group`` run ``who`` with the
    same ``settings`` on parameters of the same names, shapes and dtypes (one ``all_gather_object``).

    Args:
        params: this rank's parameter tree.
        group: the resolved process group.
        who: the transform's name, compared across ranks and used in the messages.
        settings: the transform's settings, ``{name: value}``, compared across ranks.
    """
    everyone: list = [None] * group.world_size
    mine = (who, sorted(settings.items(), key=lambda kv: kv[0]), describe_leaves(params))
    dist.all_gather_object(everyone, mine, group=group.group)
    reference_who, reference_settings, reference = everyone[0]
    for rank, (their_who, their_settings, theirs) in enumerate(everyone[1:], start=1):
        if their_who != reference_who:
            raise ValueError(  # named after rank 0's transform, so that every rank raises the same message
                f"{reference_who}: ranks initialise different transforms at the same point: rank 0 runs {reference_who}, "
                f"rank {rank} runs {their_who}; every rank must build the same chain"
            )
        if their_settings != reference_settings:
            ref, theirs_ = dict(reference_settings), dict(their_settings)
            absent = "(none)"
            differ = [
                f"{k}={ref.get(k, absent)!r} on rank 0, {theirs_.get(k, absent)!r} on rank {rank}"
                for k in sorted(set(ref) | set(theirs_))
                if ref.get(k, absent) != theirs_.get(k, absent)
            ]
            raise ValueError(
                f"{who}: ranks were built with different settings: {'; '.join(differ)}. Every rank must build "
                "the transform with the same arguments"
            )
        if theirs != reference:
            raise ValueError(f"{who}: parameters differ across ranks: {_first_difference(reference, theirs, rank)}")


def check_same_values(params: PyTree, group: Group, who: str) -> None:
    """Raise the same ValueError on every rank unless every rank's parameter values equal rank
    0's, bit for bit: rank 0's values are broadcast once per (dtype, device) buffer, each rank
    compares, and the names of the differing parameters are gathered (DDP broadcasts rank 0's
    values at construction instead; a pure ``init`` cannot change the caller's parameters).

    Args:
        params: this rank's parameter tree (``None`` leaves are skipped); not changed.
        group: the resolved process group.
        who: the transform's name, which starts the message.
    """
    leaves, spec = tree.flatten(params)
    present = {name: p for name, p in zip(tree.leaf_names(spec), leaves) if p is not None}
    differ = []
    if present:
        layout = FlatLayout.of(present)
        mine = layout.flatten(present)
        for key, buffer in mine.items():
            theirs = buffer.clone()
            dist.broadcast(theirs, group_src(group, 0), group=group.group)
            for seg in layout.segments(key):
                if not _same_bits(seg.of(buffer), seg.of(theirs)):
                    differ.append(seg.name)
    everyone = [None] * group.world_size
    dist.all_gather_object(everyone, differ, group=group.group)
    for rank, names in enumerate(everyone):
        if names:
            raise ValueError(
                f"{who}: parameter values differ across ranks: rank {rank}'s {_some(names)} differ from rank 0's. "
                "Data-parallel replicas must start equal: seed the model the same way on every rank, or use "
                "functional_bagua.distributed.broadcast_params(params) (rank 0's values) before init"
            )


def broadcast_params(params: PyTree, group: Optional[dist.ProcessGroup] = None) -> PyTree:
    """Rank 0's parameter values on every rank (a new tree; ``params`` are not changed), as DDP
    broadcasts them at construction: for replicas seeded differently. One broadcast per (dtype,
    device) buffer. Example::

        params = fbd.broadcast_params(fb.params_of(model))
        state = tx.init(params)

    Args:
        params: this rank's parameter tree (``None`` leaves stay ``None``); every rank must call
            this with a tree of the same structure, shapes and dtypes.
        group: the process group; ``None`` for the default group. Rank 0 of this group sends.
    """
    g = resolve(group, "broadcast_params")
    leaves, spec = tree.flatten(params)
    present = {i: p for i, p in enumerate(leaves) if p is not None}
    if not present:
        return params
    layout = FlatLayout.of(list(present.values()))
    buffers = layout.flatten(list(present.values()))
    for buffer in buffers.values():
        dist.broadcast(buffer, group_src(g, 0), group=g.group)
    new_leaves = list(leaves)
    for i, value in zip(present, layout.unflatten(buffers)):
        new_leaves[i] = value
    return spec.unflatten(new_leaves)


def group_src(group: Group, rank_in_group: int) -> int:
    """The global rank of ``rank_in_group`` (``dist.broadcast``'s ``src`` is a global rank).

    Args:
        group: the resolved process group.
        rank_in_group: a rank within ``group``.
    """
    if group.group is None or group.group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group.group, rank_in_group)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
        a, b = a.view(as_int), b.view(as_int)
    return torch.equal(a, b)


def _some(names: list, limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _first_difference(reference: list, theirs: list, rank: int) -> str:
    for mine, other in zip(reference, theirs):
        if mine != other:
            return f"rank 0 has {_leaf(mine)}, rank {rank} has {_leaf(other)}"
    return f"rank 0 has {len(reference)} tensors, rank {rank} has {len(theirs)}"


def _leaf(desc: tuple) -> str:
    name, shape, dtype, device = desc
    return f"{name!r} with no tensor" if shape is None else f"{name!r} of shape {shape} {dtype} on {device}"
