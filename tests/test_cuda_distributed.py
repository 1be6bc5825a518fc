"""The distributed paths on CUDA tensors with one GPU, each against the same run on the CPU.

A GPU machine here has one GPU and NCCL refuses two ranks on one device, so: every distributed
scenario of the CPU suite (functional_bagua.distributed's transforms, make_train_step's overlapped
all-reduce, fb.Optimizer under torch DDP, the Bagua compat layer with all its algorithms, the
async averaging thread, ZeRO and PostLocalSGD) runs at world size 1 with NCCL
(``init_process_group("cpu:gloo,cuda:nccl")``), and those whose collectives gloo implements for
CUDA tensors (all-reduce and broadcast) run on 2 ranks sharing the GPU through gloo. Each result is
compared with the same scenario run on the CPU with gloo: the same data and initial weights (the
tests draw them on the CPU), float64 throughout, so the results agree to float64 rounding.
CPU-only CI has no GPU and skips them.
"""

from __future__ import annotations

import optree
import pytest
import torch
from dist_harness import ScenarioError, run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # each scenario module's runs spawn some ten rank processes: one worker runs all tests of a
    # module (pytest-xdist's --dist loadgroup; each worker would otherwise spawn them again), and
    # the first test of each waits for them longer than a test's usual limit (pytest-timeout)
    pytest.mark.timeout(900),
]

NCCL = "cpu:gloo,cuda:nccl"
SCENARIOS = {  # module -> scenarios run at world size 1 on NCCL
    "dist_scenarios": [
        "first_order_wrapped",
        "allreduce_sgd",
        "allreduce_adamw",
        "shard_adamw",
        "periodic_average",
        "compressed_fp16",
        "compressed_bf16",
        "compressed_minmax_uint8",
        "train_step_overlapped",
        "compiled_allreduce_adamw",
        "compiled_shard_adamw",
        "optimizer_under_ddp",
    ],
    "bagua_scenarios": [
        "gradient_allreduce_against_torch_ddp",
        "no_sync_against_torch_ddp",
        "bytegrad_against_float",
        "fused_optimizer_with_bagua",
        "low_precision_runs",
        "qadam_runs",
        "async_average",
    ],
    # not at world size 1: decentralized_runs and every_algorithm_in_turn (shift_one pairs ranks,
    # an even number of them) and post_local_sgd_all (subgroups of 2); post_local_sgd_all runs on
    # 2 ranks sharing the GPU below, the others on 2 and 4 CPU ranks in test_compat_bagua.py
    "torch_optim_scenarios": ["zero_all", "zero_overlap_all"],
    # decompositions shared among the ranks, by owner and by whole tensor (on one rank without a
    # collective; the owners' all-gathers run on 2 ranks through gloo below)
    "second_order_scenarios": ["sharded_second_order", "sharded_by_tensor"],
}
GLOO_CUDA = {  # module -> scenarios whose collectives gloo runs on CUDA tensors (all-reduce, broadcast)
    "dist_scenarios": ["allreduce_sgd", "allreduce_adamw", "periodic_average", "compressed_fp16", "compressed_bf16"],
    "bagua_scenarios": ["gradient_allreduce_against_torch_ddp", "fused_optimizer_with_bagua"],
    "torch_optim_scenarios": ["post_local_sgd_all", "zero_all"],
    # the owners' all-gathers; not sharded_by_tensor: gloo has no all_to_all_single for CUDA tensors
    # (both ranks died at it), so whole tensors run on CUDA at world size 1 only, above
    "second_order_scenarios": ["sharded_second_order"],
}
# relative tolerance by dtype: the GPU's float64 arithmetic rounds differently from the CPU's
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# eigendecompositions and inverse roots amplify that rounding (cuSOLVER's against LAPACK's)
RTOL_OF_MODULE = {"second_order_scenarios": {**RTOL, torch.float64: 1e-6}}
# results that are an error's text worded by the device's library (LAPACK's or cuSOLVER's
# message for a NaN matrix): both runs raised, in their own words, or neither did
WORDED_BY_THE_DEVICE = ("a NaN statistic",)
# results computed in bfloat16 inside (Muon's Newton-Schulz iteration): CUDA's bfloat16 matrix
# products round otherwise than the CPU's, so the two runs agree to bfloat16's precision
BFLOAT16_INSIDE = {"muon": dict(rtol=2e-2, atol=2e-3)}
# results that depend on numbers drawn on the default device (PSGD-Kron's probes: CUDA's generator
# draws other numbers than the CPU's for the same seed): compared by their shapes and finiteness
DRAWN_ON_THE_DEVICE = ("psgd_kron",)
TIMED = {"async_average": "rounds"}  # how many rounds the thread ran depends on timing, not on the device
QUANTIZED = {"compressed_minmax_uint8", "bytegrad_against_float", "low_precision_runs", "qadam_runs"}
QUANTIZED_VARIANTS = {"minmax_uint8"}  # a scenario's variants that run an 8-bit codec (keys, or keys' first part)


def cases(table: dict) -> list:
    return [
        pytest.param(module, name, id=f"{module}.{name}", marks=pytest.mark.xdist_group(f"cuda_{module}"))
        for module, names in table.items()
        for name in names
    ]


def without_timing(name: str, result):
    """``result`` less the entry whose value depends on timing (checked on its own)."""
    if name in TIMED and isinstance(result, dict):
        return {k: v for k, v in result.items() if k != TIMED[name]}
    return result


@pytest.fixture(scope="module")
def runs():
    """Results by (module, world size, device), each module's scenarios run once per setting, when
    a test first asks for them (a hang or a crash fails the tests of that setting only)."""
    cache: dict = {}

    def get(module: str, world_size: int, device: str):
        key = (module, world_size, device)
        if key not in cache:
            names = (SCENARIOS if world_size == 1 else GLOO_CUDA)[module]
            backend = "gloo" if device == "cpu" or world_size > 1 else NCCL
            results = run_ranks(world_size, names, module=module, device=device, backend=backend)
            cache[key] = results[0] if world_size == 1 else results
        return cache[key]

    return get


def paired_leaves(cuda, cpu, where: str) -> list:
    """``(i, cuda leaf, cpu leaf)`` of two trees of the same structure (asserted)."""
    cuda_leaves, cuda_structure = optree.tree_flatten(cuda)
    cpu_leaves, cpu_structure = optree.tree_flatten(cpu)
    assert cuda_structure == cpu_structure, where
    return list(zip(range(len(cpu_leaves)), cuda_leaves, cpu_leaves))


def assert_bfloat16_close(cuda, cpu, where: str, rtol: float, atol: float) -> None:
    """``cuda`` and ``cpu`` hold the same structure, their tensors within ``rtol`` / ``atol``."""
    for i, a, b in paired_leaves(cuda, cpu, where):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=atol, msg=lambda m: f"{where}[{i}]: {m}")
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a.cpu(), b), (where, i)
        else:
            assert a == b, (where, i)


def assert_same_shapes(cuda, cpu, where: str) -> None:
    """``cuda`` and ``cpu`` hold tensors of the same shapes and dtypes in the same structure, all
    finite."""
    for i, a, b in paired_leaves(cuda, cpu, where):
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), (where, i, a.shape, b.shape, a.dtype, b.dtype)
            assert bool(torch.isfinite(a).all()), (where, i)
        else:
            assert a == b, (where, i)


def assert_same_run(cuda, cpu, where: str, quantized: bool, rtol_of: dict = RTOL) -> None:
    """``cuda`` (moved to the CPU) equals ``cpu`` leaf by leaf: tensors within their dtype's rounding
    (``rtol_of``; one quantization step for 8-bit codecs), everything else exactly."""
    assert not isinstance(cuda, ScenarioError), f"{where}: raised on CUDA: {cuda}"
    assert not isinstance(cpu, ScenarioError), f"{where}: raised on the CPU: {cpu}"
    if isinstance(cpu, torch.Tensor):
        assert isinstance(cuda, torch.Tensor), where
        cuda = cuda.cpu()
        assert cuda.dtype == cpu.dtype and cuda.shape == cpu.shape, (
            where,
            cuda.dtype,
            cpu.dtype,
            cuda.shape,
            cpu.shape,
        )
        if cpu.is_floating_point():
            atol = float(cpu.abs().max()) / 100 if quantized and cpu.numel() else 1e-12
            rtol = 0.0 if quantized else rtol_of[cpu.dtype]
            torch.testing.assert_close(cuda, cpu, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(cuda, cpu), where
    elif isinstance(cpu, dict):
        assert cuda.keys() == cpu.keys(), where
        for key in cpu:
            named = key if isinstance(key, str) else ""
            quantized_here = quantized or named.split("/")[0] in QUANTIZED_VARIANTS
            if named.endswith(WORDED_BY_THE_DEVICE):
                both = isinstance(cuda[key], str) and isinstance(cpu[key], str)
                assert both or cuda[key] == cpu[key], (where, key, cuda[key], cpu[key])
            elif named in BFLOAT16_INSIDE:
                assert_bfloat16_close(cuda[key], cpu[key], f"{where}/{key}", **BFLOAT16_INSIDE[named])
            elif named.startswith(DRAWN_ON_THE_DEVICE):
                assert_same_shapes(cuda[key], cpu[key], f"{where}/{key}")
            else:
                assert_same_run(cuda[key], cpu[key], f"{where}/{key}", quantized_here, rtol_of)
    elif isinstance(cpu, (list, tuple)):
        assert len(cuda) == len(cpu), where
        for i, (a, b) in enumerate(zip(cuda, cpu)):
            assert_same_run(a, b, f"{where}[{i}]", quantized, rtol_of)
    elif isinstance(cpu, float):
        assert cuda == pytest.approx(cpu, rel=1e-9), where
    else:
        assert cuda == cpu, where


@pytest.mark.parametrize("module, name", cases(SCENARIOS))
def test_nccl_at_world_size_one_equals_the_cpu_run(runs, module, name):
    cuda, cpu = runs(module, 1, "cuda"), runs(module, 1, "cpu")
    assert name in cuda, f"{name}: no result from the NCCL rank (it died; see the captured output)"
    rtol_of = RTOL_OF_MODULE.get(module, RTOL)
    assert_same_run(without_timing(name, cuda[name]), without_timing(name, cpu[name]), name, name in QUANTIZED, rtol_of)


@pytest.mark.parametrize("module, name", cases(GLOO_CUDA))
def test_two_ranks_sharing_the_gpu_through_gloo_equal_the_cpu_run(runs, module, name):
    for rank, (cuda, cpu) in enumerate(zip(runs(module, 2, "cuda"), runs(module, 2, "cpu"))):
        assert name in cuda, f"{name}: no result from rank {rank} (it died; see the captured output)"
        rtol_of = RTOL_OF_MODULE.get(module, RTOL)
        assert_same_run(cuda[name], cpu[name], f"rank {rank}: {name}", name in QUANTIZED, rtol_of)


def test_async_averaging_thread_on_two_ranks_sharing_the_gpu():
    """The averaging thread on its own CUDA stream, ordered by events (how many rounds it runs
    while training depends on timing, so its result is checked as the CPU test checks it): the
    warmup's averaged gradients leave equal replicas, the thread ran, the idle replicas end equal,
    no thread is left."""
    results = run_ranks(2, ["async_average"], module="bagua_scenarios", device="cuda", backend="gloo")
    results = [r.get("async_average") for r in results]
    assert all(r is not None and not isinstance(r, ScenarioError) for r in results), results
    for name, p in results[0]["after_warmup"].items():
        assert torch.equal(p, results[1]["after_warmup"][name]), name
    assert all(r["rounds"] > 0 for r in results)
    for name, p in results[0]["final"].items():
        torch.testing.assert_close(p, results[1]["final"][name], rtol=1e-12, atol=1e-14)
    assert all(r["threads"] == [] for r in results)
