"""ZeRO over the flat buffer: each rank keeps and updates only its shard of the optimizer state.

With ``n`` ranks, every flat buffer (one per dtype and device, :mod:`functional_bagua.flat`) is
zero-padded to a multiple of ``n`` and cut into ``n`` equal shards; rank ``r`` owns shard ``r``::

    g[r] = (1/n) * sum_j g_j[r]                    reduce-scatter of the gradients
    u[r], s[r] = inner.update(g[r], s[r], p[r])    the inner optimizer on the shard only
    u = all_gather_r u[r]                          every rank gets the whole update

so ``shard(adamw)`` gives the update of ``allreduce_gradients()`` followed by ``adamw`` while the
moments of AdamW exist only for the local shard (per-rank state memory ~ 1/n). ``inner`` must be
elementwise (sgd, adam, adamw, lion, ...): a shard cuts tensors apart, so per-tensor rules (LAMB's
trust ratio, Adafactor, Muon) raise instead of computing norms of pieces; they run under
:func:`~functional_bagua.distributed.shard_by_tensor`, which shards by whole tensors.

Example (under torchrun)::

    tx = fbd.shard(fb.adamw(1e-3, weight_decay=0.01))
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, NoReturn, Optional

import torch
import torch.distributed as dist

from functional_bagua import layout_context, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.distributed import collectives
from functional_bagua.distributed.compression import padded_chunks
from functional_bagua.distributed.process_group import Agreement, Group, resolve
from functional_bagua.flat import FlatLayout
from functional_bagua.tree import PyTree

NAME = "shard"


class ShardState(NamedTuple):
    """``rank`` and ``world_size`` (0-dim int64): whose shard this is; ``inner``: the inner
    transform's state over this rank's shards (``{key: shard}`` trees). A checkpoint of another
    rank or world size does not load into it (``fb.load_state_dict`` compares the two fields)."""

    rank: torch.Tensor
    world_size: torch.Tensor
    inner: Any

    @staticmethod
    def must_match_on_load() -> tuple:
        """The fields a checkpoint must agree with, not overwrite (``fb.load_state_dict``)."""
        return ("rank", "world_size")


class _Shards:
    """Stands in for a layout while ``inner`` runs on shards: per-tensor rules ask it for the
    segments of a buffer, and there are none to give."""

    is_shard = True  # transforms that reduce across tensors refuse (layout_context.refuse_on_shards)

    def segments(self, key: str) -> NoReturn:
        raise NotImplementedError(
            f"a per-tensor rule cannot run inside {NAME}(): each rank holds 1/world_size of the flat buffer "
            f"{key!r}, which cuts tensors apart. Shard an elementwise optimizer (sgd, adam, adamw, lion, ...), or "
            "shard this one by whole tensors: fbd.shard_by_tensor(inner)."
        )


def shard(
    inner: GradientTransformation, average: bool = True, group: Optional[dist.ProcessGroup] = None
) -> GradientTransformation:
    """``inner`` on this rank's shard of the flat buffers (module docstring). ``update`` takes the
    gradient tree without ``None`` leaves (every rank must send every gradient).

    Args:
        inner: an elementwise transform (a TypeError if not a ``GradientTransformation``); a
            per-tensor rule inside it raises a NotImplementedError.
        average: ``True`` for the mean of the gradients over the ranks, ``False`` for the sum.
        group: the process group; ``None`` for the default group.

    Returns:
        A :class:`~functional_bagua.GradientTransformation` whose state is a :class:`ShardState`.

    Example::

        tx = fbd.shard(fb.adamw(1e-3))
        state = tx.init(fbd.broadcast_params(fb.params_of(model)))   # state.inner: this rank's shard
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"{NAME}: inner is {type(inner).__name__}, not a GradientTransformation")

    agreement = Agreement(NAME, dict(average=average), same_values=True)

    def local_shards(layout: FlatLayout, values: PyTree, g: Group) -> dict[str, torch.Tensor]:
        return {key: padded_chunks(b, g.world_size)[g.rank] for key, b in layout.flatten(values).items()}

    def init(params: PyTree) -> ShardState:
        g = resolve(group, NAME)
        agreement.init(params, g)
        shards = local_shards(FlatLayout.of(params), params, g)
        device = tree.device_of(params)
        return ShardState(
            torch.tensor(g.rank, device=device),
            torch.tensor(g.world_size, device=device),
            layout_context.run_on_flat_buffers(_Shards(), inner.init, shards),
        )

    def update(grads: PyTree, state: ShardState, params: Optional[PyTree] = None) -> tuple[PyTree, ShardState]:
        g = resolve(group, NAME)
        leaves, spec = tree.flatten(grads)
        for i, leaf in enumerate(leaves):
            if leaf is None:
                raise ValueError(
                    f"{NAME}: gradient of {tree.leaf_names(spec)[i]!r} is None; every rank must send every gradient"
                )
        agreement.check(leaves)
        layout = FlatLayout.of(grads)
        grad_shards = {}
        for key, buffer in layout.flatten(grads).items():
            summed = collectives.reduce_scatter_single(
                padded_chunks(buffer, g.world_size).reshape(-1), "sum", 0, g.group
            )
            grad_shards[key] = summed / g.world_size if average else summed
        param_shards = None if params is None else local_shards(layout, params, g)
        update_shards, inner_state = layout_context.run_on_flat_buffers(
            _Shards(), inner.update, grad_shards, state.inner, param_shards
        )
        full = {
            key: collectives.all_gather_single(u, 0, g.group)[: layout.groups[key].numel]
            for key, u in update_shards.items()
        }
        return layout.unflatten(full), ShardState(state.rank, state.world_size, inner_state)

    update.agree_on_chain = functools.partial(agreement.agree_on_chain, group=group)  # type: ignore[attr-defined]
    return GradientTransformation(init, update)
