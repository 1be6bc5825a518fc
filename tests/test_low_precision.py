"""Optimizer state in bfloat16 (stochastic rounding), 8 bits (blockwise dynamic quantization) and
bfloat16 with an 8-bit correction: the codecs against torchao's and bitsandbytes' and against
the rules written out, the wrapper against the inner transform run on the decoded state,
checkpoints, compiled and fused steps, bad input."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from devices import DEVICE, seeded
from helpers import ALL_ALIASES, RICH_SETTINGS, assert_trees_close, assert_trees_equal, run_resumed, run_updates

import functional_bagua as fb
from functional_bagua import compiling, ownership
from functional_bagua.flat import span
from functional_bagua.transforms import low_precision as lp

CODECS = ["bf16", "8bit", "bf16+8bit"]
STORED = {"bf16": fb.Bfloat16Stored, "8bit": fb.Signed8bit, "bf16+8bit": fb.Bfloat16Corrected}
TORCHAO_WHY = "torchao's 8-bit optimizer state is the 8-bit codec's reference: an optional test dependency"


def torchao_quant_utils():
    pytest.importorskip("torchao", reason=TORCHAO_WHY)
    from torchao.optim import quant_utils

    return quant_utils


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_dynamic_maps_are_torchaos(signed):
    reference = torch.tensor(torchao_quant_utils().create_dynamic_map(signed=signed), dtype=torch.float32)
    ours = lp.dynamic_map(signed, torch.device("cpu"))
    assert torch.equal(ours, reference)
    assert ours.numel() == 256 and bool((ours[1:] > ours[:-1]).all())
    assert ours[-1].item() == 1.0 and (ours[0].item() == 0.0 if not signed else -1 < ours[0].item() < -0.99)


def moments_like(n, signed, gen):
    """Values as moments are: magnitudes over many decades, a few large ones per block."""
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    return x if signed else x.square()


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_and_scales_are_torchaos(signed):
    """Blockwise absmax scales and the nearest map entry (ties up) as torchao's quantize/dequantize
    on the same inputs (a size its blocks divide, as torchao requires)."""
    quant_utils = torchao_quant_utils()
    x = moments_like(256 * 40, signed, seeded(0)).reshape(40, 256)
    codes, scales = fb.quantize_blockwise(x, block_size=256, signed=signed)
    qmap = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    normalized, want_scales = quant_utils.scale_tensor(x, 256)
    want_codes = quant_utils.quantize_8bit_with_qmap(normalized, qmap)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)
    assert torch.equal(
        fb.dequantize_blockwise(codes, scales, signed=signed),
        quant_utils.dequant_with_qmap(want_codes, qmap, want_scales),
    )


BITSANDBYTES_WHY = (
    "bitsandbytes' blockwise quantization is the 8-bit codec's second reference: an optional test dependency"
)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_and_scales_against_bitsandbytes(signed):
    """bitsandbytes' (CPU) blockwise quantization on the same inputs, a short last block
    included: the same map (its create_dynamic_map), the same scales (absmax), and from the same
    codes the same decoded values, bit for bit. Its kernel's search is coarser than the nearest
    entry: values under about 2e-5 of their block's scale share one code, and near a midpoint it
    may take the farther neighbour. So: our code is never farther from the value than its, and
    for values of at least 1e-3 of their scale the codes are equal but within 5% of a gap from
    a midpoint."""
    bnb = pytest.importorskip("bitsandbytes.functional", reason=BITSANDBYTES_WHY)
    x = moments_like(256 * 40 + 77, signed, seeded(2))
    qmap = bnb.create_dynamic_map(signed=signed)
    assert torch.equal(qmap, lp.dynamic_map(signed, torch.device("cpu")))
    want_codes, want_state = bnb.quantize_blockwise(x, code=qmap, blocksize=256)
    codes, scales = fb.quantize_blockwise(x, block_size=256, signed=signed)
    assert torch.equal(scales, want_state.absmax)
    assert torch.equal(
        fb.dequantize_blockwise(want_codes, scales, signed=signed), bnb.dequantize_blockwise(want_codes, want_state)
    )
    normalized = x / scales.repeat_interleave(256)[: x.numel()]
    ours, theirs = qmap[codes.long()], qmap[want_codes.long()]
    assert bool(((normalized - ours).abs() <= (normalized - theirs).abs()).all())
    differ = (codes != want_codes) & (normalized.abs() >= 1e-3)
    assert bool(((codes[differ].long() - want_codes[differ].long()).abs() == 1).all())  # neighbours
    midpoint, gap = (ours[differ] + theirs[differ]) / 2, (ours[differ] - theirs[differ]).abs()
    assert bool(((normalized[differ] - midpoint).abs() <= 0.05 * gap).all())


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_entry_below_each_value_is_found_elementwise_as_a_binary_search_finds_it(signed):
    """The code's bracketing pair is found from the map's structure (decades of equal steps) and
    two comparisons with the map: the index of a binary search (``bucketize``) on every entry,
    the floats either side of it, every midpoint and the floats either side of that, both signs,
    0, +-1, beyond 1, infinities, NaN, subnormals and values over many decades."""
    qmap = lp.dynamic_map(signed, DEVICE)
    mids = (qmap[1:] + qmap[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    edges = [qmap, mids, *(torch.nextafter(t, d) for t in (qmap, mids) for d in (up, down))]
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, float("inf"), -float("inf"), float("nan"), 1e-38, 1e-45])
    n = torch.cat([*edges, *(-t for t in edges), special, moments_like(200_000, True, seeded(4)).clamp(-1, 1)])
    want = (torch.bucketize(n, qmap, right=True) - 1).clamp(0, 254)
    assert torch.equal(lp._largest_entry_at_most(n, qmap, signed), want)


def test_each_value_gets_the_nearest_entry_of_its_blocks_map():
    """The rule written out: the code's entry is the nearest of all 256 to the value over its
    block's scale, the largest magnitude of the block (here a positive value: coded as 1)."""
    x = moments_like(3 * 64, True, seeded(1)).view(3, 64)
    x[:, 5] = x.abs().amax(dim=1) * 1.5  # each block's largest magnitude, positive
    codes, scales = fb.quantize_blockwise(x, block_size=64)
    qmap = lp.dynamic_map(True, DEVICE).double()
    assert torch.equal(scales, x[:, 5])
    normalized = (x.double() / scales.double()[:, None]).reshape(-1)
    distance_to_all = (normalized[:, None] - qmap[None, :]).abs()
    chosen = distance_to_all.gather(1, codes.reshape(-1, 1).long()).squeeze(1)
    assert bool((chosen <= distance_to_all.min(dim=1).values + 1e-7).all())
    assert bool((qmap[codes[:, 5].long()] == 1.0).all())


def test_a_last_block_shorter_is_coded_as_the_same_values_padded_with_zeros():
    """1000 values in blocks of 256: the last block (232 values) is coded as if zeros filled it
    up (nothing padded into the stored codes, nothing cut off)."""
    x = moments_like(1000, True, seeded(2))
    x[:256] *= 1e-3  # blocks of very different scales: a value given another block's scale shows
    codes, scales = fb.quantize_blockwise(x, block_size=256)
    padded_codes, padded_scales = fb.quantize_blockwise(torch.cat([x, torch.zeros(24)]), block_size=256)
    assert codes.shape == (1000,) and scales.shape == (4,)
    assert torch.equal(codes, padded_codes[:1000]) and torch.equal(scales, padded_scales)
    back = fb.dequantize_blockwise(codes, scales, block_size=256)
    assert torch.equal(back, fb.dequantize_blockwise(padded_codes, padded_scales, block_size=256)[:1000])
    qmap = lp.dynamic_map(True, torch.device("cpu"))
    written_out = torch.stack([qmap[codes[i].long()] * scales[i // 256] for i in range(1000)])
    assert torch.equal(back, written_out)
    for empty in (torch.zeros(0), torch.zeros(3, 0)):
        codes, scales = fb.quantize_blockwise(empty)
        assert codes.shape == empty.shape and scales.numel() == 0
        assert fb.dequantize_blockwise(codes, scales).shape == empty.shape


def bfloat16_neighbours(x):
    """The bfloat16 values below and above each float32 ``x`` in magnitude (towards and away from 0)."""
    raw = x.view(torch.int32)
    towards = (raw & -65536).view(torch.float32)
    away = ((raw & -65536) + 65536).view(torch.float32)
    return towards, away


def test_stochastic_rounding_is_the_rule_written_out():
    """Away from 0 exactly where the 16 random bits fall below x's lower 16 bits."""
    gen = seeded(3)
    x = torch.randn(5000, generator=gen)
    bits = torch.randint(0, 1 << 16, (5000,), generator=gen, dtype=torch.int32)
    towards, away = bfloat16_neighbours(x)
    lower = x.view(torch.int32) & 0xFFFF
    want = torch.where(bits < lower, away, towards)
    got = fb.stochastic_round_to_bfloat16(x, bits)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), want)
    exact = torch.tensor([1.0, -2.5, 0.0, float("inf"), float("-inf")])
    assert torch.equal(fb.stochastic_round_to_bfloat16(exact, torch.zeros(5, dtype=torch.int32)).float(), exact)
    assert math.isnan(
        fb.stochastic_round_to_bfloat16(torch.tensor([float("nan")]), torch.zeros(1, dtype=torch.int32)).item()
    )


def test_stochastic_rounding_is_unbiased_and_deterministic_for_a_seed():
    """The mean of many roundings (each with its own seed) of values between two bfloat16
    numbers is the value, within 5 standard errors; the same seed gives the same bits."""
    x = torch.tensor([1.0 + 2**-10, -3.0 - 3 * 2**-9, 1e-3 * (1 + 2**-12), 7.0 + 2**-6])
    towards, away = bfloat16_neighbours(x)
    p = ((x - towards) / (away - towards)).double()
    draws = 4000
    total = torch.zeros(4, dtype=torch.float64)
    for seed in range(draws):
        total += fb.stochastic_round_to_bfloat16(x, fb.random_bits16(x.shape, seed, x.device)).double()
    mean = total / draws
    bound = 5 * (away - towards).abs().double() * torch.sqrt(p * (1 - p) / draws)
    assert bool(((mean - x.double()).abs() <= bound).all()), (mean - x.double(), bound)
    a = fb.random_bits16((1000,), 7, torch.device("cpu"))
    assert torch.equal(a, fb.random_bits16((1000,), 7, torch.device("cpu")))
    assert not torch.equal(a, fb.random_bits16((1000,), 8, torch.device("cpu")))
    assert int(a.min()) >= 0 and int(a.max()) < 1 << 16
    counts = torch.bincount(a >> 12, minlength=16).double()  # 16 bins of the 16 bits: about uniform
    assert float(((counts - 1000 / 16) ** 2 / (1000 / 16)).sum()) < 50  # chi-square, 15 degrees of freedom


def nodes_of(state, kind):
    """The nodes of type ``kind`` inside ``state``, in order."""
    found = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, kind), none_is_leaf=True)
    return [x for x in found if isinstance(x, kind)]


def adam_moments(state):
    (moments,) = nodes_of(state, fb.ScaleByAdamState)
    return moments


def problem(n=5000, steps=6, seed=4):
    gen = seeded(seed)
    params = {"w": torch.randn(n // 50, 50, generator=gen), "b": torch.randn(50, generator=gen), "s": torch.tensor(0.5)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(steps)]
    return params, grads


@pytest.mark.parametrize("codec", CODECS)
def test_each_update_is_the_inners_on_the_decoded_state(codec):
    """A second path: decode the stored state by hand, run the inner transform on it; the
    wrapper's updates are those, and its new state is theirs encoded."""
    params, grads = problem()
    inner = fb.adamw(1e-2, weight_decay=0.1)
    tx = fb.low_precision_state(inner, codec, seed=3, min_size=1000)
    settings = dict(codec=codec, block_size=256, min_size=1000, seed=3)
    state = tx.init(params)
    for g in grads:
        want_updates, want_inner = inner.update(g, lp.decoded(state.inner), params)
        updates, new_state = tx.update(g, state, params)
        assert_trees_close(updates, want_updates, tol=0)
        want_stored = lp.encoded(want_inner, state.count + 1, **settings)
        assert_trees_close(fb.state_dict(new_state.inner), fb.state_dict(want_stored), tol=0)
        params, state = fb.apply_updates(params, updates), new_state
    assert isinstance(adam_moments(state).mu["w"], STORED[codec])
    # and the decoded state stays near the float32 run's
    want_params, _ = run_updates(inner, *problem())
    assert_trees_close(params, want_params, tol=0.05 if codec == "8bit" else 0.01)


def test_what_is_stored_how():
    """8-bit: Adam's first moment signed, its second unsigned, 1 byte per value plus a float32
    scale per block; tensors under min_size and the counts kept; bf16: 2 bytes per value."""
    params, grads = problem()
    state = fb.low_precision_state(fb.adam(1e-3), "8bit", block_size=128).init(params)
    adam = adam_moments(state)
    assert isinstance(adam.mu["w"], fb.Signed8bit) and isinstance(adam.nu["w"], fb.Unsigned8bit)
    assert adam.mu["w"].codes.dtype == torch.uint8 and adam.mu["w"].codes.shape == params["w"].shape
    assert adam.mu["w"].scales.shape == (math.ceil(params["w"].numel() / 128),)
    assert adam.mu["b"].dtype == torch.float32 and adam.count["w"].dtype == torch.int64  # 50 < 4096 values
    bf16 = adam_moments(fb.low_precision_state(fb.adam(1e-3), "bf16").init(params))
    assert bf16.mu["b"].value.dtype == torch.bfloat16 and bf16.mu["s"].dtype == torch.float32  # 0-dim: kept


@pytest.mark.parametrize("codec", CODECS)
def test_a_checkpoint_mid_run_resumes_bit_for_bit(codec):
    params, grads = problem()
    tx = fb.low_precision_state(fb.adamw(1e-2), codec, seed=5)
    want, _ = run_updates(tx, params, grads)
    got, saved = run_resumed(tx, params, grads, at=3)
    assert any(v.dtype in (torch.bfloat16, torch.uint8) for v in saved.values())
    assert_trees_close(got, want, tol=0)


def test_a_compressed_checkpoint_is_refused_by_a_float32_state_and_the_other_way_round():
    params, _ = problem()
    compressed = fb.state_dict(fb.low_precision_state(fb.adamw(1e-2), "8bit").init(params))
    plain = fb.state_dict(fb.adamw(1e-2).init(params))
    with pytest.raises(ValueError, match="stores state tensors as 8-bit codes, this optimizer as plain tensors"):
        fb.load_state_dict(fb.adamw(1e-2).init(params), compressed)
    with pytest.raises(ValueError, match="stores state tensors as plain tensors, this optimizer as 8-bit codes"):
        fb.load_state_dict(fb.low_precision_state(fb.adamw(1e-2), "8bit").init(params), plain)
    bf16 = fb.state_dict(fb.low_precision_state(fb.adamw(1e-2), "bf16").init(params))
    corrected = fb.low_precision_state(fb.adamw(1e-2), "bf16+8bit").init(params)
    with pytest.raises(
        ValueError, match="as bfloat16, this optimizer as bfloat16 with 8-bit corrections.*strict=False would"
    ):
        fb.load_state_dict(corrected, bf16)
    # parameters named like the encoded parts are not taken for another codec
    for name in ("value", "correction", "codes"):
        grown = fb.adamw(1e-2).init({**params, name: torch.zeros(3)})
        with pytest.raises(ValueError, match="pass strict=False") as refused:
            fb.load_state_dict(grown, plain)
        assert "low_precision_state" not in str(refused.value)


@pytest.mark.parametrize(
    "cap, compiled",
    [(None, False), (1300, False), (None, True), (1300, True)],
    ids=["one-pass", "passes-of-1300-values", "one-compiled-pass", "compiled-passes-of-1300-values"],
)
@pytest.mark.parametrize("codec", CODECS)
def test_tensors_coded_in_one_pass_are_each_coded_as_alone(codec, cap, compiled, monkeypatch):
    """Eagerly the tensors of a state are coded back to back in one pass (or passes of at most
    ``BATCH_VALUES`` values), op by op or by compiled kernels, and decoded so: each leaf's code
    (and value decoded) is its own, written out per tensor: bf16 with the bits of its values'
    places in the stream (counted through the coded tensors in order), 8 bits in its own blocks
    (a tensor whose last block is short too), Adam's second moment with the unsigned map."""
    if cap is not None:
        monkeypatch.setattr(lp, "KERNEL_BATCH_VALUES" if compiled else "BATCH_VALUES", cap)
    gen = seeded(8)
    shapes = [(16, 32), (3, 256), (700,), (8, 64), (5,)]  # 512, 768, 700 (short last block), 512, 5 values
    params = {f"p{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    state = fb.scale_by_adam().init(params)
    state = state._replace(
        mu={k: torch.randn(v.shape, generator=gen) for k, v in params.items()},
        nu={k: torch.rand(v.shape, generator=gen) for k, v in params.items()},
    )
    count, seed, block = torch.tensor(7), 11, 256
    coded = lp.encoded(state, count, codec=codec, block_size=block, min_size=1, seed=seed, compiled=compiled)
    leaves, fields = zip(*lp._leaves_and_fields(state)[0])
    stored = optree.tree_leaves(coded, is_leaf=lambda x: isinstance(x, lp.ENCODED), none_is_leaf=True)
    stream = lp.rounding_stream(seed, count, lp.STATE_STREAM)
    place = 0  # in the stream: the values coded before this tensor's
    for number, (x, field, code) in enumerate(zip(leaves, fields, stored)):
        if x.dim() == 0:
            assert code is x
            continue
        if codec == "bf16":
            bits = fb.random_bits16(x.shape, stream, x.device, start=place)
            want = (fb.stochastic_round_to_bfloat16(x, bits),)
        elif codec == "8bit":
            want = fb.quantize_blockwise(x, block, signed=field != "nu")
        else:
            want = fb.bfloat16_corrected(x)
        assert len(code) == len(want) and all(torch.equal(a, b) for a, b in zip(code, want)), (codec, number)
        place += x.numel()
    passes: dict = {}  # the sizes of the tensors coded in each pass (one storage each)
    for c in stored:
        if isinstance(c, lp.ENCODED):
            passes.setdefault(c[0].untyped_storage().data_ptr(), []).append(c[0].numel())
    assert max(len(sizes) for sizes in passes.values()) > 1, passes
    assert cap is None or all(sum(sizes) <= cap or len(sizes) == 1 for sizes in passes.values()), passes
    decoded = optree.tree_leaves(lp.decoded(coded, block, compiled), none_is_leaf=True)
    for code, value in zip(stored, decoded):
        if isinstance(code, fb.Bfloat16Stored):
            want = code.value.float()
        elif isinstance(code, fb.Bfloat16Corrected):
            want = fb.bfloat16_uncorrected(code.value, code.correction)
        elif isinstance(code, (fb.Signed8bit, fb.Unsigned8bit)):
            want = fb.dequantize_blockwise(code.codes, code.scales, isinstance(code, fb.Signed8bit), block)
        else:
            want = code
        assert torch.equal(value, want)


def _optimizer_run(codec, compile_codecs, steps=4):
    """Parameters and saved state after ``fb.Optimizer`` steps of AdamW with its state in
    ``codec``, and the state's tensors before the last step: several tensors coded together,
    one whose last 8-bit block is short, one below the 8-bit ``min_size`` (kept in float32)."""
    gen = seeded(21)
    shapes = [(64, 128), (3, 1000), (40, 70), (100,), (64, 64)]  # 8192, 3000 (short), 2800, 100, 4096 values
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = fb.Optimizer(
        params, fb.low_precision_state(fb.adamw(1e-2), codec, min_size=2000, compile_codecs=compile_codecs)
    )
    held = []
    for _ in range(steps):
        held = [t for t in optree.tree_leaves(opt.state_dict()["state"]) if isinstance(t, torch.Tensor)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params], opt.state_dict(), held


@pytest.mark.parametrize("codec", CODECS)
def test_codecs_by_compiled_kernels_step_as_the_codecs_op_by_op(codec):
    """Eagerly, the codecs by compiled kernels (the default) against op by op
    (``compile_codecs=False``): the same parameters and stored state, bit for bit; the state's
    tensors the last step decoded are not marked for dynamo (the kernels take new tensor
    objects: the caller's own compile of them would be changed)."""
    want_params, want_state, _ = _optimizer_run(codec, compile_codecs=False)
    got_params, got_state, held = _optimizer_run(codec, compile_codecs=True)
    assert not compiling._KERNEL_FAILURES and compiling._KERNELS  # the kernels ran, compiled
    assert_trees_equal(got_params, want_params)
    assert_trees_equal(got_state, want_state)
    assert held and not any(hasattr(t, "_dynamo_weak_dynamic_indices") for t in held + got_params)
    # their compiles serve other sizes: an update on other shapes compiles none of them again
    with torch.compiler.set_stance("fail_on_recompile"):
        gen = seeded(3)
        for shapes in ([(50, 90), (33, 1000)], [(7, 512), (4097,)]):
            tx = fb.low_precision_state(fb.adamw(1e-2), codec, min_size=2000)
            params = {str(i): torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
            state = tx.init(params)
            tx.update({k: torch.randn(v.shape, generator=gen) for k, v in params.items()}, state, params)


def test_the_decoded_state_is_stepped_in_place_only_when_given_up(monkeypatch):
    """The inner transform steps the decoded state in its own tensors where the caller gave the
    state up (fb.Optimizer): the same bits as the pure update, and its new moments lie back to
    back as decoded, coded again without a copy; a pure update leaves the state it is given
    untouched, the tensors kept in float32 (below min_size) too."""
    spans = []  # per float32 run to code: whether it was found back to back in one storage

    def spying(tensors):
        found = span(tensors)
        if tensors[0].dtype == torch.float32:
            spans.append(found is not None)
        return found

    monkeypatch.setattr(lp, "span", spying)
    gen = seeded(5)  # no 0-dim tensor: in a group it would keep Adam's steps out of place
    params = {"w": torch.randn(100, 50, generator=gen), "v": torch.randn(30, 40, generator=gen), "b": torch.randn(50)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(4)]
    tx = fb.low_precision_state(fb.adam(1e-2), "bf16", min_size=100)  # "b" (50 values) stays float32
    state_pure = tx.init(params)
    state_given = tx.init(params)
    for g in grads:
        before = fb.state_dict(state_pure)
        copy = {k: v.clone() for k, v in before.items()}
        spans.clear()
        want, state_pure_next = tx.update(g, state_pure, params)
        assert_trees_equal(before, copy)  # untouched
        assert spans == [False]  # the moments (one run, coded in one pass), new tensors: copied to be coded
        spans.clear()
        got, state_given = ownership.update_giving_state(tx, g, state_given, params)
        assert spans == [True]  # the decoded tensors, stepped in place: coded where they lie
        assert_trees_equal(got, want)
        assert_trees_equal(fb.state_dict(state_given), fb.state_dict(state_pure_next))
        state_pure = state_pure_next
        params = fb.apply_updates(params, want)


def test_codecs_fall_back_to_op_by_op_with_a_warning_where_inductor_cannot_compile(monkeypatch):
    """A backend that fails (as inductor without a C++ compiler does) raises
    ``BackendCompilerFailed`` at the kernel's first call: a warning saying so, and the codec op by
    op from then on, with the same numbers."""

    def no_compiler(gm, example_inputs, **options):  # options: what compile_own passes on a GPU
        raise RuntimeError("no C++ compiler here")

    failing = lambda fn, **kwargs: torch.compile(fn, backend=no_compiler, **kwargs)  # noqa: E731
    monkeypatch.setattr(compiling, "compile_own", failing)
    monkeypatch.setattr(compiling, "_KERNELS", {})
    monkeypatch.setattr(compiling, "_KERNEL_FAILURES", {})
    want_params, want_state, _ = _optimizer_run("bf16", compile_codecs=False)
    with pytest.warns(
        RuntimeWarning, match=f"could not compile stochastically_rounded_from on {DEVICE.type} here.*no C.. compiler"
    ):
        got_params, got_state, _ = _optimizer_run("bf16", compile_codecs=True)
    assert_trees_equal(got_params, want_params)
    assert_trees_equal(got_state, want_state)


@pytest.mark.parametrize("codec", CODECS)
def test_the_compiled_update_is_the_eager_one(codec):
    """Traced whole (fullgraph) by dynamo and AOT autograd (aot_eager: the same ops, no
    code generation), the same bits as eager: the rounding's random bits are integer
    arithmetic of the seed and the count, no generator state."""
    params, grads = problem(n=5000, steps=3)
    tx = fb.low_precision_state(fb.adamw(1e-2), codec)
    want, want_state = run_updates(tx, params, grads)
    compiled = torch.compile(tx.update, fullgraph=True, backend="aot_eager")
    state = tx.init(params)
    for g in grads:
        updates, state = compiled(g, state, params)
        params = fb.apply_updates(params, updates)
    assert_trees_close(params, want, tol=0)
    assert_trees_close(fb.state_dict(state), fb.state_dict(want_state), tol=0)


def test_fused_state_is_stored_per_block_of_the_flat_buffer():
    """Inside fb.fuse the inner state is one flat buffer per dtype: 8 bits code it in blocks of
    the buffer, and the fused run tracks the float32 state's run."""
    params, grads = problem()
    layout = fb.FlatLayout.of(params)
    fused = fb.fuse(fb.low_precision_state(fb.adam(1e-2), "8bit", block_size=256), layout)
    flat = layout.flatten(params)
    state = fused.init(flat)
    (mu,) = adam_moments(state).mu.values()
    assert isinstance(mu, fb.Signed8bit) and mu.codes.numel() == sum(p.numel() for p in params.values())
    assert mu.scales.numel() == math.ceil(mu.codes.numel() / 256)
    for g in grads:
        updates, state = fused.update(layout.flatten(g), state, flat)
        flat = fb.apply_updates(flat, updates)
    want, _ = run_updates(fb.adam(1e-2), params, grads)
    assert_trees_close(layout.unflatten(flat), want, tol=5e-2)


@pytest.mark.parametrize("codec", CODECS)
def test_fuse_inplace_writes_the_fused_updates_state_into_the_buffers(codec):
    """fuse_inplace, eager and traced whole (aot_eager: the graph inductor would compile), steps
    the flat buffers and the encoded state in place to the bits of the pure fused update."""
    params, grads = problem(steps=3)
    layout = fb.FlatLayout.of(params)
    make = lambda: fb.low_precision_state(fb.adam(1e-2), codec, min_size=1, block_size=64)  # noqa: E731
    fused = fb.fuse(make(), layout)
    want = layout.flatten(params)
    want_state = fused.init(want)
    for g in grads:
        updates, want_state = fused.update(layout.flatten(g), want_state, want)
        want = fb.apply_updates(want, updates)
    for kernel, options in (("eager", None), ("compiled", {"backend": "aot_eager"})):
        step_ = fb.fuse_inplace(make(), layout, kernel=kernel, compile_options=options)
        flat = layout.flatten(params)
        state = step_.init(flat)
        for g in grads:
            step_(layout.flatten(g), state, flat)
        assert_trees_close(flat, want, tol=0)
        assert_trees_close(fb.state_dict(state), fb.state_dict(want_state), tol=0)


def test_fb_optimizer_steps_and_saves_the_compressed_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = fb.Optimizer(model.parameters(), fb.low_precision_state(fb.adamw(1e-2), "bf16"))
    x, y = torch.randn(256, 100), torch.randn(256, 1)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    saved = {k: v for k, v in opt.state_dict().items()}
    stored = [t for entries in saved["state"].values() for t in entries.values() if isinstance(t, torch.Tensor)]
    assert any(t.dtype == torch.bfloat16 for t in stored)
    saved = __import__("copy").deepcopy(saved)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    def go_on(optimizer):
        for _ in range(5):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    uninterrupted = go_on(opt)
    model.load_state_dict(weights)
    resumed_opt = fb.Optimizer(model.parameters(), fb.low_precision_state(fb.adamw(1e-2), "bf16"))
    resumed_opt.load_state_dict(saved)
    resumed = go_on(resumed_opt)
    assert_trees_close(resumed, uninterrupted, tol=0)


def test_bad_input_is_refused_with_the_way_out():
    params, grads = problem()
    with pytest.raises(ValueError, match="codec must be one of"):
        fb.low_precision_state(fb.adam(), "int4")
    with pytest.raises(ValueError, match="block_size must be an int >= 2"):
        fb.low_precision_state(fb.adam(), "8bit", block_size=0)
    with pytest.raises(ValueError, match="holds a torch.int64 tensor"):
        fb.low_precision_state(fb.adam(), "bf16", fields=("count", "mu")).init(params)
    complex_params = {"z": torch.randn(64, 64, dtype=torch.complex64)}
    kept = adam_moments(fb.low_precision_state(fb.adam(), "bf16").init(complex_params))
    assert kept.mu["z"].dtype == torch.complex64  # by default complex state is kept as it is
    with pytest.raises(ValueError, match="holds a torch.complex64 tensor"):
        fb.low_precision_state(fb.adam(), "bf16", fields=("mu",)).init(complex_params)
    with pytest.raises(ValueError, match=r"fields names \['m'\], which the inner state does not have"):
        fb.low_precision_state(fb.adam(), "bf16", fields=("m", "nu")).init(params)
    with pytest.raises(ValueError, match="a sequence of field names, got the string"):
        fb.low_precision_state(fb.adam(), "bf16", fields="mu")
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\^31\)"):
        fb.low_precision_state(fb.adam(), "bf16", seed=2**62)
    codes, scales = fb.quantize_blockwise(torch.randn(1000), block_size=256)
    with pytest.raises(ValueError, match="pass the block_size the codes were made with"):
        fb.dequantize_blockwise(codes, scales, block_size=100)
    with pytest.raises(TypeError, match="must be float32"):
        fb.stochastic_round_to_bfloat16(torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected LowPrecisionState"):
        fb.low_precision_state(fb.adam(), "bf16").update(grads[0], fb.adam().init(params), params)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_every_alias_runs_on_its_decoded_state(alias, codec):
    """Around each alias: each update is the alias's own on the decoded state, and every float32
    state tensor of at least one dimension (and min_size values) is stored encoded."""
    params = {"w": torch.randn(8, 16, generator=seeded(6)), "v": torch.randn(16, 4, generator=seeded(7))}
    grads = [{k: torch.randn(v.shape, generator=seeded(10 + t)) for k, v in params.items()} for t in range(3)]
    inner = alias(**RICH_SETTINGS.get(alias, {}))
    tx = fb.low_precision_state(inner, codec, min_size=16)
    state = tx.init(params)
    for g in grads:
        want, _ = inner.update(g, lp.decoded(state.inner), params)
        updates, state = tx.update(g, state, params)
        assert_trees_close(updates, want, tol=0)
        params = fb.apply_updates(params, updates)
    plain = [t for t in optree.tree_leaves(inner.init(params)) if isinstance(t, torch.Tensor)]
    encodable = [t for t in plain if t.dtype == torch.float32 and t.dim() > 0 and t.numel() >= 16]
    stored = nodes_of(state, (fb.Bfloat16Stored, fb.Signed8bit, fb.Unsigned8bit, fb.Bfloat16Corrected))
    assert len(stored) == len(encodable)


def test_the_rounding_bits_are_the_same_compiled_by_inductor():
    """The hash's 64-bit products wrap and its shifts are logical in inductor's generated code as
    eagerly: the same random bits and the same rounding, for sizes that fill whole vectors and
    sizes that leave a tail (where inductor once vectorized an index times a large constant
    wrongly)."""

    def rounded(x, seed):  # from a later index of the stream
        return fb.stochastic_round_to_bfloat16(x, fb.random_bits16(x.shape, seed, x.device, start=1000))

    seed = torch.tensor(123456789, dtype=torch.int64)
    compiled = torch.compile(rounded, fullgraph=True, dynamic=True)  # one compile for the sizes
    for size in (4096, 4099, 37):
        x = torch.randn(size, generator=seeded(8))
        assert torch.equal(compiled(x, seed), rounded(x, seed)), size
    x = torch.randn(4099, generator=seeded(9))  # the kernel eager steps code with, sizes symbolic
    start = torch.tensor(77, dtype=torch.int64)
    for n in (4099, 37, 4096):
        want = lp.stochastically_rounded_from(x[:n], start, seed)
        assert torch.equal(compiling.run_compiled(lp.stochastically_rounded_from, x[:n], start, seed), want), n


def test_a_callers_fail_on_recompile_stance_does_not_fail_the_codecs_kernels():
    """A training loop that sets ``torch.compiler.set_stance("fail_on_recompile")`` for its own
    compiled step (under which dynamo refuses even a first compile): an optimizer step whose
    codec kernel is not compiled yet (8 bits in blocks of 96, a kernel of its own) and a kernel
    meeting a new shape class (2-D after 1-D) compute eagerly instead of raising, the same bits
    as a run that never compiles; the caller's stance still holds for its own functions."""

    def run(start, stance):
        params = [torch.nn.Parameter(start.clone())]
        opt = fb.Optimizer(params, fb.low_precision_state(fb.adamw(1e-2), "8bit", block_size=96, min_size=1))
        with torch.compiler.set_stance(stance):
            for _ in range(2):
                params[0].grad = torch.ones_like(start)
                opt.step()
        return params[0].detach()

    start = torch.randn(700, generator=seeded(12))
    assert torch.equal(run(start, "fail_on_recompile"), run(start, "force_eager"))

    def doubled(x):
        return x * 2

    own = torch.compile(doubled)
    own(torch.ones(3))
    compiling.run_compiled(_twice_plus, torch.ones(3), torch.ones(3))
    with torch.compiler.set_stance("fail_on_recompile"):
        x, y = torch.randn(4, 5, generator=seeded(13)), torch.randn(4, 5, generator=seeded(14))
        assert torch.equal(compiling.run_compiled(_twice_plus, x, y), _twice_plus(x, y))  # a new shape class
        with pytest.raises(RuntimeError, match="fail_on_recompile"):
            own(torch.ones(2, 2, dtype=torch.float64))  # the caller's own recompile still fails


def _twice_plus(x, y):
    return x * 2 + y


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_each_aliass_state_decodes_close_to_what_was_encoded(alias):
    """After some steps, every encoded tensor decodes within the codec's precision of the float32
    tensor it came from (a field coded unsigned that held negative values would come back 0)."""
    params = {"w": torch.randn(64, 64, generator=seeded(9)), "v": torch.randn(64, 32, generator=seeded(10))}
    inner = alias(**RICH_SETTINGS.get(alias, {}))
    state = inner.init(params)
    for t in range(3):
        grads = {k: torch.randn(v.shape, generator=seeded(20 + t)) for k, v in params.items()}
        _, state = inner.update(grads, state, params)
    for codec in CODECS:
        settings = dict(codec=codec, block_size=64, min_size=1, seed=0)
        back = lp.decoded(lp.encoded(state, torch.tensor(3), **settings), block_size=64)
        for got, want in zip(optree.tree_leaves(back), optree.tree_leaves(state)):
            if isinstance(want, torch.Tensor) and want.dtype == torch.float32 and want.dim() > 0:
                if codec == "bf16":  # within one bfloat16 step of the value: 2^-7 of it
                    bound = want.abs() * 2**-7
                elif codec == "bf16+8bit":  # within 1/254 of half a step, and float32's rounding
                    bound = want.abs() * (2**-8 / 254 + 2**-23)
                else:  # within half the map's largest gap (0.9 / 64) times the block's scale
                    blocks = lp._blocks(want.abs(), 64).amax(dim=1)
                    bound = 0.0071 * blocks.repeat_interleave(64)[: want.numel()].view(want.shape)
                assert bool(((got - want).abs() <= bound).all()), (codec, alias.__name__)


def test_bfloat16_with_its_correction_is_the_nearest_bfloat16_plus_its_error_in_8_bits():
    """The rule written out: ``b`` the nearest bfloat16 of ``x``, ``h`` half the bfloat16 step at
    ``b`` (from frexp), ``c = round(127 (x - b) / h)``; decoded ``b + c h / 127``, within
    ``h / 254`` of ``x`` (and float32's rounding): about 250 times closer than ``b`` alone."""
    gen = seeded(11)
    x = torch.randn(20000, generator=gen) * torch.exp(torch.randn(20000, generator=gen) * 8)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -2.0, 3.4e38, float("inf"), float("-inf"), 1e-39, -3e-41])])
    value, correction = fb.bfloat16_corrected(x)
    b = x.to(torch.bfloat16)
    _, exponent = torch.frexp(b.to(torch.float32))  # b = m 2^exponent, 0.5 <= |m| < 1
    exponent = torch.where(b == 0, -125, exponent)  # at 0, the smallest normal numbers' step
    h = torch.ldexp(torch.ones_like(x), torch.clamp(exponent, min=-125) - 9)  # half of 2^(exponent - 8)
    finite = torch.isfinite(b)
    want = torch.where(finite, torch.round(127 * (x - b.to(torch.float32)) / h).clamp(-127, 127), 0)
    assert torch.equal(value, b) and value.dtype == torch.bfloat16
    assert correction.dtype == torch.int8 and torch.equal(correction.to(torch.float32), want)
    back = fb.bfloat16_uncorrected(value, correction)
    assert bool(((back - x).abs()[finite] <= (h / 254 + x.abs() * 2**-23)[finite]).all())
    assert torch.equal(back[~finite], x.to(torch.bfloat16).to(torch.float32)[~finite])  # inf, and 3.4e38 -> inf
    errors = (back - x).abs()[finite & (x != 0)] / x.abs()[finite & (x != 0)]
    plain = (b.to(torch.float32) - x).abs()[finite & (x != 0)] / x.abs()[finite & (x != 0)]
    assert errors.max() < plain.max() / 200


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_rounding_to_nearest_on_the_bits_is_torchs_conversion_eager_and_compiled(dtype):
    """``round_to_nearest(x, dtype)`` against torch's ``x.to(dtype).to(float32)`` (eager) on
    values of every magnitude, random bit patterns (NaNs among them), ties, subnormals and the
    overflow boundary; compiled by inductor (which folds the plain conversion away: the kernel
    ``master_weights`` runs eagerly, ``run_compiled``) the same."""
    gen = seeded(14)
    scaled = torch.randn(50000, generator=gen) * 10.0 ** torch.randint(-12, 6, (50000,), generator=gen)
    raw = torch.randint(-(2**31), 2**31 - 1, (50000,), generator=gen, dtype=torch.int32).view(torch.float32)
    edges = [65504.0, 65519.99, 65520.0, 1e9, 3.4e38, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1.0 + 2.0**-8]
    edges += [1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 0.0, float("inf"), float("nan")]
    x = torch.cat([scaled, raw, torch.tensor(edges), -torch.tensor(edges)])
    want = x.to(dtype).to(torch.float32)

    def same(a: torch.Tensor) -> bool:
        return bool(((a.view(torch.int32) == want.view(torch.int32)) | (a.isnan() & want.isnan())).all())

    assert same(lp.round_to_nearest(x, dtype))
    assert same(compiling.run_compiled(lp.round_to_nearest, x, static=(dtype,)))
    assert "cpu" not in compiling._KERNEL_FAILURES  # the kernel was compiled, not computed eagerly


def test_the_correction_is_the_same_compiled_by_inductor():
    """Inductor folds ``x.to(bfloat16).to(float32)`` back into ``x``; the codec widens the
    bfloat16 value by its bits, so the compiled corrections (and decoded values) are eager's."""
    x = torch.randn(4096, generator=seeded(12)) * torch.exp(torch.randn(4096, generator=seeded(13)) * 4)
    want = fb.bfloat16_corrected(x)
    got = torch.compile(fb.bfloat16_corrected, fullgraph=True)(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and bool((want[1] != 0).any())
    decoded = torch.compile(fb.bfloat16_uncorrected, fullgraph=True)(*want)
    assert torch.equal(decoded, fb.bfloat16_uncorrected(*want))


def test_the_correction_keeps_the_increments_bfloat16_rounds_away():
    """Adam's second moment of a constant gradient, v_t = 1 - b2^t with b2 = 0.999: each step
    adds 0.001 (1 - v), below half a bfloat16 step near 0.5, which rounding to nearest alone
    would drop; with the correction the stored v follows float32's within 1e-4."""
    params = {"w": torch.zeros(4096)}
    grads = [{"w": torch.ones(4096)}] * 800
    _, state = run_updates(fb.low_precision_state(fb.adam(1e-3, betas=(0.9, 0.999)), "bf16+8bit"), params, grads)
    nu = lp.decoded(adam_moments(state).nu)["w"]
    assert torch.allclose(nu, torch.full((4096,), 1 - 0.999**800), rtol=1e-4)
