"""Tensors that lie back to back in memory, seen as one flat tensor.

A fused optimizer step treats a run of parameters as one parameter. That needs each run's
parameters, gradients and state tensors to be consecutive in one storage. :func:`span` returns
the one flat view over such tensors (no copy); :func:`gather` copies tensors that are scattered
into one flat tensor and returns views of it, which the caller puts back in place of the
originals so that the next step finds them consecutive::

    flat = span(tensors)                         # 1-D view, or None if they are not back to back
    if flat is None:
        flat, views = gather(tensors)            # one copy; tensors[i] == views[i]
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def span(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One 1-D view over ``tensors`` if each is contiguous, all share a dtype, and each starts
    where the previous ends; ``None`` otherwise. The view lives in the first tensor's storage:
    tensors that are merely adjacent in memory but belong to different storages are refused (the
    view would run past the end of the first storage)."""
    first = tensors[0]
    start, itemsize, dtype = first.data_ptr(), first.element_size(), first.dtype
    total = 0
    for t in tensors:
        if t.dtype != dtype or not t.is_contiguous() or t.data_ptr() != start + total * itemsize:
            return None
        total += t.numel()
    try:
        return first.detach().as_strided((total,), (1,), first.storage_offset())
    except RuntimeError:  # past the end of the first tensor's storage: adjacent by accident
        return None


def gather(tensors: Sequence[torch.Tensor]) -> tuple:
    """``(flat, views)``: the tensors copied back to back into a new 1-D tensor, and each
    tensor's view of it (same shape, same values)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return flat, split_like(flat, tensors)


def split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list:
    """Views of ``flat`` shaped like ``tensors``, back to back (the inverse of :func:`span`)."""
    pieces = flat.split([t.numel() for t in tensors])
    return [piece.view(t.shape) for piece, t in zip(pieces, tensors)]
