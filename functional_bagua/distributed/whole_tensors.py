"""Whole tensors from FSDP2's row shards: gather each to an owner rank, compute, send the rows back.

FSDP2 (``fully_shard``) keeps each parameter as a DTensor placed ``Shard(0)``: rank ``s`` holds
rows ``[s c, (s + 1) c)`` of it (``c = ceil(rows / n)``, as ``torch.chunk``; the last ranks may
hold none). A rule that needs the whole matrix (Muon's Newton-Schulz orthogonalization) cannot
run on those rows. Instead of running its matmuls on DTensors (a collective per matmul), each
tensor of a flat buffer gets one owner rank (the costliest first, each to the least loaded rank:
:func:`~functional_bagua.distributed.tensor_sharding.owners_by_size`, weighed by the matmul
cost ``rows * cols * min(rows, cols)``), and per flat buffer::

    whole[t] = all_to_all(rows of t -> owner(t))          one collective for all tensors
    out[t]   = rule(whole[t])                             on the owner only
    rows     = all_to_all(rows of out[t] -> their rank)   one collective for all tensors

so the collectives per step are two per buffer, whatever the number of tensors (none on one
rank), and each rank computes the whole-tensor rule for its own tensors only (about ``1/n`` of
the work, uneven by at most the costliest tensor's).

:class:`OwnerPlan` holds the bookkeeping of one buffer (plain Python numbers, computed once:
compiled steps read them as constants); :func:`~functional_bagua.fuse` uses it for stateless
whole-tensor rules over DTensors' local shards (:class:`~functional_bagua.fusion.LocalShards`).

Example (under torchrun, ``model`` wrapped by ``fully_shard``)::

    layout = fb.FlatLayout.of(dict(model.named_parameters()))   # the local shards' buffers
    tx = fb.fuse(fb.muon(lr=0.02), layout)                       # orthogonalized on the owners
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import optree
import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.distributed.tensor_sharding import owners_by_size


def rows_per_rank(rows: int, world_size: int) -> list[int]:
    """How many rows of a tensor with ``rows`` rows each rank holds under ``Shard(0)`` on
    ``world_size`` ranks (``torch.chunk``'s split: ``ceil(rows / n)`` each, the last ones fewer or none).

    Args:
        rows: the size of the tensor's first dimension.
        world_size: the number of ranks it is sharded over.

    Example::

        >>> rows_per_rank(10, 4)
        [3, 3, 3, 1]
        >>> rows_per_rank(3, 4)
        [1, 1, 1, 0]
    """
    chunk = -(-rows // world_size) if rows else 0
    return [max(0, min(chunk, rows - s * chunk)) for s in range(world_size)]


def matmul_cost(shape: Sequence[int]) -> int:
    """The weight of a tensor when owners are chosen: ``rows * cols * min(rows, cols)`` for a
    matrix (the order of Newton-Schulz's or an eigendecomposition's work), its size otherwise."""
    if len(shape) == 2:
        return shape[0] * shape[1] * min(shape)
    return max(1, math.prod(shape))


class OwnerPlan:
    """Where the rows of each tensor of one flat buffer of ``Shard(0)`` local shards lie, which
    rank owns each tensor, and the two all-to-alls that gather and scatter them (module docstring).

    Args:
        whole_shapes: each tensor's whole shape, in the buffer's order.
        local_shapes: the shape of this rank's shard of each tensor (checked against the
            ``torch.chunk`` split: another sharding raises a ValueError).
        rank: this rank's index in ``group``.
        world_size: the size of ``group``, the ranks the tensors are sharded over.
        group: the process group of those ranks (a mesh dimension's group).
    """

    def __init__(
        self, whole_shapes: Sequence[tuple], local_shapes: Sequence[tuple], rank: int, world_size: int, group: Any
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.whole_shapes = [tuple(shape) for shape in whole_shapes]
        self.row_numel = [math.prod(shape[1:]) for shape in self.whole_shapes]
        self.rows = [rows_per_rank(shape[0] if shape else 1, world_size) for shape in self.whole_shapes]
        for t, (local, whole) in enumerate(zip(local_shapes, self.whole_shapes)):
            expected = (self.rows[t][rank], *whole[1:]) if whole else ()
            if tuple(local) != expected:
                raise ValueError(
                    f"whole tensors from shards: tensor {t} of shape {whole} has a local shard of shape "
                    f"{tuple(local)} on rank {rank}, where Shard(0) over {world_size} ranks (torch.chunk's split) "
                    f"gives {expected}; only that sharding (FSDP2's default) is gathered"
                )
        self.owner = owners_by_size([matmul_cost(shape) for shape in self.whole_shapes], world_size)
        self.owned = [t for t, o in enumerate(self.owner) if o == rank]
        local_sizes = [self.rows[t][rank] * self.row_numel[t] for t in range(len(self.whole_shapes))]
        self.local_offsets = [0, *itertools.accumulate(local_sizes)][:-1]
        self.local_sizes = local_sizes
        self.by_owner = [[t for t, o in enumerate(self.owner) if o == owner] for owner in range(world_size)]
        # gather: this rank sends its rows of owner o's tensors to o, and receives its own tensors' rows
        self.sent_to = [sum(local_sizes[t] for t in self.by_owner[o]) for o in range(world_size)]
        self.received_from = [sum(self.rows[t][s] * self.row_numel[t] for t in self.owned) for s in range(world_size)]

    def gather(self, buffers: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """The whole tensors this rank owns, from each rank's shards: per buffer of ``buffers``
        (laid out alike, of one dtype), the list of this rank's tensors (in buffer order), whole.
        One all-to-all for all the buffers."""
        import torch.distributed._functional_collectives as funcol  # only where there are shards

        k = len(buffers)
        pieces = [
            buffer[self.local_offsets[t] : self.local_offsets[t] + self.local_sizes[t]]
            for o in range(self.world_size)
            for t in self.by_owner[o]
            for buffer in buffers
        ]
        send = torch.cat(pieces) if pieces else buffers[0].new_empty(0)
        received = (
            send
            if self.world_size == 1  # every tensor whole here already
            else funcol.wait_tensor(
                funcol.all_to_all_single(
                    send, [k * n for n in self.received_from], [k * n for n in self.sent_to], self.group
                )
            )
        )
        per_buffer: list[list] = [[[] for _ in self.owned] for _ in buffers]
        offset = 0
        for s in range(self.world_size):  # from rank s: its rows of each tensor of ours, buffer by buffer
            for j, t in enumerate(self.owned):
                size = self.rows[t][s] * self.row_numel[t]
                for b in range(k):
                    per_buffer[b][j].append(received[offset : offset + size])
                    offset += size
        return [
            [torch.cat(parts).view(self.whole_shapes[t]) for parts, t in zip(tensors, self.owned)]
            for tensors in per_buffer
        ]

    def scatter(self, results: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """This rank's new local buffer (laid out as ``like``, in its dtype) from the whole
        ``results`` of the tensors it owns (in buffer order): each rank's rows sent back to it, in
        one all-to-all."""
        import torch.distributed._functional_collectives as funcol

        flat = [result.to(like.dtype).reshape(-1) for result in results]
        pieces = []
        for s in range(self.world_size):  # to rank s: its rows of each of our tensors
            for j, t in enumerate(self.owned):
                start = sum(self.rows[t][:s]) * self.row_numel[t]
                pieces.append(flat[j][start : start + self.rows[t][s] * self.row_numel[t]])
        send = torch.cat(pieces) if pieces else like.new_empty(0)
        received = (
            send
            if self.world_size == 1
            else funcol.wait_tensor(funcol.all_to_all_single(send, self.sent_to, self.received_from, self.group))
        )
        local: list = [None] * len(self.whole_shapes)  # every tensor has an owner: each is filled
        offset = 0
        for o in range(self.world_size):  # from owner o: our rows of its tensors
            for t in self.by_owner[o]:
                local[t] = received[offset : offset + self.local_sizes[t]]
                offset += self.local_sizes[t]
        return torch.cat(local) if local else like.new_empty(0)

    def map(
        self,
        rule: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
        u: torch.Tensor,
        p: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``rule(whole_u, whole_p)`` on each tensor of the buffer ``u`` (and ``p``, gathered
        with it when given), computed by its owner; this rank's rows of the results, as a
        buffer laid out as ``u``.

        Args:
            rule: ``rule(u, p) -> new_u`` on one whole tensor (``p`` is ``None`` without ``p``).
            u: this rank's flat buffer of local shards.
            p: the parameters' buffer laid out as ``u``, or ``None``.
        """
        gathered = self.gather([u] if p is None else [u, p])
        whole_ps = gathered[1] if p is not None else [None] * len(self.owned)
        return self.scatter([rule(whole_u, whole_p) for whole_u, whole_p in zip(gathered[0], whole_ps)], u)


def gatherable(t: Any) -> bool:
    """Whether ``t`` is a DTensor whose whole tensor :func:`map_dtensors` gathers: sharded
    ``Shard(0)`` along one mesh dimension (FSDP2's parameters and gradients), replicated along
    any others."""
    from functional_bagua.flat import is_dtensor, placement_of

    if not is_dtensor(t):
        return False
    kinds = placement_of(t).split("-")
    return kinds.count("shard0") == 1 and all(kind in ("shard0", "replicate") for kind in kinds)


def map_dtensors(
    rule: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
    updates: Sequence[Any],
    params: Sequence[Any],
) -> list[torch.Tensor]:
    """``rule(whole_u, whole_p)`` on each of the DTensors ``updates`` (each :func:`gatherable`),
    computed by its owner rank: per mesh and dtype, the local shards laid out in one buffer, two
    all-to-alls (:class:`OwnerPlan`); the results as DTensors placed as ``updates``.

    Args:
        rule: ``rule(u, p) -> new_u`` on one whole tensor.
        updates: the DTensors to map.
        params: the matching parameters (DTensors placed alike), or ``None`` each, passed to
            ``rule`` gathered too where given.
    """
    from torch.distributed.tensor import DTensor

    out: list[Optional[torch.Tensor]] = [None] * len(updates)
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        groups.setdefault((u.device_mesh, u.placements, u.dtype), []).append(i)
    for (mesh, placements, _), members in groups.items():
        dim = next(d for d, placement in enumerate(placements) if placement.is_shard())
        locals_ = [updates[i].to_local() for i in members]
        plan = OwnerPlan(
            [tuple(updates[i].shape) for i in members],
            [tuple(local.shape) for local in locals_],
            mesh.get_local_rank(dim),
            mesh.size(dim),
            mesh.get_group(dim),
        )
        with_params = all(params[i] is not None for i in members)
        u = torch.cat([local.reshape(-1) for local in locals_])
        p = torch.cat([params[i].to_local().reshape(-1) for i in members]) if with_params else None
        new = plan.map(rule, u, p).split(plan.local_sizes)
        for i, piece, local in zip(members, new, locals_):
            out[i] = DTensor.from_local(
                piece.view(local.shape),
                mesh,
                placements,
                run_check=False,
                shape=updates[i].shape,
                stride=updates[i].stride(),
            )
    return out  # type: ignore[return-value]  # every index filled: each update is in one group


class OnOwnersState(NamedTuple):
    """``rank`` and ``world_size`` (0-dim int64): whose tensors these are; ``inner``: the inner
    transform's state over the whole tensors this rank owns (fused over their own flat
    buffers). A checkpoint of another rank or world size does not load into it."""

    @staticmethod
    def must_match_on_load() -> tuple:
        """Where the state lives, as for :class:`~functional_bagua.distributed.ShardState`."""
        return ("rank", "world_size")

    rank: torch.Tensor
    world_size: torch.Tensor
    inner: Any


def on_owners(inner: GradientTransformation) -> GradientTransformation:
    """``inner`` on whole tensors of FSDP2's row-sharded parameters: per flat buffer of local shards,
    the gradients' and parameters' rows gathered to each tensor's owner rank (one all-to-all),
    ``inner`` run by each rank on the whole tensors it owns (fused over their own flat buffers:
    SOAP's, Shampoo's and PSGD-Kron's batched matrix work, Adafactor's factored moments), the
    updates' rows sent back (one all-to-all)::

        g[t], p[t] = all_to_all(rows of t -> owner(t))           per buffer, both at once
        u[r], s[r] = inner.update(g[r], s[r], p[r])              r: the tensors this rank owns
        rows of u  = all_to_all(rows of u[t] -> their rank)

    Each rank keeps ``inner``'s state for its own tensors only (whole-tensor state, about ``1/n``
    of it). It runs inside ``fb.fuse(..., FlatLayout.of(DTensor parameters))`` on the flat
    buffers (where buffers of whole tensors, plain or replicated beside the shards, are run by
    every rank alike), or on the DTensor parameters themselves (``fb.Optimizer`` on an FSDP2
    model, the update on ``fb.params_of(model)``), whose local shards it lays out in flat buffers
    of its own (a copy of the gradients and parameters each step) and whose updates it gives as
    DTensors; there every leaf must be a row-sharded DTensor with a gradient. It runs eagerly
    (its bookkeeping is not traced by ``torch.compile``: ``make_train_step(..., compile=False)``).
    What needs every tensor refuses inside (``clip_by_global_norm``: put it before, where its
    norm is summed across the shards), as under ``shard_by_tensor``.

    Args:
        inner: the transform to run on whole tensors (a TypeError for anything else).

    Returns:
        A GradientTransformation whose state is an :class:`OnOwnersState`; on anything but
        DTensors sharded by rows or their local shards' flat buffers it raises a ValueError.

    Example (under torchrun, ``model`` wrapped by ``fully_shard``)::

        layout = fb.FlatLayout.of(fb.params_of(model))
        tx = fb.fuse(fbd.on_owners(fb.soap(lr=3e-3)), layout)
    """
    from functional_bagua import layout_context
    from functional_bagua.flat import FlatLayout

    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"on_owners: inner is {type(inner).__name__}, not a GradientTransformation")
    layouts: dict[tuple, FlatLayout] = {}  # the owned tensors' layout, by their names and shapes

    shards_of: dict[tuple, tuple] = {}  # a DTensor tree's layout of its local shards, and their stand-in

    def plans(buffers: dict) -> dict:
        return {key: layout_context.owner_plan_of(key) for key in buffers}

    def over_shards(dtensors: Any) -> tuple:
        """The layout of the local shards of a tree of FSDP2's DTensors and its
        :class:`~functional_bagua.fusion.LocalShards` (made once per tree structure and shapes)."""
        from functional_bagua import tree
        from functional_bagua.fusion import LocalShards

        leaves, spec = tree.flatten(dtensors)
        if any(leaf is None for leaf in optree.tree_leaves(dtensors, none_is_leaf=True)):
            raise ValueError(
                "on_owners: a gradient is None; every parameter it updates needs one each step (an FSDP2 model's "
                "trainable parameters all get one: freeze the others with requires_grad_(False) before fully_shard)"
            )
        if not leaves or not all(gatherable(p) for p in leaves):
            raise ValueError(
                "on_owners runs on DTensors sharded by rows (an FSDP2 model's parameters: fb.Optimizer, or the update "
                "on fb.params_of(model)) or inside fb.fuse(tx, layout) over the local shards of such parameters "
                "(layout = fb.FlatLayout.of(fb.params_of(fsdp2_model))); elsewhere the tensors are whole: use inner itself"
            )
        signature = (spec, tuple((tuple(p.shape), p.dtype, p.device_mesh, p.placements) for p in leaves))
        if signature not in shards_of:
            layout = FlatLayout.of(dtensors)
            shards_of[signature] = (layout, LocalShards(layout))
        return shards_of[signature]

    def owned_whole(buffers: dict, plan_of: dict, *others: dict) -> list[dict]:
        """``{name: whole tensor}`` of the tensors this rank owns, of ``buffers`` and each of ``others``."""
        out: list[dict] = [{} for _ in range(1 + len(others))]
        for key, buffer in buffers.items():
            plan, segments = plan_of[key], layout_context.segment_names_of(key)
            columns = [buffer, *(other[key] for other in others)]
            if plan is None:  # whole tensors here: every rank runs them
                for column, into in zip(columns, out):
                    for name, piece in zip(segments, _split_whole(column, key)):
                        into[name] = piece
                continue
            gathered = plan.gather(columns)
            for column, into in zip(gathered, out):
                for t, whole in zip(plan.owned, column):
                    into[segments[t]] = whole
        return out

    def layout_of(owned: dict) -> FlatLayout:
        signature = tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in owned.items())
        if signature not in layouts:
            layouts[signature] = FlatLayout.of(owned)
        return layouts[signature]

    def run_inner(fn: Callable[..., Any], owned: dict, *args: Any) -> Any:
        from functional_bagua.layout_context import run_on_flat_buffers, run_on_owned_tensors

        sub = layout_of(owned)
        return run_on_owned_tensors(run_on_flat_buffers, sub, fn, *args)

    def eager_only() -> None:
        if torch.compiler.is_compiling():
            raise ValueError(
                "on_owners runs eagerly: torch.compile does not trace its bookkeeping; compile the rest of the "
                "step only (make_train_step(..., compile=False) for an FSDP2 model, whose forward stays eager)"
            )

    def init(params: Any) -> OnOwnersState:
        eager_only()
        if layout_context.on_local_shards():
            return init_flat(params)
        layout, shards = over_shards(params)
        return layout_context.run_on_flat_buffers(shards, init_flat, layout.flatten(params))

    def update(grads: Any, state: OnOwnersState, params: Optional[Any] = None) -> tuple[Any, OnOwnersState]:
        eager_only()
        if layout_context.on_local_shards():
            return update_flat(grads, state, params)
        from torch.distributed.tensor import DTensor  # imported: the leaves are DTensors (over_shards)

        from functional_bagua import tree

        layout, shards = over_shards(grads)
        flat_params = layout.flatten(params) if params is not None else None
        flat, state = layout_context.run_on_flat_buffers(shards, update_flat, layout.flatten(grads), state, flat_params)
        leaves, spec = tree.flatten(grads)
        updates = [
            DTensor.from_local(local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride())
            for local, g in zip(tree.flatten(layout.unflatten(flat))[0], leaves)
        ]
        return spec.unflatten(updates), state

    def init_flat(params: dict) -> OnOwnersState:
        plan_of = plans(params)
        (owned,) = owned_whole(params, plan_of)
        rank, world = _where(plan_of)
        sub = layout_of(owned)
        return OnOwnersState(torch.tensor(rank), torch.tensor(world), run_inner(inner.init, owned, sub.flatten(owned)))

    def update_flat(grads: dict, state: OnOwnersState, params: Optional[dict] = None) -> tuple[dict, OnOwnersState]:
        plan_of = plans(grads)
        owned_grads, *owned_params = owned_whole(grads, plan_of, *([params] if params is not None else []))
        sub = layout_of(owned_grads)
        flat_params = sub.flatten(owned_params[0]) if owned_params else None
        updates, new_inner = run_inner(inner.update, owned_grads, sub.flatten(owned_grads), state.inner, flat_params)
        owned_updates = sub.unflatten(updates)
        out = {}
        for key, g in grads.items():
            plan, segments = plan_of[key], layout_context.segment_names_of(key)
            if plan is None:
                out[key] = torch.cat([owned_updates[name].reshape(-1).to(g.dtype) for name in segments])
            else:
                out[key] = plan.scatter([owned_updates[segments[t]] for t in plan.owned], g)
        return out, state._replace(inner=new_inner)

    return GradientTransformation(init, update)


def _where(plan_of: dict) -> tuple[int, int]:
    """This rank and the world size of the buffers' plans (0 and 1 where none is sharded)."""
    plan = next((plan for plan in plan_of.values() if plan is not None), None)
    return (0, 1) if plan is None else (plan.rank, plan.world_size)


def _split_whole(buffer: torch.Tensor, key: str) -> list:
    """The whole tensors of a buffer of plain or replicated tensors, as views."""
    from functional_bagua import layout_context

    return [seg.of(buffer) for seg in layout_context.segments_of(key) or ()]
