"""All-reduce of flat buffers, plain or compressed. Every function launches the collectives of all
buffers before it waits for any (torch's functional collectives: an op returns at once, and the
result waits when first used), so the buffers' communication overlaps.

- ``None``: ``mean_r g_r`` (or the sum) in the buffer's own dtype.
- ``"fp16"`` / ``"bf16"``: each rank sends ``cast(g_r / n)``, the sum is taken in the low
  precision and cast back (as DDP's ``fp16_compress_hook``): half the bytes of float32.
- ``"minmax_uint8"`` (ByteGrad-style): the buffer is padded to a multiple of the world size ``n``
  and cut into ``n`` chunks; each chunk is quantized to 8 bits with its own minimum and maximum::

      step = (max - min) / 255,   q = round((x - min) / step),   x^ = min + q * step

  An all-to-all sends chunk ``j`` of every rank to rank ``j``, which dequantizes the ``n`` copies,
  reduces them, quantizes the result again, and an all-gather gives every rank every reduced
  chunk. Result for chunk ``j``: ``Q(mean_r Q(g_r[j]))``, the same bits on every rank; a quarter
  of the bytes of float32 (plus 8 bytes per chunk for min and max). The error is at most half a
  step of each quantization: ``|x^ - x| <= mean_r step_r[j] / 2 + step[j] / 2``.

  One range per chunk is what makes the codec cheap, and what an outlier costs: a single value
  of 1e3 among gradients of at most 0.14 makes its chunk's step 1e3 / 255 = 3.9, and every other
  value of that chunk then decodes to the chunk's minimum (errors up to 0.28, the whole range of
  the other values), on every rank, since the reduced chunk is quantized again. Bagua's ByteGrad
  does the same. Remedies: clip each value before the all-reduce,
  ``fb.chain(fb.clip(max_delta), fbd.allreduce_gradients(compression="minmax_uint8"), ...)``
  (the step is then at most ``2 * max_delta / 255``), or smaller buckets (``bucket_cap_mb``):
  more, smaller chunks, so an outlier spoils fewer values.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol

from functional_bagua.distributed import collectives
from functional_bagua.distributed.process_group import Group

COMPRESSIONS = (None, "fp16", "bf16", "minmax_uint8")
CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LEVELS = 255
MINMAX_BYTES = 8  # min and max as float32, sent with each chunk's codes


def check_compression(compression: object) -> None:
    """Raise a ValueError unless ``compression`` is one of :data:`COMPRESSIONS`.

    Args:
        compression: the compression a transform was given.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")


def all_reduce(buffers: list, group: Group, average: bool = True, compression: Optional[str] = None) -> list:
    """``buffers`` reduced over the ranks of ``group`` (mean or sum), each in its own dtype.

    Args:
        buffers: 1-D tensors (one flat buffer per bucket), not changed.
        group: the resolved process group (:func:`~functional_bagua.distributed.process_group.resolve`).
        average: ``True`` for the mean over the ranks, ``False`` for the sum.
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"minmax_uint8"`` (module docstring); any
            other raises a ValueError.

    Returns:
        A list of new tensors, one per buffer, in the same order.
    """
    check_compression(compression)
    if compression is None:
        sums = [funcol.all_reduce(b, "sum", group.group) for b in buffers]
        return [s / group.world_size if average else s for s in sums]
    if compression in CAST_DTYPES:
        low = CAST_DTYPES[compression]
        sent = [(b / group.world_size if average else b).to(low) for b in buffers]
        sums = [funcol.all_reduce(s, "sum", group.group) for s in sent]
        return [s.to(b.dtype) for s, b in zip(sums, buffers)]
    return _minmax_uint8_all_reduce(buffers, group, average)


def payload_bytes(numel: int, element_size: int, world_size: int, compression: Optional[str] = None) -> int:
    """The bytes one rank hands to the collectives to all-reduce a buffer of ``numel`` elements of
    ``element_size`` bytes with :func:`all_reduce` (the input of each collective it launches).

    Args:
        numel: the buffer's number of elements.
        element_size: the bytes per element of the buffer.
        world_size: the number of ranks.
        compression: as for :func:`all_reduce`.
    """
    check_compression(compression)
    if compression is None:
        return numel * element_size
    if compression in CAST_DTYPES:
        return numel * 2
    padded = numel + (-numel % world_size)
    return padded + MINMAX_BYTES * world_size + padded // world_size + MINMAX_BYTES  # all-to-all, then all-gather


def quantize(chunks: torch.Tensor) -> torch.Tensor:
    """Rows of ``chunks`` (float) as rows of uint8 codes followed by the row's min and max
    (float32, as 8 bytes): ``[rows, columns + 8]``.

    Args:
        chunks: a 2-D floating-point tensor; each row is quantized with its own minimum and maximum.

    Returns:
        A uint8 tensor of shape ``[rows, columns + 8]``.
    """
    lo = chunks.amin(dim=1, keepdim=True).float()
    hi = chunks.amax(dim=1, keepdim=True).float()
    step = (hi - lo) / LEVELS
    codes = ((chunks.float() - lo) / torch.where(step > 0, step, 1.0)).round().clamp(0, LEVELS).to(torch.uint8)
    return torch.cat([codes, torch.cat([lo, hi], dim=1).view(torch.uint8)], dim=1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows that :func:`quantize` packed, in ``dtype``.

    Args:
        packed: a uint8 tensor of shape ``[rows, columns + 8]``, as :func:`quantize` returns it.
        dtype: the dtype of the result.
    """
    codes = packed[:, :-MINMAX_BYTES]
    minmax = (
        packed[:, -MINMAX_BYTES:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    )  # a copy: its own storage, aligned for float32
    lo, hi = minmax[:, :1], minmax[:, 1:]
    return (lo + codes.float() * ((hi - lo) / LEVELS)).to(dtype)


def padded_chunks(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """``buffer`` zero-padded to a multiple of ``n`` elements, as ``n`` rows.

    Args:
        buffer: a 1-D tensor.
        n: the number of rows (the world size).
    """
    padding = -buffer.numel() % n
    return torch.nn.functional.pad(buffer, (0, padding)).view(n, -1)


def _minmax_uint8_all_reduce(buffers: list, group: Group, average: bool) -> list:
    n = group.world_size
    sent = [quantize(padded_chunks(b, n)) for b in buffers]
    received = [funcol.all_to_all_single(p.reshape(-1), None, None, group.group) for p in sent]
    mine = []
    for r, p in zip(received, sent):
        copies = dequantize(r.view(p.shape), torch.float32)  # row j: rank j's copy of my chunk
        reduced = copies.mean(dim=0) if average else copies.sum(dim=0)
        mine.append(collectives.all_gather_single(quantize(reduced.unsqueeze(0)), 0, group.group))
    return [dequantize(m, b.dtype).reshape(-1)[: b.numel()] for m, b in zip(mine, buffers)]
