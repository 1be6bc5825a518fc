"""Bagua's ``bagua.torch_api.utils`` helpers that training scripts and tests call: tensors to one
flat buffer and back (:func:`functional_bagua.flat.split_like` does the cutting), grouped by
tensor type, and the checks around them."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch

from functional_bagua.flat import split_like

__all__ = ["flatten", "unflatten", "apply_flattened_call"]

LOGGER = logging.getLogger(__name__)

# Bagua's names of the dtypes its communication backend takes
_BAGUA_DATATYPES = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.int64: "i64"}


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


def _group_by_tensor_type(tensors: Sequence[torch.Tensor]) -> "OrderedDict[str, list[torch.Tensor]]":
    """The tensors by ``tensor.type()`` (dtype and device, e.g. ``"torch.FloatTensor"``), in the
    order each type first appears (Bagua's helper)."""
    groups: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for tensor in tensors:
        groups.setdefault(tensor.type(), []).append(tensor)
    return groups


def apply_flattened_call_all(tensors: Sequence[torch.Tensor], call: Callable[..., Any]) -> None:
    """:func:`apply_flattened_call` once per tensor type (Bagua's helper): tensors of mixed dtypes
    or devices each go through ``call`` as one flat tensor of their own kind.

    Args:
        tensors: dense tensors, changed in place.
        call: a function that changes its one argument in place.
    """
    for group in _group_by_tensor_type(tensors).values():
        apply_flattened_call(group, call)


def check_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors lie back to back in memory, in order (each starts where the one before
    ends), as views into one flat buffer do (Bagua's helper)."""
    end: Optional[int] = None
    for t in tensors:
        if end is not None and t.data_ptr() != end:
            return False
        end = t.data_ptr() + t.numel() * t.element_size()
    return True


def get_flattened_tensor(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensors copied back to back into one new 1-D tensor, ``None`` for no tensors
    (Bagua's helper; :func:`flatten` otherwise)."""
    return flatten(tensors) if len(tensors) else None


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """Bagua's name of ``datatype`` (``"f32"``, ``"f16"``, ``"u8"``, ``"i64"``); a ValueError for
    another dtype, as Bagua's."""
    if datatype not in _BAGUA_DATATYPES:
        raise ValueError(f"unsupported data type {datatype}.")
    return _BAGUA_DATATYPES[datatype]
