"""Gradient buckets as torch's DistributedDataParallel forms them.

DDP walks the parameters in reverse order (the order in which backward produces gradients), keeps
one open bucket per (dtype, device), and closes a bucket as soon as its size reaches the cap (the
tensor that crosses the cap stays in it); buckets left open at the end follow. With DDP's default
sizes (``bucket_cap_mb=None``) the first bucket of each (dtype, device) closes at 1 MiB and the
others at 25 MiB, so that the last layers' gradients travel while backward goes on; an explicit
cap holds for every bucket, as in DDP. Each bucket is communicated as one flat buffer::

    first, rest = bucket_caps(None)                              # (1 MiB, 25 MiB) in bytes
    buckets = assign_buckets(leaves, rest, first)                # [[4, 3], [2, 1, 0]]: leaf indices
    flat = pack(leaves, buckets[0])                             # one 1-D buffer
    pieces = unpack(flat, leaves, buckets[0])                   # views shaped like the leaves
"""

from __future__ import annotations

from typing import Optional

import torch

MIB = 2**20
DEFAULT_FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_BYTES = 25 * MIB  # DDP's bucket_cap_mb=25


def bucket_caps(bucket_cap_mb: Optional[float], who: str = "buckets") -> tuple[int, int]:
    """``(first, rest)``: the byte caps of the first bucket of each (dtype, device) and of the
    others. ``None`` gives DDP's defaults (1 MiB, then 25 MiB); a number caps every bucket.

    Args:
        bucket_cap_mb: the bucket size in MiB, or ``None`` for DDP's defaults; must be positive.
        who: the name the ValueError for a cap that is not positive starts with.
    """
    if bucket_cap_mb is None:
        return DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES
    if not bucket_cap_mb > 0:
        raise ValueError(f"{who}: bucket_cap_mb must be positive (or None for DDP's defaults), got {bucket_cap_mb}")
    cap = int(bucket_cap_mb * MIB)
    return cap, cap


def assign_buckets(leaves: list, cap_bytes: int, first_cap_bytes: Optional[int] = None) -> list[list[int]]:
    """The indices of ``leaves`` (tensors) in each bucket, in DDP's order (module docstring).

    Args:
        leaves: the tensors, in parameter order.
        cap_bytes: the bucket size in bytes; must be positive (a ValueError otherwise).
        first_cap_bytes: the size of the first bucket of each (dtype, device); ``None`` for
            ``cap_bytes``.
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got {first_cap_bytes} and {cap_bytes} bytes")
    closed: list = []
    open_buckets: dict = {}  # (dtype, device) -> [indices, bytes]
    first_closed: set = set()  # the (dtype, device) keys whose first bucket has closed
    for i in reversed(range(len(leaves))):
        leaf = leaves[i]
        key = (leaf.dtype, leaf.device)
        indices_and_size = open_buckets.setdefault(key, [[], 0])
        indices_and_size[0].append(i)
        indices_and_size[1] += leaf.numel() * leaf.element_size()
        if indices_and_size[1] >= (cap_bytes if key in first_closed else first_cap_bytes):
            closed.append(indices_and_size[0])
            first_closed.add(key)
            del open_buckets[key]
    return closed + [indices for indices, _ in open_buckets.values()]


def pack(leaves: list, bucket: list[int]) -> torch.Tensor:
    """The leaves of ``bucket`` copied into one flat buffer.

    Args:
        leaves: the tensors, in parameter order.
        bucket: the indices into ``leaves`` of the bucket's tensors, in the order they are packed.
    """
    return torch.cat([leaves[i].reshape(-1) for i in bucket])


def unpack(flat: torch.Tensor, leaves: list, bucket: list[int]) -> list:
    """``flat`` cut back into tensors shaped like the leaves of ``bucket`` (views, no copy).

    Args:
        flat: a 1-D buffer laid out as :func:`pack` makes it for ``bucket``.
        leaves: the tensors whose shapes to give the pieces.
        bucket: the indices into ``leaves``, in the order :func:`pack` used.

    Returns:
        A list with one view per index of ``bucket``, in that order.
    """
    pieces = torch.split(flat, [leaves[i].numel() for i in bucket])
    return [piece.view(leaves[i].shape) for piece, i in zip(pieces, bucket)]
