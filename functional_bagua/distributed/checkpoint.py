"""Optimizer state for torch.distributed.checkpoint (DCP), sharded state included.

:func:`~functional_bagua.state_dict` names each tensor of a state by its place; on several ranks
the state of :func:`~functional_bagua.distributed.shard` holds only this rank's piece of each flat
buffer. :func:`distributed_state_dict` gives the same keys with every such piece as a
``DTensor`` of the whole buffer (``Shard(0)`` on the group's ranks: rank ``r`` holds elements
``[r * c, min((r + 1) * c, n))`` with ``c = ceil(n / world_size)``, exactly the piece ``shard``
keeps), so DCP saves each buffer once, as a whole, and loads it into any number of ranks. The
values are views of the state's tensors, so ``dcp.load`` writes straight into the state::

    dcp.save({"params": params, "opt": fbd.distributed_state_dict(state, params)}, checkpoint_id=path)

    state = tx.init(params)                                          # on the ranks that resume
    dcp.load({"params": params, "opt": fbd.distributed_state_dict(state, params)}, checkpoint_id=path)

Every other tensor of the state is the same on every rank (replicated) and saved once. A shard's
``rank`` and ``world_size`` are left out: they describe where the state lives, not what it
learned, and the resuming ranks keep their own.

A fused state over DTensors' local shards (``fb.fuse`` over an FSDP2 model's parameters, whose
buffers are keyed like ``"float32@cpu:shard0"``) is saved per parameter: each buffer's piece of
a parameter becomes a ``DTensor`` of that parameter's shape and placement (key
``".../float32@cpu:shard0/<parameter name>"``), so DCP saves each parameter's moments once, as
FSDP2 saves the parameter itself, and loads them into any number of ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from functional_bagua import tree
from functional_bagua.checkpoint import _escaped, _keyed_leaves, _must_match
from functional_bagua.distributed.process_group import resolve
from functional_bagua.distributed.sharding import ShardState
from functional_bagua.distributed.whole_tensors import OnOwnersState
from functional_bagua.flat import FlatLayout
from functional_bagua.tree import PyTree

if TYPE_CHECKING:  # imported where used: DTensor costs every process that imports this module
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

NAME = "distributed_state_dict"


def distributed_state_dict(
    state: Any, params: PyTree, group: Optional[dist.ProcessGroup] = None
) -> dict[str, torch.Tensor]:
    """``fb.state_dict(state)`` for DCP: each piece a :func:`~functional_bagua.distributed.shard`
    state keeps as a ``DTensor`` of its whole flat buffer (module docstring).

    Args:
        state: an optimizer state on this rank (``tx.init`` or ``tx.update``).
        params: the parameter tree ``tx`` was initialized with (it gives each flat buffer's length).
        group: the process group the shards are spread over; ``None`` for the default group.

    Returns:
        ``{key: tensor}``: views of the state's tensors (DTensors for the shards), so that
        ``torch.distributed.checkpoint.load`` into it restores ``state`` in place.
    """
    from torch.distributed.device_mesh import DeviceMesh

    g = resolve(group, NAME)
    layout = FlatLayout.of(params)
    lengths = {key: grp.numel for key, grp in layout.groups.items()}
    by_name = dict(zip(tree.leaf_names(layout.spec), tree.flatten(params)[0]))
    of_shards = {key for key, grp in layout.groups.items() if grp.placement}  # buffers of DTensors' local shards
    keys, accessors, leaves, _ = _keyed_leaves(state)
    mesh: Optional[DeviceMesh] = None
    out: dict[str, torch.Tensor] = {}
    for key, accessor, leaf in zip(keys, accessors, leaves):
        if leaf is None or _must_match(accessor):
            continue
        if any(getattr(entry, "type", None) is OnOwnersState for entry in accessor):
            raise NotImplementedError(
                f"{NAME}: {key!r} is on_owners' state, which each rank keeps for the whole tensors it owns (the "
                "owners depend on the number of ranks); DCP cannot reshard it. Save it per rank with "
                "torch.save(fb.state_dict(state)) and resume on as many ranks"
            )
        shards = next((e.entry for e in accessor if getattr(e, "entry", None) in of_shards), None)
        if shards is not None and leaf.dim() == 1:  # a buffer of local shards: per parameter
            out.update(_per_parameter(key, leaf, layout, shards, by_name))
            continue
        buffer = _shard_buffer(accessor, lengths)
        if buffer is not None and leaf.dim() == 1:
            if mesh is None:
                mesh = DeviceMesh.from_group(g.group, leaf.device.type)
            leaf = _whole_buffer(leaf, lengths[buffer], g.rank, g.world_size, mesh)
        out[key] = leaf
    return out


def _per_parameter(key: str, buffer: torch.Tensor, layout: FlatLayout, group: str, by_name: dict) -> dict:
    """``buffer`` (laid out as the flat buffer ``group`` of DTensors' local shards) as one
    ``DTensor`` per parameter, each a view of its piece with its parameter's shape and placement
    (``key/<name>``); a buffer of another length raises a ValueError."""
    from torch.distributed.tensor import DTensor

    if buffer.numel() != layout.groups[group].numel:
        raise ValueError(
            f"{NAME}: the state's {key!r} has {buffer.numel()} elements, the parameters' local shards in "
            f"{group!r} {layout.groups[group].numel}; pass the parameters the state was made for"
        )
    out = {}
    for seg in layout.groups[group].segments:
        param = by_name[seg.name]
        out[f"{key}/{_escaped(seg.name)}"] = DTensor.from_local(
            seg.of(buffer),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return out


def _shard_buffer(accessor: Any, lengths: dict[str, int]) -> Optional[str]:
    """The flat buffer a leaf of a shard's ``inner`` state belongs to, else ``None``."""
    inside = False
    for entry in accessor:
        if getattr(entry, "field", None) == "inner" and entry.type is ShardState:
            inside = True
        elif inside and getattr(entry, "entry", None) in lengths:
            return entry.entry
    return None


def _whole_buffer(piece: torch.Tensor, length: int, rank: int, world_size: int, mesh: DeviceMesh) -> DTensor:
    """This rank's padded piece as the DTensor of the ``length``-element buffer (padding left out)."""
    from torch.distributed.tensor import DTensor, Shard

    chunk = piece.numel()
    if chunk * world_size < length:
        raise ValueError(
            f"{NAME}: a shard of {chunk} elements on {world_size} ranks cannot hold a buffer of {length}; "
            "pass the params the state was initialized with"
        )
    valid = max(0, min(chunk, length - rank * chunk))
    return DTensor.from_local(piece[:valid], mesh, [Shard(0)], run_check=False, shape=torch.Size([length]), stride=(1,))
