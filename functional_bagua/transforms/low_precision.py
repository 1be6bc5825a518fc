"""Optimizer state in less memory: any transform's float32 state stored as bfloat16 with
stochastic rounding, as 8-bit blockwise dynamic quantization, or as bfloat16 with an 8-bit
correction of its rounding error, and decoded inside each update.

**bfloat16 with stochastic rounding.** A float32 ``x`` keeps its upper 16 bits (bfloat16's
sign, exponent and 7 fraction bits); its lower 16 bits ``f`` decide the rounding::

    bf16(x) = x truncated towards 0                  with probability 1 - f / 2^16
            = the next bfloat16 away from 0          with probability f / 2^16

so ``E[bf16(x)] = x``: small updates of a moment accumulate on average instead of being rounded
away. The 16 random bits come from a hash of (seed, step count, the value's place among the values
coded, counted through the state's tensors in order), computed with integer tensor ops and no
generator state: the same bits on every device, eagerly and compiled, one tensor at a time or
many back to back, and again after a checkpoint is loaded (nothing but the seed and the count is
kept). A finite
value above bfloat16's largest one rounds to infinity when rounded away from 0.

**8-bit blockwise dynamic quantization** (Dettmers et al., 2022, "8-bit Optimizers via
Block-wise Quantization"; as bitsandbytes and torchao store it). The tensor, flattened, is cut
into blocks of ``block_size`` values (the last block may be shorter: nothing is padded into the
stored codes, nothing truncated); each block keeps its largest magnitude ``s`` (float32), and each
value ``x`` the 8-bit index of the entry of the dynamic map ``Q`` nearest to ``x / s`` (ties to the
larger entry)::

    code(x) = argmin_k |Q[k] - x / s|        x ~ Q[code] * s

A NaN or an infinity makes its block's scale NaN or infinite, and so the block's decoded values
(as in torchao).
``Q`` holds 256 values in ``[-1, 1]`` (signed, for first moments) or ``[0, 1]`` (unsigned, for
second moments and other non-negative statistics): 0, 1, and for each decade ``10^-6 ... 10^0``
the midpoints of equal steps of ``[0.1, 1]`` times that decade, 2^i steps in the i-th decade
(2^(i+1) unsigned), mirrored to negative values when signed: dense near 0, where moments live.

**bfloat16 with an 8-bit correction** (error feedback, as heavyball's ``"bf16+8"`` state): ``x``
rounded to the nearest bfloat16 ``b``, and the rounding's error kept in 8 bits, in units of half
the bfloat16 step ``h`` at ``b`` (``h = 2^(e - 8)`` for ``b = m 2^e``, ``1 <= |m| < 2``)::

    c = round(127 (x - b) / h)   (int8)        x ~ b + c h / 127

so the error left is at most ``h / 254``: about 16 significant bits instead of bfloat16's 8, with
no randomness (an increment that bfloat16 alone would round away is kept in ``c`` and carried to
the next step). A value beyond bfloat16's range is stored as infinity, as bfloat16 rounds it.

State: 1 byte per value plus 4 per block (``block_size=256``: about 1.02 bytes) for 8-bit, 2
for bfloat16, 3 for bfloat16 with its correction, against 4 in float32; Adam's two moments go from
8 bytes per parameter to 2.03, 4 or 6.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple, Optional, Sequence

import optree
import torch

from functional_bagua import ownership
from functional_bagua.base import GradientTransformation
from functional_bagua.compiling import run_compiled
from functional_bagua.flat import is_dtensor, span, split_like
from functional_bagua.hyperparams import accepts_schedules
from functional_bagua.numerics import zero_count
from functional_bagua.tree import PyTree

CODECS = ("bf16", "8bit", "bf16+8bit")
# fields of the library's states that hold non-negative statistics (second moments, their
# maxima, squared averages and factors): 8-bit codes them with the unsigned map
NON_NEGATIVE_FIELDS = ("nu", "nu_max", "square_avg", "sum_of_squares", "acc_delta", "row_var", "col_var")


class LowPrecisionState(NamedTuple):
    """``count``: the updates taken (with the seed, the stream of the stochastic rounding);
    ``inner``: the inner transform's state, its float32 tensors stored encoded
    (:class:`Bfloat16Stored`, :class:`Signed8bit`, :class:`Unsigned8bit`)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    inner: Any


class Bfloat16Stored(NamedTuple):
    """A float32 state tensor stored as bfloat16 (decoded to float32)."""

    value: torch.Tensor


class Signed8bit(NamedTuple):
    """A float32 state tensor stored as 8-bit codes of the signed dynamic map (``codes``: uint8,
    the tensor's shape) and one float32 scale per block of the flattened tensor (``scales``)."""

    codes: torch.Tensor
    scales: torch.Tensor


class Unsigned8bit(NamedTuple):
    """As :class:`Signed8bit`, with the unsigned map (for non-negative statistics)."""

    codes: torch.Tensor
    scales: torch.Tensor


class Bfloat16Corrected(NamedTuple):
    """A float32 state tensor stored as its bfloat16 rounding to nearest (``value``) and that
    rounding's error in 8 bits (``correction``: int8, in 127ths of half a bfloat16 step at
    ``value``)."""

    value: torch.Tensor
    correction: torch.Tensor


ENCODED = (Bfloat16Stored, Signed8bit, Unsigned8bit, Bfloat16Corrected)


# ---- the dynamic map ----------------------------------------------------------------------------


def _dynamic_map_values(signed: bool) -> tuple[float, ...]:
    """The 256 values of the dynamic quantization map (module docstring), ascending, as float32
    numbers: for each decade ``10^(i-6)``, ``i = 0..6``, the midpoints of ``2^i`` (signed) or
    ``2^(i+1)`` (unsigned) equal steps of ``[0.1, 1]`` times the decade (in float32 arithmetic,
    as bitsandbytes computes them); their negatives when signed; 0 and 1.

    Args:
        signed: the map for values in ``[-1, 1]`` (``True``) or ``[0, 1]``.
    """
    values = [0.0, 1.0]
    for i in range(7):
        steps = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, steps + 1)  # float32, and so is the arithmetic below
        midpoints = (edges[:-1] + edges[1:]) / 2.0
        decade = 10.0 ** (i - 6)
        values += (decade * midpoints).tolist() + ((-decade * midpoints).tolist() if signed else [])
    assert len(values) == 256
    return tuple(float(v) for v in torch.tensor(sorted(values), dtype=torch.float32).tolist())


MAP_VALUES = {signed: _dynamic_map_values(signed) for signed in (True, False)}  # made once, at import


_MAPS: dict[tuple[bool, torch.device], torch.Tensor] = {}


def dynamic_map(signed: bool, device: torch.device) -> torch.Tensor:
    """The dynamic map's values (``MAP_VALUES``) as a float32 tensor on ``device`` (made once per
    device)."""
    key = (signed, torch.device(device))
    if torch.compiler.is_compiling():
        return torch.tensor(MAP_VALUES[signed], dtype=torch.float32, device=device)
    if key not in _MAPS:
        _MAPS[key] = torch.tensor(MAP_VALUES[signed], dtype=torch.float32, device=device)
    return _MAPS[key]


# ---- 8-bit blockwise ----------------------------------------------------------------------------


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flattened ``x`` as rows of ``block_size``, the last row filled up with zeros (which
    change no block's largest magnitude)."""
    flat = x.reshape(-1)
    short = -flat.numel() % block_size
    if short:
        flat = torch.cat([flat, flat.new_zeros(short)])
    return flat.view(-1, block_size)


def quantize_blockwise(
    x: torch.Tensor, block_size: int = 256, signed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as 8-bit codes of the dynamic map and one scale per block (module docstring).

    Args:
        x: a float32 tensor (any shape; its elements are taken in row-major order).
        block_size: values per block (the last block of the flattened ``x`` may be shorter).
        signed: the signed map (values of either sign) or the unsigned one (non-negative values;
            a negative value would be coded as 0).

    Returns:
        ``(codes, scales)``: uint8 codes of ``x``'s shape, and float32 scales, one per block (the
        block's largest magnitude, at least 1e-12).

    Example::

        codes, scales = fb.quantize_blockwise(torch.randn(1000), block_size=256)
        x = fb.dequantize_blockwise(codes, scales, signed=True)
    """
    return _quantized(x, dynamic_map(signed, x.device), block_size, signed)


def _quantized(x: torch.Tensor, qmap: torch.Tensor, block_size: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blockwise` with the map ``qmap`` given (a compiled kernel takes it as an
    input, not as 256 constants)."""
    if x.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.uint8, device=x.device), x.new_zeros(0)
    rows = _blocks(x, block_size)
    scales = rows.abs().amax(dim=1).clamp(min=1e-12)
    normalized = (rows / scales[:, None]).reshape(-1)[: x.numel()]
    if torch.compiler.is_compiling():  # elementwise: fused with the rest of the step
        below = _largest_entry_at_most(normalized, qmap, signed)
    else:  # eagerly, one binary search (the same indices: tested)
        below = (torch.bucketize(normalized, qmap, right=True) - 1).clamp(0, 254)
    low, high = qmap[below], qmap[below + 1]
    codes = torch.where(normalized - low >= (high - low) * 0.5, below + 1, below)
    return codes.to(torch.uint8).view(x.shape), scales


def _largest_entry_at_most(normalized: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    """The index of the largest entry of the map ``qmap`` at most each value (0 below them all,
    254 at most: the last pair ``(254, 255)`` brackets what is above), as
    ``bucketize(normalized, qmap, right=True) - 1`` clamped, but elementwise: the map's structure
    (``2^i`` or ``2^(i+1)`` equal steps in the ``i``-th decade) gives the index to within one, and
    two comparisons with the map's own entries settle it. Elementwise, a compiled step fuses it
    with the rest (a binary search over the map does not vectorize)."""
    v = normalized.abs()
    unit, steps = torch.full_like(v, 1e-6), torch.full_like(v, 1.0 if signed else 2.0)  # of decade 0
    for i in range(1, 7):  # v in [10^(i-7), 10^(i-6)): decade i, its top 10^(i-6), 2^i or 2^(i+1) entries
        above = v >= 10.0 ** (i - 7)
        unit = torch.where(above, 10.0 ** (i - 6), unit)
        steps = torch.where(above, 2.0 ** (i if signed else i + 1), steps)
    within = torch.floor((v / unit - 0.1) * (steps / 0.9) - 0.5)  # the largest entry j <= v, to within one
    first = 127 + steps if signed else steps - 1  # the index of the decade's first entry
    position = first + torch.minimum(within.clamp(min=-1), steps - 1)  # among the entries >= 0
    position = torch.where(v >= 1, 255, position)
    # a negative value: below the mirror image of the smallest positive entry >= |value| (signed);
    # nothing of the unsigned map lies below it
    position = torch.where(normalized < 0, 253 - position if signed else 0, position)
    index = torch.where(torch.isnan(normalized), 254, position).to(torch.int64).clamp(0, 254)
    index = index - (qmap[index] > normalized).to(torch.int64)  # the estimate one above: down
    index = index.clamp(0, 254)
    return index + ((qmap[index + 1] <= normalized) & (index < 254)).to(torch.int64)  # one below: up


def dequantize_blockwise(
    codes: torch.Tensor, scales: torch.Tensor, signed: bool = True, block_size: int = 256
) -> torch.Tensor:
    """The float32 values of ``codes`` and their blocks' ``scales`` (:func:`quantize_blockwise`):
    ``Q[code_i] * scales[i // block_size]`` for the ``i``-th value of the flattened tensor.

    Example::

        x = fb.dequantize_blockwise(*fb.quantize_blockwise(torch.randn(1000)))

    Args:
        codes: uint8 codes, in the shape of the tensor they code.
        scales: one float32 scale per block of the flattened tensor.
        signed: the map the codes index.
        block_size: the values per block the codes were made with.
    """
    _check_scales(codes, scales, block_size)
    return _dequantized(codes, scales, dynamic_map(signed, codes.device), block_size)


def _check_scales(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    blocks = -(-codes.numel() // block_size)
    if scales.shape != (blocks,):
        raise ValueError(
            f"dequantize_blockwise: {codes.numel()} codes in blocks of {block_size} need {blocks} scales, "
            f"got a tensor of shape {tuple(scales.shape)}; pass the block_size the codes were made with"
        )


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor, block_size: int) -> torch.Tensor:
    """:func:`dequantize_blockwise` with the map ``qmap`` given, the scales checked."""
    if codes.numel() == 0:
        return torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
    values = _blocks(qmap[codes.reshape(-1).long()], block_size)
    return (values * scales[:, None]).reshape(-1)[: codes.numel()].view(codes.shape)


# ---- bfloat16 with stochastic rounding --------------------------------------------------------


def _shifted_right(h: torch.Tensor, k: int) -> torch.Tensor:
    """``h >> k`` as unsigned 64-bit integers (torch shifts int64 arithmetically)."""
    return (h >> k) & ((1 << (64 - k)) - 1)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, elementwise on int64 (products wrap modulo 2^64, as unsigned)."""
    h = h ^ _shifted_right(h, 30)
    h = h * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
    h = h ^ _shifted_right(h, 27)
    h = h * -7723592293110705685  # 0x94D049BB133111EB
    return h ^ _shifted_right(h, 31)


_INDEX_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads the element index


def _bits16(index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """16 random bits (int32 values in ``[0, 2^16)``) per int64 ``index``: bits 24 to 39 of
    ``mix((index ^ mask) C)``. The index enters by xor, not as ``index C + mask``: inductor
    (torch 2.13, CPU) folds an arange times a large constant into one index expression that it
    vectorizes wrongly for sizes that are not a multiple of the vector width (wrong values, and
    stores past the end of the buffer)."""
    h = _mix((index ^ mask) * _INDEX_MULTIPLIER)
    return (_shifted_right(h, 24) & 0xFFFF).to(torch.int32)


STATE_STREAM, PARAMETER_STREAM = 1, 2  # what a stream rounds: low_precision_state's state, master_weights' parameters


def rounding_stream(seed: int, count: torch.Tensor, purpose: int) -> torch.Tensor:
    """The seed of the rounding bits of an update (int64, 0-dim, on ``count``'s device):
    ``mix(mix(mix(seed) + count) + purpose)``, so that each update, and each ``purpose``
    (:data:`STATE_STREAM`, :data:`PARAMETER_STREAM`: the state and the parameters of one step
    draw apart, whatever their seeds), has a stream of its own."""
    first = _mix(torch.as_tensor(seed, dtype=torch.int64, device=count.device))
    return _mix(_mix(first + count.to(torch.int64)) + purpose)


def random_bits16(shape: torch.Size, seed: Any, device: torch.device, start: int = 0) -> torch.Tensor:
    """16 random bits per element (int32 values in ``[0, 2^16)``), a hash of the element's index
    in the stream ``seed``: integer arithmetic, the same bits on every device, eager or compiled.
    The element at flat position ``j`` has index ``start + j``, so the bits of a tensor that
    starts at index ``start`` of a stream are those of its values' places in one long run::

        random_bits16((n,), s, d, start=k) == random_bits16((k + n,), s, d)[k:]

    Args:
        shape: the shape of the bits.
        seed: an int or a 0-dim integer tensor (mix the step count into it: each stream its own
            seed).
        device: where to make them.
        start: the stream index of the first element.

    Example::

        bits = fb.random_bits16((4, 3), seed=7, device=torch.device("cpu"))
    """
    index = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64, device=device) + start
    return _bits16(index, _mix(torch.as_tensor(seed, dtype=torch.int64, device=device))).view(shape)


def stochastically_rounded_from(flat: torch.Tensor, start: Any, seed: torch.Tensor) -> torch.Tensor:
    """The 1-D float32 ``flat`` rounded to bfloat16 stochastically with the bits of
    :func:`random_bits16` of ``seed`` (a 0-dim int64 tensor) from index ``start`` (an int, or a
    0-dim int64 tensor): the coding kernel of ``"bf16"``."""
    index = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) + start
    return stochastic_round_to_bfloat16(flat, _bits16(index, _mix(seed)))


def _half_bfloat16_step(wide: torch.Tensor) -> torch.Tensor:
    """Half the spacing of bfloat16 numbers at each bfloat16 value ``wide`` (given as float32):
    ``2^(e - 8)`` for ``wide = m 2^e`` (``1 <= |m| < 2``), that of the smallest normal numbers at
    0 and below."""
    exponent = wide.view(torch.int32) & 0x7F800000  # the bits of 2^e (sign and fraction off)
    smallest_normal = 0x00800000  # 2^-126
    return torch.where(exponent == 0, smallest_normal, exponent).view(torch.float32) * 2.0**-8


def round_to_nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest value of ``dtype`` (bfloat16 or float16; ties to
    even, a finite value beyond the range to infinity, as torch converts), given as float32.

    Computed on ``x``'s bits in 32-bit lanes, so that a compiled graph keeps the rounding
    (inductor folds ``x.to(bfloat16).to(float32)`` back into ``x`` unless
    ``emulate_precision_casts`` is set). float16: ``10`` fraction bits kept, and below its
    smallest normal number ``2^-14`` a fixed step of ``2^-24``.

    Args:
        x: a float32 tensor.
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Example::

        y = round_to_nearest(x, torch.bfloat16)   # torch.equal(y, x.to(torch.bfloat16).float())
    """
    if x.dtype != torch.float32 or dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"round_to_nearest: x must be float32 and dtype bfloat16 or float16, got {x.dtype}, {dtype}")
    finite = torch.isfinite(x)
    bits = torch.where(finite, x.view(torch.int32), 0)
    if dtype == torch.bfloat16:  # 16 bits dropped; a carry into the exponent rounds up to inf
        return torch.where(finite, ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32), x)
    normal = ((bits + 0xFFF + ((bits >> 13) & 1)) & -8192).view(torch.float32)  # 13 bits dropped
    subnormal = torch.round(x * 2.0**24) * 2.0**-24  # exact scalings; round: ties to even
    rounded = torch.where(x.abs() < 2.0**-14, subnormal, normal)
    rounded = torch.where(rounded.abs() > 65504.0, rounded * float("inf"), rounded)  # float16's largest
    return torch.where(finite, rounded, x)


def bfloat16_corrected(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32) as its nearest bfloat16 and the rounding's error in 8 bits (module
    docstring): ``(value, correction)``, decoded by :func:`bfloat16_uncorrected`.

    Args:
        x: a float32 tensor.

    Example::

        value, correction = fb.bfloat16_corrected(torch.randn(1000))
        x = fb.bfloat16_uncorrected(value, correction)       # within 1/254 of half a bfloat16 step
    """
    if x.dtype != torch.float32:
        raise TypeError(f"bfloat16_corrected: x must be float32, got {x.dtype}")
    rounded = round_to_nearest(x, torch.bfloat16)  # on x's bits: a compiled graph keeps it
    error = x - rounded  # exact: x and its rounding share all but the last bits
    code = torch.round(error / _half_bfloat16_step(rounded) * 127).clamp(-127, 127)
    return rounded.to(torch.bfloat16), torch.where(torch.isfinite(code), code, 0).to(torch.int8)


def bfloat16_uncorrected(value: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The float32 values :func:`bfloat16_corrected` coded: ``value + (correction * h) / 127``
    (``correction * h`` exact, one rounding in the division, none fused into the sum).

    Args:
        value: the bfloat16 roundings.
        correction: their int8 corrections, in 127ths of half a bfloat16 step ``h`` at ``value``.
    """
    wide = value.to(torch.float32)
    corrected = wide + correction.to(torch.float32) * _half_bfloat16_step(wide) / 127
    return torch.where(torch.isfinite(wide), corrected, wide)


def stochastic_round_to_bfloat16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 away from 0 where ``bits`` (16 random bits per element)
    fall below ``x``'s lower 16 bits, else towards 0: unbiased (module docstring).

    Args:
        x: a float32 tensor.
        bits: int32 values in ``[0, 2^16)``, of ``x``'s shape (:func:`random_bits16`).

    Example::

        y = fb.stochastic_round_to_bfloat16(x, fb.random_bits16(x.shape, seed=0, device=x.device))
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bfloat16: x must be float32, got {x.dtype}")
    raw = x.view(torch.int32)
    towards_zero = raw & -65536  # 0xFFFF0000: the upper 16 bits
    rounded = torch.where(bits < (raw & 0xFFFF), towards_zero + 65536, towards_zero).view(torch.float32)
    # exact in bfloat16 (its lower 16 bits are 0); inf and nan are converted as they are, and a
    # finite x above bfloat16's largest value rounds to inf when rounded away from 0
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


# ---- the wrapper ----------------------------------------------------------------------------


@accepts_schedules(static_args=("inner",))  # built_from: fb.Optimizer shows the inner alias's lr
def low_precision_state(
    inner: GradientTransformation,
    codec: str = "bf16",
    *,
    block_size: int = 256,
    min_size: Optional[int] = None,
    seed: int = 0,
    fields: Optional[Sequence[str]] = None,
    compile_codecs: bool = True,
) -> GradientTransformation:
    """``inner`` with its float32 state tensors stored in ``codec`` between updates (module
    docstring): decoded to float32 at the start of each update, the new state encoded at its end.
    The updates are ``inner``'s, computed from the decoded state; step counts, 0-dim scalars,
    integer and complex state and state in other dtypes (a bfloat16 parameter's bfloat16
    moments) are kept as they are; the parameters are untouched. The memory is saved between
    steps: during one, the decoded state and the inner update's new state are float32 (and
    eagerly the values coded together are copied back to back first, up to
    ``KERNEL_BATCH_VALUES`` of them at once).

    Args:
        inner: any transform (an alias such as ``fb.adamw``, a chain).
        codec: ``"bf16"`` (bfloat16 with stochastic rounding, 2 bytes per value), ``"8bit"``
            (blockwise dynamic quantization, about 1 byte per value; fields named in
            ``NON_NEGATIVE_FIELDS``, such as Adam's ``nu``, with the unsigned map) or
            ``"bf16+8bit"`` (bfloat16 rounded to nearest with an 8-bit correction of its error,
            3 bytes per value, about 16 significant bits, no randomness).
        block_size: values per scale for ``"8bit"`` (at least 2).
        min_size: tensors of fewer values are kept in float32; ``None``: 4096 for ``"8bit"`` (as
            bitsandbytes and torchao keep small tensors, whose few blocks 8 bits serve badly), 1
            for ``"bf16"``.
        seed: the stochastic rounding's seed for ``"bf16"``, in ``[0, 2^31)`` (unused by the
            other codecs).
        fields: the names of the state fields to store encoded (``("mu", "nu")``); ``None``: every
            float32 tensor of at least one dimension. A name that no field of the inner state
            has, or a field holding integer or complex tensors, is refused.
        compile_codecs: in an update run eagerly, code and decode through kernels compiled by
            ``torch.compile`` (inductor; one per codec and direction, compiled at its first use,
            shapes dynamic): one pass over the values instead of an op per line of the codec
            (about 20 for ``"bf16"``'s hash), the same numbers. Inside a compiled step the step's
            graph codes itself either way. ``False``: op by op (no compiling; what happens anyway,
            after a warning, where inductor cannot compile).

    Returns:
        A GradientTransformation whose state is a :class:`LowPrecisionState`.

    Example::

        tx = fb.low_precision_state(fb.adamw(1e-3), "8bit")     # Adam's moments in ~2 bytes per parameter
        opt = fb.Optimizer(model.parameters(), tx)
    """
    if codec not in CODECS:
        raise ValueError(f"low_precision_state: codec must be one of {CODECS}, got {codec!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"low_precision_state: block_size must be an int >= 2, got {block_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"low_precision_state: seed must be an int in [0, 2^31), got {seed!r}")
    if min_size is not None and (isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1):
        raise ValueError(f"low_precision_state: min_size must be an int >= 1 or None, got {min_size!r}")
    if isinstance(fields, str):
        raise ValueError(f"low_precision_state: fields must be a sequence of field names, got the string {fields!r}")
    if not isinstance(compile_codecs, bool):
        raise ValueError(f"low_precision_state: compile_codecs must be True or False, got {compile_codecs!r}")
    encode = functools.partial(
        encoded,
        codec=codec,
        block_size=block_size,
        min_size=min_size if min_size is not None else 4096 if codec == "8bit" else 1,
        seed=seed,
        fields=None if fields is None else tuple(fields),
        compiled=compile_codecs,
    )

    def init(params: PyTree) -> LowPrecisionState:
        count = zero_count(params)
        state = inner.init(params)
        if fields is not None:
            present = {field for _, field in _leaves_and_fields(state)[0]}
            missing = [f for f in fields if f not in present]
            if missing:
                raise ValueError(
                    f"low_precision_state: fields names {missing}, which the inner state does not have; "
                    f"its fields holding tensors: {sorted(f for f in present if f)}"
                )
        return LowPrecisionState(count, encode(state, count))

    def update(grads: PyTree, state: LowPrecisionState, params: Optional[PyTree] = None) -> tuple[PyTree, Any]:
        if not isinstance(state, LowPrecisionState):
            raise ValueError(
                f"low_precision_state: got a state of type {type(state).__name__}, expected LowPrecisionState; "
                "pass the state this transform's init made"
            )
        # the decoded state is new tensors, and the rest is ours to give where the caller gave it
        # up: then the inner transform may step it in place (ownership), and its new state lies
        # back to back as decoded, coded again without a copy
        with ownership.giving_state(inner.update if ownership.state_given_to(update) else None):
            updates, new_inner = inner.update(grads, decoded(state.inner, block_size, compile_codecs), params)
        count = state.count + 1
        return updates, LowPrecisionState(count, encode(new_inner, count))

    return GradientTransformation(init, update)


def encoded(
    state: Any,
    count: torch.Tensor,
    *,
    codec: str,
    block_size: int,
    min_size: int,
    seed: int,
    fields: Optional[tuple] = None,
    compiled: bool = False,
) -> Any:
    """``state`` with the tensors :func:`low_precision_state` stores encoded in ``codec`` (its
    arguments; ``count``, the updates taken, and ``seed`` make the rounding's stream, in which
    each value's index is its place among the values coded, in the state's order; ``compiled``:
    eagerly, through compiled kernels)."""
    found, spec = _leaves_and_fields(state)
    stream = rounding_stream(seed, count, STATE_STREAM) if codec == "bf16" else None  # only bf16 draws bits
    out = [x for x, _ in found]
    starts: dict[int, int] = {}  # each coded tensor's first index in the stream
    together: dict[tuple, list[int]] = {}  # the tensors coded in one pass: the same device and map
    coded_so_far = 0
    for number, (x, field) in enumerate(found):
        if _stored_encoded(x, field, fields) and x.numel() >= min_size:
            starts[number], coded_so_far = coded_so_far, coded_so_far + x.numel()
            signed = codec == "8bit" and field not in NON_NEGATIVE_FIELDS
            # 8 bits: a tensor whose last block is short codes alone (its blocks would run into the next's)
            alone = number if codec == "8bit" and x.numel() % block_size else None
            together.setdefault((x.device, signed, alone), []).append(number)
    for (_, signed, _), numbers in together.items():
        sizes = [found[n][0].numel() for n in numbers]
        places = [starts[n] for n in numbers] if codec == "bf16" else None  # only bf16's bits need a run
        for batch in batches_of(numbers, sizes, places, compiled):
            xs = [found[n][0] for n in batch]
            for n, value in zip(
                batch, _encoded_back_to_back(xs, starts[batch[0]], stream, codec, block_size, signed, compiled)
            ):
                out[n] = value
    return spec.unflatten(out)


BATCH_VALUES = 1 << 20  # the most values coded in one pass op by op: its temporaries (int64 hashes) stay small
KERNEL_BATCH_VALUES = 1 << 24  # by a compiled kernel (no temporaries): the copy of the batch's values


def batches_of(
    numbers: list[int], sizes: list[int], starts: Optional[list[int]] = None, compiled: bool = False
) -> list[list[int]]:
    """``numbers`` (of tensors of ``sizes`` values, starting at ``starts`` in their rounding
    stream, where they have one) cut into the batches coded in one pass each: eagerly, runs of
    tensors (that follow one another in the stream) of at most :data:`BATCH_VALUES` values
    together (:data:`KERNEL_BATCH_VALUES` when ``compiled``; a larger tensor alone): each op's
    call costs more than its work on small tensors. One by one while traced: no copy into a
    batch, the graph fuses the rest."""
    if torch.compiler.is_compiling():
        return [[n] for n in numbers]
    cap = KERNEL_BATCH_VALUES if compiled else BATCH_VALUES
    batches: list[list[int]] = []
    total = end = 0
    for n, size, start in zip(numbers, sizes, starts if starts is not None else itertools.repeat(None)):
        if not batches or total + size > cap or (start is not None and start != end):
            batches.append([])
            total = 0
        batches[-1].append(n)
        total, end = total + size, (start or 0) + size
    return batches


def _coded(fn: Any, *tensors: torch.Tensor, static: tuple = (), fixed_shapes: int = 0, compiled: bool) -> Any:
    """``fn(*tensors, *static)``, by a compiled kernel when ``compiled`` (:func:`run_compiled`;
    the last ``fixed_shapes`` tensors, the map, of a constant shape)."""
    if compiled:
        return run_compiled(fn, *tensors, static=static, fixed_shapes=fixed_shapes)
    return fn(*tensors, *static)


def _encoded_back_to_back(
    xs: list[torch.Tensor],
    start: int,
    stream: Optional[torch.Tensor],
    codec: str,
    block_size: int,
    signed: bool,
    compiled: bool,
) -> list:
    """Each of ``xs`` (float32, following one another in the stream from ``start``) coded in
    ``codec``, with the numbers of coding each alone: the values are coded back to back in one
    flat tensor (elementwise codes; 8-bit blocks, as each tensor but the last fills whole
    blocks), and each tensor's code is a view of the result."""
    flat = back_to_back(xs)
    if codec == "8bit":
        qmap = dynamic_map(signed, flat.device)
        codes, scales = _coded(_quantized, flat, qmap, static=(block_size, signed), fixed_shapes=1, compiled=compiled)
        per_scale = torch.split(scales, [-(-x.numel() // block_size) for x in xs])
        kind = Signed8bit if signed else Unsigned8bit
        return [kind(c, s) for c, s in zip(split_like(codes, xs), per_scale)]
    if codec == "bf16+8bit":
        value, correction = _coded(bfloat16_corrected, flat, compiled=compiled)
        return [Bfloat16Corrected(v, c) for v, c in zip(split_like(value, xs), split_like(correction, xs))]
    assert stream is not None  # made for bf16 (encoded)
    at, seed = _index_tensor(start, flat.device), stream.to(flat.device)
    rounded = _coded(stochastically_rounded_from, flat, at, seed, compiled=compiled)
    return [Bfloat16Stored(r) for r in split_like(rounded, xs)]


def _index_tensor(start: int, device: torch.device) -> Any:
    """``start`` as a 0-dim int64 tensor on ``device`` (a fill: no copy from the host), an input of
    the eager kernel (a constant would compile it again for each start); while traced, the int
    itself (the graph adds it to its index as a constant: a tensor there made the step 1.5x
    slower)."""
    if torch.compiler.is_compiling():
        return start
    return torch.full((), start, dtype=torch.int64, device=device)


def back_to_back(xs: list[torch.Tensor]) -> torch.Tensor:
    """The values of ``xs`` back to back in one 1-D tensor: a view where they already lie so in
    one storage (one tensor's own values, the decoded state an update stepped in place), else a
    copy."""
    if len(xs) == 1:
        return xs[0].reshape(-1)
    together = span(xs)
    return together if together is not None else torch.cat([x.reshape(-1) for x in xs])


def decoded(state: Any, block_size: int = 256, compiled: bool = False) -> Any:
    """``state`` with each encoded tensor (:class:`Bfloat16Stored`, :class:`Signed8bit`,
    :class:`Unsigned8bit`, :class:`Bfloat16Corrected`) decoded to float32 (``block_size``: the one
    the 8-bit codes were made with; ``compiled``: eagerly, through compiled kernels)."""

    leaves, spec = optree.tree_flatten(state, is_leaf=lambda x: isinstance(x, ENCODED), none_is_leaf=True)
    out = list(leaves)
    batches: dict[tuple, list[int]] = {}  # eagerly, the codes encoded() made in one pass: one storage
    for i, x in enumerate(leaves):
        if isinstance(x, ENCODED):
            home = i if torch.compiler.is_compiling() else x[0].untyped_storage().data_ptr()
            batches.setdefault((type(x), home), []).append(i)
    for places in batches.values():
        coded = [leaves[i] for i in places]
        together = None if torch.compiler.is_compiling() else _decoded_back_to_back(coded, block_size, compiled)
        for i, value in zip(places, together or [_decoded_alone(x, block_size, compiled) for x in coded]):
            out[i] = value
    return spec.unflatten(out)


def _decoded_alone(x: Any, block_size: int, compiled: bool) -> torch.Tensor:
    if isinstance(x, Bfloat16Stored):
        return x.value.to(torch.float32)
    if isinstance(x, Bfloat16Corrected):  # flattened: one kernel for every shape
        flat = _coded(bfloat16_uncorrected, x.value.reshape(-1), x.correction.reshape(-1), compiled=compiled)
        return flat.view(x.value.shape)
    return _decoded_8bit(x.codes, x.scales, isinstance(x, Signed8bit), block_size, compiled)


def _decoded_8bit(
    codes: torch.Tensor, scales: torch.Tensor, signed: bool, block_size: int, compiled: bool
) -> torch.Tensor:
    """:func:`dequantize_blockwise`, by a compiled kernel when ``compiled``."""
    _check_scales(codes, scales, block_size)
    qmap = dynamic_map(signed, codes.device)
    flat = _coded(
        _dequantized, codes.reshape(-1), scales, qmap, static=(block_size,), fixed_shapes=1, compiled=compiled
    )
    return flat.view(codes.shape)


def _decoded_back_to_back(coded: list, block_size: int, compiled: bool) -> Optional[list[torch.Tensor]]:
    """The float32 values of ``coded`` (encoded tensors of one kind) decoded in one pass where
    each of their parts lies back to back in memory (and, for 8 bits, every tensor but the last
    fills whole blocks); else ``None``."""
    if len(coded) < 2:
        return None
    sizes = [x[0].numel() for x in coded]
    spans = [span([x[k] for x in coded]) for k in range(len(coded[0]))]
    parts = [part for part in spans if part is not None and part.numel() > 0]
    if len(parts) < len(spans):
        return None
    if isinstance(coded[0], Bfloat16Stored):
        flat = parts[0].to(torch.float32)
    elif isinstance(coded[0], Bfloat16Corrected):
        flat = _coded(bfloat16_uncorrected, *parts, compiled=compiled)
    else:
        if any(size % block_size for size in sizes[:-1]) or parts[1].numel() != -(-sum(sizes) // block_size):
            return None
        codes, scales = parts
        flat = _decoded_8bit(codes, scales, isinstance(coded[0], Signed8bit), block_size, compiled)
    return split_like(flat, [x[0] for x in coded])


def _stored_encoded(x: Any, field: Optional[str], chosen: Optional[tuple]) -> bool:
    """Whether the state tensor ``x`` of ``field`` is stored encoded (``chosen``: the fields
    named, or ``None`` for every float32 tensor of at least one dimension)."""
    if not isinstance(x, torch.Tensor):
        return False
    if chosen is not None and field not in chosen:
        return False
    if is_dtensor(x):
        raise ValueError(
            f"low_precision_state: the state field {field!r} holds a DTensor: parameters sharded by FSDP2 "
            "(or held as DTensors otherwise) are not supported by low_precision_state"
        )
    if x.is_complex() or not x.is_floating_point():
        if chosen is None:
            return False  # step counts, other integer state and complex state: kept as they are
        raise ValueError(
            f"low_precision_state: the state field {field!r} holds a {x.dtype} tensor; its codecs store real "
            "floating-point state: name only float32 fields in fields=, or leave fields=None (every float32 "
            "tensor of at least one dimension)"
        )
    return x.dtype == torch.float32 and x.dim() > 0


def _leaves_and_fields(state: Any) -> tuple[list[tuple[Any, Optional[str]]], Any]:
    """The leaves of ``state`` (optree's structure, ``None`` as a leaf) with the name of the
    innermost NamedTuple field that holds each (``"nu"`` for Adam's second moments), and the
    structure to rebuild it from new leaves."""
    leaves, spec = optree.tree_flatten(state, none_is_leaf=True)
    fields = _fields_of.__wrapped__(spec) if torch.compiler.is_compiling() else _fields_of(spec)  # traced: no cache
    return list(zip(leaves, fields)), spec


@functools.lru_cache(maxsize=256)
def _fields_of(spec: Any) -> tuple[Optional[str], ...]:
    """Per leaf of the structure ``spec``, the name of the innermost NamedTuple field holding it."""
    fields = []
    for accessor in spec.accessors():
        names = [entry.field for entry in accessor if isinstance(entry, optree.NamedTupleEntry)]
        fields.append(names[-1] if names else None)
    return tuple(fields)
