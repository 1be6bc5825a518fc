"""Clipping updates.

- ``clip(max_delta)``: ``u = clamp(g, -max_delta, max_delta)`` elementwise.
- ``clip_by_global_norm(max_norm)``: with ``n = ||(||g_1||, ..., ||g_k||)||`` the norm of all
  gradients together, ``u = g * min(1, max_norm / (n + 1e-6))`` — exactly
  ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from functional_bagua import layout_context, tree
from functional_bagua.base import EmptyState, GradientTransformation
from functional_bagua.hyperparams import checkable
from functional_bagua.transforms.leafwise import stateless
from functional_bagua.tree import PyTree


def clip(max_delta: float) -> GradientTransformation:
    """``u = clamp(g, -max_delta, max_delta)``; ``max_delta >= 0``.

    Args:
        max_delta: the largest magnitude an update element may have; a number (or 0-dim tensor)
            >= 0, else a ValueError.

    Returns:
        A stateless GradientTransformation.

    Example::

        tx = fb.chain(fb.clip(1.0), fb.adam(1e-3))
    """
    _check_threshold(max_delta, "clip", "max_delta")
    return stateless(lambda u, p: u.clamp(-max_delta, max_delta), name="clip")


def global_norm(updates: PyTree, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all leaves together (``None`` leaves left out; 0 when there are none), as
    ``clip_grad_norm_`` computes it: one norm per tensor, in its dtype (the tensors grouped by device
    and dtype), then the norm of those.

    Args:
        updates: a tree of tensors (gradients or updates); ``None`` leaves are skipped.
        norm_type: the order of the vector norms (``2.0`` Euclidean, ``float("inf")`` the largest
            magnitude), used for both the per-tensor norms and their norm.

    Returns:
        A 0-dim tensor.
    """
    leaves = [u for u in tree.flatten(updates)[0] if u is not None]
    if not leaves:
        return torch.zeros(())
    groups: dict = {}  # by device and dtype, in order of appearance, as clip_grad_norm_ groups them
    for u in leaves:
        groups.setdefault((u.device, u.dtype), []).append(u)
    # torch's multi-tensor norm, as clip_grad_norm_ runs it on CUDA (on the CPU it is one
    # vector_norm per tensor): the same reduction kernel, so the same bits
    norms = [n for group in groups.values() for n in torch._foreach_norm(group, norm_type)]
    return torch.linalg.vector_norm(torch.stack([n.to(leaves[0].device) for n in norms]), norm_type)


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (global_norm + 1e-6))`` (module docstring).

    The factor is applied as torch does, in each update's own precision with a single rounding
    (a bfloat16 update is not multiplied by a factor rounded to bfloat16 first). With no update
    at all (every gradient ``None``) nothing changes, as ``clip_grad_norm_`` returns 0.

    Args:
        max_norm: the largest global norm the updates may have; a number (or 0-dim tensor) >= 0,
            else a ValueError.
        norm_type: the order of the norm, as in :func:`global_norm`.

    Returns:
        A stateless GradientTransformation. It refuses to run inside ``distributed.shard`` and
        ``shard_by_tensor`` (put it before them); fused over DTensors' local shards (an FSDP2
        model's) it takes the global norm across the ranks (``norm_across_shards``; finite
        ``norm_type`` only).

    Example::

        tx = fb.chain(fb.clip_by_global_norm(1.0), fb.adamw(1e-3))
    """
    _check_threshold(max_norm, "clip_by_global_norm", "max_norm")

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: Optional[PyTree] = None) -> tuple[PyTree, EmptyState]:
        on_local_shards = layout_context.on_local_shards() and math.isfinite(norm_type)
        if not on_local_shards:
            layout_context.refuse_on_shards("clip_by_global_norm", "the norm of one shard is not the global norm")
        if all(u is None for u in tree.flatten(updates)[0]):
            return updates, state
        total = norm_across_shards(updates, norm_type) if on_local_shards else global_norm(updates, norm_type)
        factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
        return tree.tree_map(lambda u: None if u is None else _scaled(u, factor), updates), state

    return GradientTransformation(init, update)


def norm_across_shards(buffers: dict, norm_type: float) -> torch.Tensor:
    """The global ``norm_type``-norm of the flat buffers of a fused update over DTensors' local
    shards: per buffer this rank's ``sum(|u|^p)``, added up across the ranks holding the other
    parts (one all-reduce per buffer, :func:`~functional_bagua.layout_context.summed_across_shards`),
    then ``(sum over the buffers)^(1/p)``."""
    sums = [
        layout_context.summed_across_shards(key, torch.linalg.vector_norm(u, norm_type).pow(norm_type).reshape(1))
        for key, u in buffers.items()
        if u is not None
    ]
    return torch.cat([s.to(sums[0].dtype) for s in sums]).sum().pow(1.0 / norm_type)


def _scaled(u: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``u * factor`` in ``u``'s dtype: a 0-dim factor of a wider dtype does not promote ``u``, and
    the product is rounded once (as ``torch._foreach_mul_`` in clip_grad_norm_ does; a 0-dim ``u``
    multiplies in the factor's wider dtype, then rounds to its own)."""
    return (u * factor).to(u.dtype)


def _check_threshold(value: object, who: str, name: str) -> None:
    """A clip threshold: a number (or 0-dim tensor) that is not NaN and not negative."""
    number = checkable(value)
    if number is not None and not number >= 0:
        raise ValueError(f"{who}: {name} must be a number >= 0, got {value!r}")
