"""functional_bagua.distributed on 2 and 4 gloo ranks (spawned, loopback) against single-process
references, torch's PostLocalSGDOptimizer, Bagua's shift_one peers and the compression formulas."""

from __future__ import annotations

import os
import subprocess
import sys

import dist_scenarios as sc
import pytest
import torch
import torch.distributed as dist
from dist_harness import PROCESS_GROUP_TIMEOUT_S, ScenarioError, run_ranks

import functional_bagua as fb
import functional_bagua.distributed as fbd
from functional_bagua.distributed.compression import padded_chunks

pytestmark = pytest.mark.cpu_only("spawned gloo ranks on the CPU (CUDA ranks: test_cuda_distributed.py)")

TWO_RANKS = [
    "allreduce_sgd",
    "allreduce_adamw",
    "first_order_wrapped",
    "shard_adamw",
    "shard_low_precision",
    "shard_lamb_refused",
    "shard_clip_refused",
    "shard_prodigy_refused",
    "periodic_average",
    "compressed_fp16",
    "compressed_bf16",
    "compressed_minmax_uint8",
    "mismatched_shapes",
    *[f"mismatched_{name}" for name in sc.MISMATCHED_SETTINGS],
    "different_values_allreduce",
    "different_values_shard",
    "different_values_broadcast_first",
    "shard_checkpoint_of_another_rank",
    "averaging_wrong_update",
    "train_step_overlapped",
]
FOUR_RANKS = [
    "allreduce_sgd",
    "decentralized_shift_one",
    "decentralized_all_every_2",
    "train_step_overlapped",
]
COMPILED = [
    "compiled_allreduce_adamw",
    "compiled_allreduce_minmax_uint8",
    "compiled_shard_adamw",
    "compiled_shard_by_tensor_lamb",
    "compiled_periodic_average",
    "compiled_shift_one",
    "compiled_train_step_overlapped",
]
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: only the summation order differs


@pytest.fixture(scope="module")
def two():
    return run_ranks(2, TWO_RANKS)


@pytest.fixture(scope="module")
def four():
    return run_ranks(4, FOUR_RANKS)


def ok(result):
    assert not isinstance(result, ScenarioError), f"scenario raised {result}"
    return result


def assert_trees_close(actual, expected, **tol):
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **(tol or TOL), msg=lambda m: f"{name}: {m}")


# --- N ranks x batch b == 1 process x batch N*b -----------------------------------------------------


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_two_ranks_with_allreduce_equal_one_process_with_the_global_batch(two, name):
    expected, _ = sc.train(sc.TXS[name](), sc.global_batches())
    for rank in range(2):
        assert_trees_close(ok(two[rank][f"allreduce_{name}"]), expected)


@pytest.mark.parametrize("name", list(sc.FIRST_ORDER))
def test_newer_first_order_optimizers_run_unchanged_inside_allreduce_and_shard(two, name):
    """Schedule-free AdamW, ADOPT, AdEMAMix and Prodigy after allreduce_gradients, and the
    elementwise ones inside shard: the parameters of one process on the global batch."""
    make, shardable = sc.FIRST_ORDER[name]
    expected, _ = sc.train(make(), sc.global_batches())
    for rank in range(2):
        got = ok(two[rank]["first_order_wrapped"])
        assert_trees_close(got[f"allreduce {name}"], expected)
        if shardable:
            assert_trees_close(got[f"shard {name}"], expected)


def test_four_ranks_with_allreduce_equal_one_process_with_the_global_batch(four):
    expected, _ = sc.train(sc.TXS["sgd"](), sc.global_batches())
    for rank in range(4):
        assert_trees_close(ok(four[rank]["allreduce_sgd"]), expected)


def test_shard_adamw_equals_adamw_unsharded_with_half_the_state_per_rank(two):
    expected, full_state = sc.train(sc.TXS["adamw"](), sc.global_batches())
    full_bytes = sc.state_bytes(full_state)
    for rank in range(2):
        params, shard_bytes = ok(two[rank]["shard_adamw"])
        assert_trees_close(params, expected)
        # the moments (2 x params) are halved; the step count (8 bytes) is per rank
        assert shard_bytes <= full_bytes / 2 + 64, (shard_bytes, full_bytes)


@pytest.mark.parametrize("codec", list(sc.LOW_PRECISION))
def test_shard_keeps_each_ranks_state_compressed_as_low_precision_state_on_that_shard_alone(two, codec):
    """shard(low_precision_state(adamw)): each rank's state is its shard's, encoded (8 bits in
    blocks that start at the shard, a short last one included; bfloat16 with the rounding stream
    of the shard's buffer): bit for bit what low_precision_state gives one process stepping that
    shard of the flat buffer alone on the ranks' mean gradient."""
    runs = [ok(two[rank]["shard_low_precision"])[codec] for rank in range(2)]
    initial = runs[0][2]
    layout = fb.FlatLayout.of(initial)
    chunks = {
        rank: {k: padded_chunks(b, 2)[rank].clone() for k, b in layout.flatten(initial).items()} for rank in range(2)
    }
    tx = sc.LOW_PRECISION[codec]()
    states = {rank: tx.init(chunks[rank]) for rank in range(2)}
    for step in range(sc.STEPS):
        flat = [layout.flatten(runs[rank][1][step]) for rank in range(2)]
        mean = {k: (padded_chunks(flat[0][k], 2) + padded_chunks(flat[1][k], 2)) / 2 for k in flat[0]}
        for rank in range(2):
            updates, states[rank] = tx.update({k: m[rank] for k, m in mean.items()}, states[rank], chunks[rank])
            chunks[rank] = fb.apply_updates(chunks[rank], updates)
    expected = layout.unflatten(
        {k: torch.cat([chunks[0][k], chunks[1][k]])[: layout.groups[k].numel] for k in chunks[0]}
    )
    for rank in range(2):
        params, _, _, stored = runs[rank]
        assert stored == (["Bfloat16Stored"] if codec == "bf16" else ["Signed8bit", "Unsigned8bit"])
        for name in expected:
            assert torch.equal(params[name], expected[name]), (codec, rank, name)


def test_shard_refuses_per_tensor_rules_and_global_norms(two):
    for rank in range(2):
        error = two[rank]["shard_lamb_refused"]
        assert isinstance(error, ScenarioError) and error.type == "NotImplementedError"
        assert "per-tensor rule cannot run inside shard()" in error.message
        error = two[rank]["shard_clip_refused"]
        assert isinstance(error, ScenarioError) and error.type == "NotImplementedError"
        assert "clip_by_global_norm cannot run inside shard(): the norm of one shard" in error.message
        error = two[rank]["shard_prodigy_refused"]  # its step size sums over all of every tensor
        assert isinstance(error, ScenarioError) and error.type == "NotImplementedError"
        assert "scale_by_prodigy cannot run inside shard(): its step size d sums" in error.message


# --- model averaging ----------------------------------------------------------------------------------


def test_periodic_average_equals_torch_post_local_sgd(two):
    for rank in range(2):
        expected, actual, local_only = ok(two[rank]["periodic_average"])
        assert_trees_close(actual, expected)
        assert not torch.allclose(local_only["fc.weight"], expected["fc.weight"])  # averaging did something
    torch.testing.assert_close(two[0]["periodic_average"][1]["fc.weight"], two[1]["periodic_average"][1]["fc.weight"])


SHIFT_ONE_PEERS_4 = [{0: 2, 1: 3, 2: 0, 3: 1}, {0: 3, 1: 2, 2: 1, 3: 0}]  # Bagua's pairs, rounds 0 and 1


def test_shift_one_peers_are_baguas():
    for s in range(6):
        assert [fbd.peer_of(r, 4, s) for r in range(4)] == [SHIFT_ONE_PEERS_4[s % 2][r] for r in range(4)]
    for n in (2, 6, 8):
        for s in range(5):
            peers = [fbd.peer_of(r, n, s) for r in range(n)]
            assert all(peers[peers[r]] == r and (peers[r] < n // 2) != (r < n // 2) for r in range(n)), (n, s, peers)


def transitions(results, name):
    """Per step ``t``: per rank ``(params_t, grads_t, params_t+1)`` of a decentralized run."""
    runs = [ok(results[r][name]) for r in range(len(results))]
    return [
        [(trace[t][0], trace[t][1], trace[t + 1][0] if t + 1 < len(trace) else final) for trace, final in runs]
        for t in range(len(runs[0][0]))
    ]


def test_decentralized_shift_one_averages_with_baguas_peer_then_adds_the_local_step(four):
    for t, ranks in enumerate(transitions(four, "decentralized_shift_one")):
        for r, (p, g, after) in enumerate(ranks):
            peer_p = ranks[SHIFT_ONE_PEERS_4[t % 2][r]][0]
            assert_trees_close(after, {k: (p[k] + peer_p[k]) / 2 - sc.LR * g[k] for k in p})


def test_decentralized_all_is_the_mean_of_ranks_on_communication_steps(four):
    for t, ranks in enumerate(transitions(four, "decentralized_all_every_2")):
        for p, g, after in ranks:
            base = {k: sum(q[k] for q, _, _ in ranks) / 4 for k in p} if t % 2 == 0 else p
            assert_trees_close(after, {k: base[k] - sc.LR * g[k] for k in p})


# --- compression ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_cast_compression_is_within_the_cast_error(two, compression, dtype):
    (g0, u0), (g1, u1) = ok(two[0][f"compressed_{compression}"]), ok(two[1][f"compressed_{compression}"])
    eps = torch.finfo(dtype).eps
    for k in g0:
        exact = (g0[k].double() + g1[k].double()) / 2
        bound = 2 * eps * (g0[k].abs() + g1[k].abs()).double() / 2 + 1e-7
        assert ((u0[k].double() - exact).abs() <= bound).all(), k
        assert not torch.equal(u0[k].double(), exact), "no rounding at all: was it compressed?"
        torch.testing.assert_close(u0[k], u1[k], rtol=0, atol=0)


def test_minmax_uint8_compression_is_within_the_quantization_steps(two):
    (g0, u0), (g1, u1) = ok(two[0]["compressed_minmax_uint8"]), ok(two[1]["compressed_minmax_uint8"])
    # every chunk's range (padding zeros included) is at most the whole gradient's range with 0
    ranges = [
        max(g.max() for g in gs.values()).clamp(min=0) - min(g.min() for g in gs.values()).clamp(max=0)
        for gs in (g0, g1)
    ]
    step_in = sum(ranges) / 2 / 255  # the mean of the ranks' steps
    step_out = step_in  # the reduced chunk lies between the means of the ranks' minima and maxima
    for k in g0:
        exact = (g0[k] + g1[k]) / 2
        assert ((u0[k] - exact).abs() <= step_in / 2 + step_out / 2 + 1e-5).all(), k
        torch.testing.assert_close(u0[k], u1[k], rtol=0, atol=0)  # the same bits on every rank


def test_quantize_round_trip_is_within_half_a_step():
    x = torch.randn(4, 300) * torch.tensor([[1.0], [10.0], [1e-3], [0.0]])
    x[3] = 2.5  # a constant row: no error at all
    back = fbd.dequantize(fbd.quantize(x), x.dtype)
    step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 255
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    torch.testing.assert_close(back[3], x[3], rtol=0, atol=0)
    assert fbd.quantize(x).dtype == torch.uint8 and fbd.quantize(x).shape == (4, 308)


@pytest.mark.parametrize("columns", [1, 5, 302])
def test_quantize_round_trip_of_one_row_of_any_length(columns):
    """One row whose codes do not end at a multiple of 4 bytes (min and max then start unaligned)."""
    x = torch.randn(1, columns, dtype=torch.float64)
    back = fbd.dequantize(fbd.quantize(x), x.dtype)
    step = (x.max() - x.min()) / 255
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()


def test_one_outlier_flattens_its_chunk_and_clipping_first_bounds_the_step():
    """The min-max codec's documented failure (compression.py): with gradients of at most 0.14
    and one of 1e3, every other value of that chunk decodes to the chunk's minimum; a chunk
    without the outlier stays within half its own step; fb.clip before quantizing bounds the
    step by 2 * max_delta / 255."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(2, 1000, generator=gen, dtype=torch.float64) - 0.5) * 0.28
    x[0, 17] = 1e3
    back = fbd.dequantize(fbd.quantize(x), x.dtype)
    others = torch.arange(1000) != 17
    lo = x[0].min()
    torch.testing.assert_close(back[0, others], lo.expand(999).to(back.dtype), rtol=0, atol=1e-6)
    assert (back[0, others] - x[0, others]).abs().max() > 0.25  # the other values' whole range, lost
    own_step = (x[1].max() - x[1].min()) / 255
    assert ((back[1] - x[1]).abs() <= own_step / 2 * (1 + 1e-5) + 1e-7).all()
    clip = fb.clip(0.5)
    clipped = clip.update({"g": x}, clip.init({"g": x}))[0]["g"]
    back = fbd.dequantize(fbd.quantize(clipped), x.dtype)
    assert ((back - clipped).abs() <= 2 * 0.5 / 255 / 2 * (1 + 1e-5) + 1e-7).all()


# --- buckets --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 600, 4096, 1 << 20])
def test_buckets_are_ddps(cap):
    sizes = [10, 300, 20, 400, 5, 1, 77, 250]
    leaves = [torch.empty(n) for n in sizes]
    ours = fbd.assign_buckets(leaves, cap)
    # DDP hands its reducer the tensors in reverse order; map its positions back to ours
    theirs, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(leaves)), [cap], [False] * len(sizes), list(range(len(sizes)))
    )
    assert ours == [[len(sizes) - 1 - i for i in bucket] for bucket in theirs]


@pytest.mark.parametrize("first_cap", [1, 500, 2000])
def test_first_bucket_cap_is_ddps(first_cap):
    sizes = [10, 300, 20, 400, 5, 1, 77, 250, 3, 900]
    leaves = [torch.empty(n) for n in sizes] + [torch.empty(n, dtype=torch.float64) for n in sizes[:4]]
    ours = fbd.assign_buckets(leaves, 1200, first_cap)
    theirs, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(leaves)), [first_cap, 1200], [False] * len(leaves), list(range(len(leaves)))
    )
    assert sorted(ours) == sorted([len(leaves) - 1 - i for i in bucket] for bucket in theirs)


def test_default_bucket_caps_are_ddps():
    assert fbd.buckets.bucket_caps(None) == (dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20)
    assert fbd.buckets.bucket_caps(2.0) == (2 * 2**20, 2 * 2**20)
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        fbd.buckets.bucket_caps(-1.0)


def test_buckets_keep_dtypes_apart():
    leaves = [torch.empty(100), torch.empty(100, dtype=torch.float64), torch.empty(100)]
    buckets = fbd.assign_buckets(leaves, 1 << 20)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1]]


# --- compiled ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_transforms_equal_eager_on_two_ranks():
    results = run_ranks(2, COMPILED)
    for rank in range(2):
        for name in COMPILED:
            if name != "compiled_train_step_overlapped":
                eager, compiled = ok(results[rank][name])
                assert_trees_close(compiled, eager, rtol=1e-9, atol=1e-10)
    check_compiled_overlap([result["compiled_train_step_overlapped"] for result in results])


def check_compiled_overlap(per_rank):
    """make_train_step(compile=True) with chain(allreduce_gradients, adamw) on a tree: with the
    communication reordering, backward's matrix products run between launching the first
    bucket's all-reduce and waiting for it; the parameters and losses are those of the step
    compiled without it, bit for bit (float64)."""
    for result in per_rank:
        got = ok(result)
        overlapped, after = got["overlap"], got["after"]
        assert overlapped["mm_while_reducing"] > 0, "no backward compute between the first all-reduce and its wait"
        assert len(overlapped["trace"]) == len(after["trace"]) == sc.STEPS
        for (p1, l1), (p2, l2) in zip(overlapped["trace"], after["trace"]):
            assert torch.equal(l1, l2)
            for name in p2:
                assert torch.equal(p1[name], p2[name]), name


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: fbd.allreduce_gradients(),
        lambda: fbd.shard(fb.adamw()),
        lambda: fbd.periodic_average(2),
        lambda: fbd.decentralized("shift_one"),
    ],
)
def test_without_a_process_group_init_says_so(make):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        make().init({"w": torch.zeros(2)})


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="compression must be one of"):
        fbd.allreduce_gradients(compression="int4")
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        fbd.allreduce_gradients(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="period must be an int >= 1"):
        fbd.periodic_average(0)
    with pytest.raises(ValueError, match="peer_selection_mode must be one of"):
        fbd.decentralized("ring")
    with pytest.raises(TypeError, match="not a GradientTransformation"):
        fbd.shard(fb.adamw)


def test_parameters_that_differ_across_ranks_fail_at_init_on_every_rank(two):
    for rank in range(2):
        error = two[rank]["mismatched_shapes"]
        assert isinstance(error, ScenarioError) and error.type == "ValueError"
        assert (
            "parameters differ across ranks: rank 0 has 'w' of shape (3, 4) float32 on cpu, "
            "rank 1 has 'w' of shape (3, 5) float32 on cpu" in error.message
        )


@pytest.mark.parametrize("name", list(sc.MISMATCHED_SETTINGS))
def test_ranks_built_with_different_settings_fail_at_init_with_the_same_error(two, name):
    """Each pair of settings, given to rank 0 and rank 1, used to give diverging gradients, abort a
    rank inside gloo or hang until the process-group timeout; init now raises on both."""
    errors = [two[rank][f"mismatched_{name}"] for rank in range(2)]
    for error in errors:
        assert isinstance(error, ScenarioError) and error.type == "ValueError", error
        assert error.seconds < 5, error
    assert errors[0].message == errors[1].message
    if name == "allreduce_vs_shard":
        assert "rank 0 runs allreduce_gradients, rank 1 runs shard" in errors[0].message
    else:
        assert "ranks were built with different settings" in errors[0].message, errors[0].message
    if name == "fp16_vs_bf16":
        assert "compression='fp16' on rank 0, 'bf16' on rank 1" in errors[0].message
    if name == "chain_lr":
        assert "the chain around allreduce_gradients" in errors[0].message
        assert "1:adamw.lr=0.001 on rank 0, 0.01 on rank 1" in errors[0].message
    if name == "chain_injected":
        assert "1:lr=0.1 on rank 0, 0.2 on rank 1" in errors[0].message


@pytest.mark.parametrize("transform", ["allreduce", "shard"])
def test_replicas_with_different_values_fail_at_init_on_every_rank(two, transform):
    errors = [two[rank][f"different_values_{transform}"] for rank in range(2)]
    for error in errors:
        assert isinstance(error, ScenarioError) and error.type == "ValueError", error
        assert "parameter values differ across ranks: rank 1's 'conv.bias', 'conv.weight'" in error.message
        assert "broadcast_params" in error.message
    assert errors[0].message == errors[1].message


def test_broadcast_params_gives_every_rank_rank_0s_values(two):
    rank0_own, rank0_after = ok(two[0]["different_values_broadcast_first"])
    rank1_own, rank1_after = ok(two[1]["different_values_broadcast_first"])
    assert not torch.equal(rank0_own["fc.weight"], rank1_own["fc.weight"])  # seeded apart
    for name in rank0_own:
        assert torch.equal(rank0_after[name], rank0_own[name]) and torch.equal(rank1_after[name], rank0_own[name])


def test_a_shard_checkpoint_loads_only_on_its_own_rank(two):
    for rank in range(2):
        own_restored, error = ok(two[rank]["shard_checkpoint_of_another_rank"])
        assert own_restored
        assert error is not None and "'rank' is" in error and "another rank's shard" in error, error


def test_averaging_never_broadcasts_an_update(two):
    for rank in range(2):
        error = two[rank]["averaging_wrong_update"]
        assert isinstance(error, ScenarioError) and error.type == "ValueError", error
        assert "periodic_average: update of 'w' has shape (4,), parameter has (3, 4)" in error.message


def test_an_update_that_differs_from_init_raises_on_that_rank_before_sending():
    """Rank 1 updates with a gradient of another shape than the parameters init checked: it
    raises a ValueError before any collective (gloo aborted the process before); rank 0, waiting
    in the collective, fails in bounded time once rank 1 is gone."""
    results = run_ranks(2, ["update_differs_from_init"], timeout_s=PROCESS_GROUP_TIMEOUT_S + 60)
    error = results[1]["update_differs_from_init"]
    assert isinstance(error, ScenarioError) and error.type == "ValueError", error
    assert "this rank's update holds 2 tensors [(5,) float32, (3, 4) float32]" in error.message, error.message
    assert error.seconds < 5
    waiting = results[0]["update_differs_from_init"]
    assert isinstance(waiting, ScenarioError), f"rank 0 did not fail: {waiting}"
    assert waiting.seconds <= PROCESS_GROUP_TIMEOUT_S + 10, waiting


def test_a_dead_rank_makes_the_others_fail_in_bounded_time():
    results = run_ranks(2, ["dead_rank"], timeout_s=PROCESS_GROUP_TIMEOUT_S + 60)
    error = results[0]["dead_rank"]
    assert isinstance(error, ScenarioError), f"rank 0 did not fail: {error}"
    assert error.seconds <= PROCESS_GROUP_TIMEOUT_S + 10, error


# --- shutdown ---------------------------------------------------------------------------------------

SHUTDOWN_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
import functional_bagua as fb, functional_bagua.distributed as fbd

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if "gloo" in n]

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
params = {"w": torch.ones(3)}
tx = fb.chain(fbd.allreduce_gradients(), fb.sgd(0.1))
grads = torch.func.grad(lambda p: (p["w"] ** 2).sum())(params)  # imports torch._dynamo, as a training loop does
updates, _ = tx.update(grads, tx.init(params), params)
assert gloo_threads(), "the process group should run gloo threads while it exists"
dist.destroy_process_group()
print("gloo threads after destroy_process_group:", gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
def test_destroy_process_group_stops_gloo_threads_after_torch_func():
    """A process group that outlives destroy_process_group keeps gloo's worker threads, and one of
    them releasing a tensor at interpreter exit aborts the process (seen as a flaky SIGABRT of the
    distributed example under load). Importing functional_bagua.distributed first prevents it."""
    from dist_harness import free_port

    result = subprocess.run(
        [sys.executable, "-c", SHUTDOWN_SCRIPT, str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gloo threads after destroy_process_group: []" in result.stdout, result.stdout


@pytest.mark.parametrize("world", ["two", "four"])
@pytest.mark.parametrize("compression", ["plain", "minmax_uint8", "rule"])
def test_train_step_all_reduces_during_backward_with_the_same_bits(world, compression, request):
    """make_train_step(compile=False) with chain(allreduce_gradients, adamw): with the all-reduce
    run during backward (buckets launched while backward goes on) the parameters, losses and
    BatchNorm buffers are those of the all-reduce after backward, bit for bit (float64)."""
    for result in request.getfixturevalue(world):
        got = ok(result["train_step_overlapped"])
        overlapped, after = got[f"{compression}/overlap"], got[f"{compression}/after"]
        assert len(overlapped["trace"]) == len(after["trace"]) == sc.STEPS
        for (p1, l1, b1), (p2, l2, b2) in zip(overlapped["trace"], after["trace"]):
            assert torch.equal(l1, l2)
            for name in p2:
                assert torch.equal(p1[name], p2[name]), name
            for name in b2:
                assert torch.equal(b1[name], b2[name]), name
        assert any(overlapped["launched_in_backward"]), "no bucket was launched during backward"
        assert after["launched_in_backward"] == []


@pytest.mark.parametrize("world", ["two", "four"])
def test_donated_data_parallel_step_equals_the_pure_one(world, request):
    """chain(allreduce_gradients, adamw) with donate=True (torch's kernel in place), all-reduce
    during backward and after it: the parameters, losses and buffers of the pure step, bit for bit."""
    for result in request.getfixturevalue(world):
        got = ok(result["train_step_overlapped"])
        for when in ("overlap", "after"):
            donated, pure = got[f"donated/{when}"]["trace"], got[f"plain/{when}"]["trace"]
            assert len(donated) == len(pure) == sc.STEPS
            for (p1, l1, b1), (p2, l2, b2) in zip(donated, pure):
                assert torch.equal(l1, l2)
                for name in p2:
                    assert torch.equal(p1[name], p2[name]), name
                for name in b2:
                    assert torch.equal(b1[name], b2[name]), name


@pytest.mark.parametrize("world", ["two", "four"])
def test_train_step_with_torchs_kernel_after_the_reduction_equals_the_update_rule(world, request):
    """chain(allreduce_gradients, adamw): the step runs torch's fused AdamW after the reduction;
    within float64 rounding of the same chain run by its rule (adamw with a schedule)."""
    for result in request.getfixturevalue(world):
        got = ok(result["train_step_overlapped"])
        for (kernel, _, _), (rule, _, _) in zip(got["plain/overlap"]["trace"], got["rule/overlap"]["trace"]):
            assert_trees_close(kernel, rule, rtol=1e-12, atol=1e-14)
        assert got["plain/overlap"]["kernel_steps"] == got["plain/after"]["kernel_steps"] == sc.STEPS
        assert got["rule/overlap"]["kernel_steps"] == got["rule/after"]["kernel_steps"] == 0


# --- torch.distributed.checkpoint ---------------------------------------------------------------------


@pytest.mark.slow
# shrinking (flat), growing (by tensor); FSDP2's fused state, onto uneven shards: test_fsdp2.py
@pytest.mark.parametrize("saved_on, resumed_on, shard", [(4, 2, "flat"), (2, 4, "by tensor")])
def test_sharded_state_saved_with_dcp_resumes_on_another_number_of_ranks(
    saved_on, resumed_on, shard, tmp_path, monkeypatch
):
    """shard(adamw) (or shard_by_tensor(adamw)) for some steps on ``saved_on`` ranks, saved with
    DCP, loaded on ``resumed_on`` ranks (the moments resharded, or each tensor's moments read by
    its new owner) and trained on: the run of one process on the global batch."""
    monkeypatch.setenv("FB_DCP_DIR", str(tmp_path))
    monkeypatch.setenv("FB_DCP_SHARD", shard)
    expected, _ = sc.train(sc.TXS["adamw"](), sc.global_batches())
    saved = run_ranks(saved_on, ["dcp_save_sharded"])
    for result in saved:
        ok(result["dcp_save_sharded"])
    resumed = run_ranks(resumed_on, ["dcp_resume_sharded"])
    for result in resumed:
        assert_trees_close(ok(result["dcp_resume_sharded"]), expected)
