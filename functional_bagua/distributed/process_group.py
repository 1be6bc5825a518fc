"""The process group a distributed transform talks to, and the checks made before any collective.

Every transform of :mod:`functional_bagua.distributed` resolves its group here (``None``: the
default group of ``torch.distributed.init_process_group``, which torchrun sets up) and checks at
``init`` that all ranks hold the same parameters (names, shapes, dtypes): a mismatch found there
is a ValueError on every rank, where found later it would be a hang or silently wrong math.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist

from functional_bagua import tree

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


def resolve(group, who: str) -> Group:
    """``group`` (or the default group) with its size and rank; a RuntimeError naming ``who`` if
    torch.distributed has no process group yet."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "first (launch with torchrun, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)"
        )
    group = dist.group.WORLD if group is None else group
    return Group(group, dist.get_world_size(group), dist.get_rank(group))


def describe_leaves(params) -> list:
    """``(name, shape, dtype)`` of each leaf (``None`` leaves as ``(name, None, None)``)."""
    leaves, spec = tree.flatten(params)
    return [
        (name, None, None) if p is None else (name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for name, p in zip(tree.leaf_names(spec), leaves)
    ]


def check_same_params(params, group: Group, who: str) -> None:
    """Raise a ValueError on every rank unless all ranks of ``group`` hold parameters of the same
    names, shapes and dtypes (one ``all_gather_object``)."""
    everyone = [None] * group.world_size
    dist.all_gather_object(everyone, describe_leaves(params), group=group.group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs != reference:
            raise ValueError(f"{who}: parameters differ across ranks: {_first_difference(reference, theirs, rank)}")


def _first_difference(reference: list, theirs: list, rank: int) -> str:
    for mine, other in zip(reference, theirs):
        if mine != other:
            return f"rank 0 has {_leaf(mine)}, rank {rank} has {_leaf(other)}"
    return f"rank 0 has {len(reference)} tensors, rank {rank} has {len(theirs)}"


def _leaf(desc: tuple) -> str:
    name, shape, dtype = desc
    return f"{name!r} with no tensor" if shape is None else f"{name!r} of shape {shape} {dtype}"
