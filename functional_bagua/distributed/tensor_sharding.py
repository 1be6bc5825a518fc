"""ZeRO by whole tensors: each rank keeps and updates the optimizer state of the tensors it owns.

:func:`~functional_bagua.distributed.shard` cuts the flat buffers into equal pieces, which cuts
tensors apart: only elementwise optimizers run on its pieces. Transforms that need whole tensors
(SOAP, Shampoo, PSGD-Kron's preconditioners; Muon's orthogonalization; LAMB's and LARS's norms;
Adafactor's factored moments) run under :func:`shard_by_tensor` instead: each tensor is owned by
one rank (the largest first, each to the rank holding the fewest bytes so far; a tensor weighs
the bytes of its gradient and of the state ``inner`` keeps for it, found by ``inner.init`` on
the meta device: SOAP's or Shampoo's matrices count), and with ``n`` ranks::

    g[r] = (1/n) * sum_j g_j[r]                    reduce-scatter: rank r gets its tensors' gradients
    u[r], s[r] = inner.update(g[r], s[r], p[r])    the inner optimizer on rank r's whole tensors
    u = all_gather_r u[r]                          every rank gets every update

so ``shard_by_tensor(soap)`` gives the update of ``allreduce_gradients()`` followed by ``soap``
while each rank holds the state of its own tensors only (per-rank state memory about ``1/n`` of
the whole, uneven by at most the largest tensor's). Per flat buffer (dtype and device) there is
one reduce-scatter and one all-gather per step, each of the largest rank's share times ``n``.

``inner`` sees the tensors a rank owns as a flat dict ``{name: tensor}`` (the names of
:func:`~functional_bagua.tree.leaf_names`, which must differ), in the order of the parameter
tree; a rank may own none. Where ``inner`` decides by a parameter's name (a ``partition``
labelled by names), its labels read these names. What needs every tensor refuses to run inside
(``clip_by_global_norm``'s global norm, ``apply_if_finite``'s decision: put them before), and so
does a second-order transform's ``group=`` (the work is already split by tensor). Where
``inner`` raises on one rank, every rank raises (eagerly: the first all-gather carries a flag).

Example (under torchrun)::

    tx = fbd.shard_by_tensor(fb.soap(lr=3e-3))
    state = tx.init(fbd.broadcast_params(fb.params_of(model)))   # state.inner: this rank's tensors
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from functional_bagua import layout_context, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.distributed import collectives
from functional_bagua.distributed.process_group import Agreement, resolve
from functional_bagua.distributed.sharding import ShardState
from functional_bagua.flat import group_key
from functional_bagua.tree import PyTree

NAME = "shard_by_tensor"


class TensorShardState(NamedTuple):
    """``rank`` and ``world_size`` (0-dim int64): whose tensors these are; ``inner``: the inner
    transform's state over this rank's tensors (a ``{name: tensor}`` tree). A checkpoint of
    another rank or world size does not load into it (``fb.load_state_dict`` compares the two
    fields)."""

    @staticmethod
    def must_match_on_load() -> tuple:
        """Where the state lives, as for :class:`~functional_bagua.distributed.ShardState`."""
        return ShardState.must_match_on_load()

    rank: torch.Tensor
    world_size: torch.Tensor
    inner: Any


def owners_by_size(sizes: list[int], world_size: int) -> list[int]:
    """The rank that owns each tensor: the largest first, each to the rank holding the least so
    far (ties to the lowest rank, then to the earlier tensor). The same on every rank: it
    depends on the sizes only.

    Args:
        sizes: each tensor's weight (bytes, elements), in parameter order.
        world_size: the number of ranks.

    Example::

        >>> owners_by_size([10, 40, 30, 20], 2)
        [0, 0, 1, 1]
    """
    loads, owners = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i], loads[owner] = owner, loads[owner] + sizes[i]
    return owners


def weights(inner: GradientTransformation, leaves: list, names: list) -> list[int]:
    """Each tensor's weight: the bytes of its gradient and of the state ``inner.init`` makes for
    it alone, on the meta device (no memory; the gradient's bytes alone where ``inner`` cannot
    be initialized so, e.g. a mask given as a tree of all parameters)."""
    out = []
    for name, leaf in zip(names, leaves):
        own = leaf.numel() * leaf.element_size()
        try:
            state = inner.init({name: torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")})
        except Exception:
            out.append(own)
            continue
        held = [t for t in tree.flatten(state)[0] if isinstance(t, torch.Tensor)]
        out.append(own + sum(t.numel() * t.element_size() for t in held))
    return out


class _Plan(NamedTuple):
    """Where each tensor goes: its name, its owner, and, per flat buffer (dtype and device), the
    tensors of each rank in parameter order and the length every rank's part is padded to."""

    names: list
    owners: list
    keys: list  # per tensor, its buffer's key
    parts: dict  # key -> per rank, the indices of the tensors it owns in that buffer
    length: dict  # key -> the elements of the largest rank's part

    @classmethod
    def of(cls, leaves: list, names: list, world_size: int, sizes: list) -> "_Plan":
        owners = owners_by_size(sizes, world_size)
        keys = [group_key(t.dtype, t.device) for t in leaves]
        parts: dict[str, list] = {}
        for i, key in enumerate(keys):
            parts.setdefault(key, [[] for _ in range(world_size)])[owners[i]].append(i)
        length = {
            key: max(sum(leaves[i].numel() for i in part) for part in per_rank) for key, per_rank in parts.items()
        }
        return cls(names, owners, keys, parts, length)

    def mine(self, leaves: list, rank: int) -> dict:
        """``{name: leaf}`` of the tensors ``rank`` owns, in parameter order."""
        return {self.names[i]: leaves[i] for i in range(len(leaves)) if self.owners[i] == rank}

    def packed(self, key: str, leaves: list, rank: int) -> torch.Tensor:
        """The tensors ``rank`` owns in buffer ``key``, flattened back to back and zero-padded
        to the buffer's part length."""
        length, first = self.length[key], leaves[next(i for p in self.parts[key] for i in p)]
        pieces = [leaves[i].reshape(-1) for i in self.parts[key][rank]]
        filled = sum(p.numel() for p in pieces)
        if filled < length or not pieces:
            pieces.append(first.new_zeros(length - filled))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()

    def unpacked(self, key: str, part: torch.Tensor, shapes: list, rank: int) -> dict:
        """``{index: tensor}`` of the tensors ``rank`` owns in buffer ``key``, cut from ``part``."""
        members = self.parts[key][rank]
        sizes = [math.prod(shapes[i]) for i in members]
        cut = part[: sum(sizes)].split(sizes) if members else ()
        return {i: piece.view(shapes[i]) for i, piece in zip(members, cut)}


def shard_by_tensor(
    inner: GradientTransformation, average: bool = True, group: Optional[dist.ProcessGroup] = None
) -> GradientTransformation:
    """``inner`` on the whole tensors this rank owns (module docstring). ``update`` takes the
    gradient tree without ``None`` leaves (every rank must send every gradient).

    Args:
        inner: any transform (a TypeError if not a ``GradientTransformation``): it runs on whole
            tensors, so per-tensor rules (SOAP, Shampoo, PSGD-Kron, Muon, LAMB) may.
        average: ``True`` for the mean of the gradients over the ranks, ``False`` for the sum.
        group: the process group; ``None`` for the default group.

    Returns:
        A :class:`~functional_bagua.GradientTransformation` whose state is a
        :class:`TensorShardState`.

    Example::

        tx = fbd.shard_by_tensor(fb.shampoo(lr=1e-3))
        state = tx.init(fbd.broadcast_params(fb.params_of(model)))
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"{NAME}: inner is {type(inner).__name__}, not a GradientTransformation")

    agreement = Agreement(NAME, dict(average=average), same_values=True)
    sizes_of: dict[tuple, list] = {}  # the parameters' shapes and dtypes -> each tensor's weight

    def plan_of(leaves: list, names: list, world_size: int) -> _Plan:
        kinds = tuple((tuple(t.shape), t.dtype) for t in leaves)
        if kinds not in sizes_of:
            sizes_of[kinds] = weights(inner, leaves, names)
        return _Plan.of(leaves, names, world_size, sizes_of[kinds])

    def init(params: PyTree) -> TensorShardState:
        g = resolve(group, NAME)
        agreement.init(params, g)
        leaves, spec = tree.flatten(params)
        names = tree.leaf_names(spec)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"{NAME}: the parameters {repeated} share a name (a '/' inside a key, or the keys 0 and '0'); "
                "inner sees this rank's tensors by name: rename them"
            )
        plan = plan_of(leaves, names, g.world_size)
        device = tree.device_of(params)
        return TensorShardState(
            torch.tensor(g.rank, device=device),
            torch.tensor(g.world_size, device=device),
            inner.init(plan.mine(leaves, g.rank)),
        )

    def update(grads: PyTree, state: TensorShardState, params: Optional[PyTree] = None) -> tuple:
        g = resolve(group, NAME)
        leaves, spec = tree.flatten(grads)
        names = tree.leaf_names(spec)
        for name, leaf in zip(names, leaves):
            if leaf is None:
                raise ValueError(f"{NAME}: gradient of {name!r} is None; every rank must send every gradient")
        if not isinstance(state, TensorShardState):
            raise ValueError(
                f"{NAME}: got a state of type {type(state).__name__}, expected TensorShardState; pass the state "
                "this transform's init made"
            )
        agreement.check(leaves)
        plan = plan_of(leaves, names, g.world_size)
        shapes = [tuple(t.shape) for t in leaves]
        mine: dict[int, torch.Tensor] = {}
        for key in plan.parts:
            sent = torch.cat([plan.packed(key, leaves, r) for r in range(g.world_size)])
            summed = collectives.reduce_scatter_single(sent, "sum", 0, g.group)
            mine.update(plan.unpacked(key, summed / g.world_size if average else summed, shapes, g.rank))
        owned_grads = {names[i]: mine[i] for i in sorted(mine)}
        owned_params = None
        if params is not None:
            owned_params = plan.mine(tree.leaves_matching(spec, params, "params", "the gradients"), g.rank)
        failure: Optional[Exception] = None
        try:  # a failure on one rank must still meet the others' all-gathers, then raise on every rank
            owned_updates, inner_state = layout_context.run_on_owned_tensors(
                inner.update, owned_grads, state.inner, owned_params
            )
            own = _owned_updates(owned_updates, plan, leaves, g.rank)
        except Exception as error:
            if torch.compiler.is_compiling():
                raise
            failure, own, inner_state = error, [None] * len(leaves), None
        updates: list = [None] * len(leaves)
        eager = not torch.compiler.is_compiling()
        like = [u if u is not None else leaves[i] for i, u in enumerate(own)]  # this rank's own packed
        for k, key in enumerate(plan.parts):
            part = plan.packed(key, like, g.rank)
            flagged = eager and k == 0  # eagerly, the first all-gather carries whether each rank's inner raised
            if flagged:
                part = torch.cat([part, part.new_full((1,), float(failure is not None))])
            # waited for here: the updates returned are plain tensors (nothing left in flight)
            gathered = collectives.wait_tensor(collectives.all_gather_single(part, 0, g.group))
            rows = gathered.view(g.world_size, plan.length[key] + int(flagged))
            if flagged:
                _raise_if_failed(rows[:, -1], failure, g.rank)
                rows = rows[:, :-1]
            for r in range(g.world_size):
                for i, tensor in plan.unpacked(key, rows[r], shapes, r).items():
                    updates[i] = tensor
        return spec.unflatten(updates), TensorShardState(state.rank, state.world_size, inner_state)

    update.agree_on_chain = functools.partial(agreement.agree_on_chain, group=group)  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


def _owned_updates(owned: Any, plan: _Plan, grads: list, rank: int) -> list:
    """Per tensor, ``inner``'s update where ``rank`` owns it (else ``None``); a ValueError naming
    a tensor whose update lacks, or differs from its gradient in shape or dtype."""
    by_name = owned if isinstance(owned, dict) else {}
    updates: list = [None] * len(grads)
    for i, g in enumerate(grads):
        if plan.owners[i] != rank:
            continue
        u = by_name.get(plan.names[i])
        if not isinstance(u, torch.Tensor) or u.shape != g.shape or u.dtype != g.dtype:
            got = f"{u.dtype} of shape {tuple(u.shape)}" if isinstance(u, torch.Tensor) else repr(u)
            raise ValueError(
                f"{NAME}: inner's update of {plan.names[i]!r} is {got}, where its gradient is {g.dtype} of shape "
                f"{tuple(g.shape)}; inner must return one update per tensor, of its gradient's shape and dtype"
            )
        updates[i] = u
    return updates


def _raise_if_failed(flags: torch.Tensor, failure: Optional[Exception], rank: int) -> None:
    """Raise on every rank where some rank's ``inner`` raised (``flags``: one per rank): this
    rank's own error where it is one of them, else a RuntimeError naming the first."""
    failed = [r for r, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return
    if failure is not None:
        raise failure
    raise RuntimeError(f"{NAME}: inner's update raised on rank {failed[0]} (its own error says why)")
