"""Gradient buckets as torch's DistributedDataParallel forms them.

DDP walks the parameters in reverse order (the order in which backward produces gradients), keeps
one open bucket per (dtype, device), and closes a bucket as soon as its size reaches the cap (the
tensor that crosses the cap stays in it); buckets left open at the end follow. Each bucket is
communicated as one flat buffer::

    buckets = assign_buckets(leaves, cap_bytes=25 * 2**20)     # [[4, 3], [2, 1, 0]]: leaf indices
    flat = pack(leaves, buckets[0])                             # one 1-D buffer
    pieces = unpack(flat, leaves, buckets[0])                   # views shaped like the leaves
"""

from __future__ import annotations

import torch

MIB = 2**20


def assign_buckets(leaves: list, cap_bytes: int) -> list[list[int]]:
    """The indices of ``leaves`` (tensors) in each bucket, in DDP's order (module docstring).

    Args:
        leaves: the tensors, in parameter order.
        cap_bytes: the bucket size in bytes; must be positive (a ValueError otherwise).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    closed: list = []
    open_buckets: dict = {}  # (dtype, device) -> [indices, bytes]
    for i in reversed(range(len(leaves))):
        leaf = leaves[i]
        indices_and_size = open_buckets.setdefault((leaf.dtype, leaf.device), [[], 0])
        indices_and_size[0].append(i)
        indices_and_size[1] += leaf.numel() * leaf.element_size()
        if indices_and_size[1] >= cap_bytes:
            closed.append(indices_and_size[0])
            del open_buckets[(leaf.dtype, leaf.device)]
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
