"""Per-segment norms and scales over a flat buffer: one op each, whatever the number of segments.

A flat buffer (:mod:`functional_bagua.flat`) holds many tensors back to back. Rules that are per
tensor, like LAMB's and LARS's trust ratio, need each tensor's norm and then scale each tensor by
its own factor. Written as a Python loop over the segments, that costs one kernel per tensor in
eager mode and one generated kernel per tensor under ``torch.compile`` (minutes of compile time for
hundreds of tensors). The two ops here take the segment lengths instead::

    norms(x, lengths)[i]     = ||x_i||_2               x_i: the i-th segment of x (lengths[i] elements)
    scale(x, factors, lengths) = concat_i(factors[i] * x_i)

Both run on torch's multi-tensor (foreach) kernels, and each is a ``torch.library`` custom op, so
``torch.compile`` sees one opaque node instead of one loop iteration per segment: compile time does
not grow with the number of tensors. ``norms`` gives the same numbers as ``x_i.norm()`` per segment.

Example::

    x = torch.arange(5.0)                  # segments [0, 1] and [2, 3, 4]
    segments.norms(x, [2, 3])              # tensor([1.0000, 5.3852])
    segments.scale(x, torch.tensor([2.0, -1.0]), [2, 3])   # tensor([0., 2., -2., -3., -4.])
"""

from __future__ import annotations

from typing import Sequence

import torch

from functional_bagua import layout_context


@torch.library.custom_op("functional_bagua::segment_norms", mutates_args=())
def _segment_norms(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(x.split(lengths)))


@_segment_norms.register_fake
def _(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return x.new_empty(len(lengths))


@torch.library.custom_op("functional_bagua::segment_scale", mutates_args=())
def _segment_scale(x: torch.Tensor, factors: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out = x.clone()
    torch._foreach_mul_(out.split(lengths), list(factors.to(x.dtype).unbind()))
    return out


@_segment_scale.register_fake
def _(x: torch.Tensor, factors: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.empty_like(x)


def _checked(x: torch.Tensor, lengths: Sequence[int]) -> list[int]:
    lengths = [int(n) for n in lengths]
    if x.dim() != 1 or sum(lengths) != x.numel():
        raise ValueError(
            f"segments: expected a 1-D buffer of {sum(lengths)} elements (the sum of the lengths), "
            f"got shape {tuple(x.shape)}"
        )
    return lengths


def norms(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """The 2-norm of each segment of the 1-D buffer ``x``, as a tensor of ``len(lengths)``, in ``x``'s dtype."""
    return _segment_norms(x, _checked(x, lengths))


def norms_of_whole_tensors(key: str, lengths: Sequence[int], *xs: torch.Tensor) -> list[torch.Tensor]:
    """:func:`norms` of each of ``xs`` (buffers laid out as the flat buffer ``key`` of the fused
    update running now): where that buffer holds DTensors' local shards, the norms of the whole
    tensors, ``sqrt`` of this rank's squared norms summed across the ranks (one all-reduce for
    all of ``xs``, :func:`~functional_bagua.layout_context.summed_across_shards`).

    Args:
        key: the flat buffer's group key.
        lengths: the number of elements of each segment here.
        *xs: 1-D buffers of ``sum(lengths)`` elements.
    """
    local = [norms(x, lengths) for x in xs]
    if not layout_context.on_local_shards():
        return local
    return list(layout_context.summed_across_shards(key, torch.stack(local).square()).sqrt().unbind())


def scale(x: torch.Tensor, factors: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """``x`` with its ``i``-th segment multiplied by ``factors[i]`` (a new buffer, ``x``'s dtype)."""
    lengths = _checked(x, lengths)
    if factors.shape != (len(lengths),):
        raise ValueError(
            f"segments.scale: need one factor per segment ({len(lengths)}), got shape {tuple(factors.shape)}"
        )
    return _segment_scale(x, factors, lengths)
