"""Clipping updates.

- ``clip(max_delta)``: ``u = clamp(g, -max_delta, max_delta)`` elementwise.
- ``clip_by_global_norm(max_norm)``: with ``n = ||(||g_1||, ..., ||g_k||)||`` the norm of all
  gradients together, ``u = g * min(1, max_norm / (n + 1e-6))`` — exactly
  ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import torch

from functional_bagua import fusion, tree
from functional_bagua.base import EmptyState, GradientTransformation
from functional_bagua.transforms.leafwise import stateless


def clip(max_delta: float) -> GradientTransformation:
    """``u = clamp(g, -max_delta, max_delta)``."""
    return stateless(lambda u, p: u.clamp(-max_delta, max_delta), name="clip")


def global_norm(updates, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all leaves together (``None`` leaves left out), as clip_grad_norm_ computes it."""
    leaves = [u for u in tree.flatten(updates)[0] if u is not None]
    norms = [torch.linalg.vector_norm(u, norm_type) for u in leaves]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (global_norm + 1e-6))`` (module docstring)."""

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        fusion.refuse_on_shards("clip_by_global_norm", "the norm of one shard is not the global norm")
        total = global_norm(updates, norm_type)
        factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
        return tree.tree_map(lambda u: None if u is None else u * factor.to(u.dtype), updates), state

    return GradientTransformation(init, update)
