"""Bagua's ``bagua.torch_api.utils`` helpers that training scripts and tests call: tensors to one
flat buffer and back (:func:`functional_bagua.flat.split_like` does the cutting)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from functional_bagua.flat import split_like

__all__ = ["flatten", "unflatten", "apply_flattened_call"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors copied back to back into one new 1-D tensor.

    Args:
        tensors: dense tensors of one dtype and device.
    """
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten`).

    Args:
        flat: a 1-D tensor of as many elements as ``tensors`` hold.
        tensors: the tensors whose shapes the views take.
    """
    return split_like(flat, tensors)


def apply_flattened_call(
    bucket: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Optional[Sequence[Any]] = None
) -> None:
    """``call(flat, *extra_args)`` on the tensors of ``bucket`` as one flat tensor, then the result
    copied back into each tensor (e.g. an in-place collective on many tensors at once).

    Args:
        bucket: dense tensors of one dtype and device, changed in place.
        call: a function that changes its first argument in place.
        extra_args: more arguments for ``call``.
    """
    flat = flatten(bucket)
    call(flat, *(extra_args or ()))
    with torch.no_grad():
        for tensor, value in zip(bucket, unflatten(flat, bucket)):
            tensor.copy_(value)
