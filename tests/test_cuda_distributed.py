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
}
GLOO_CUDA = {  # module -> scenarios whose collectives gloo runs on CUDA tensors (all-reduce, broadcast)
    "dist_scenarios": ["allreduce_sgd", "allreduce_adamw", "periodic_average", "compressed_fp16", "compressed_bf16"],
    "bagua_scenarios": ["gradient_allreduce_against_torch_ddp", "fused_optimizer_with_bagua"],
    "torch_optim_scenarios": ["post_local_sgd_all", "zero_all"],
}
# relative tolerance by dtype: the GPU's float64 arithmetic rounds differently from the CPU's
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
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


def assert_same_run(cuda, cpu, where: str, quantized: bool) -> None:
    """``cuda`` (moved to the CPU) equals ``cpu`` leaf by leaf: tensors within their dtype's rounding
    (one quantization step for 8-bit codecs), everything else exactly."""
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
            rtol = 0.0 if quantized else RTOL[cpu.dtype]
            torch.testing.assert_close(cuda, cpu, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(cuda, cpu), where
    elif isinstance(cpu, dict):
        assert cuda.keys() == cpu.keys(), where
        for key in cpu:
            assert_same_run(cuda[key], cpu[key], f"{where}/{key}", quantized or key.split("/")[0] in QUANTIZED_VARIANTS)
    elif isinstance(cpu, (list, tuple)):
        assert len(cuda) == len(cpu), where
        for i, (a, b) in enumerate(zip(cuda, cpu)):
            assert_same_run(a, b, f"{where}[{i}]", quantized)
    elif isinstance(cpu, float):
        assert cuda == pytest.approx(cpu, rel=1e-9), where
    else:
        assert cuda == cpu, where


@pytest.mark.parametrize("module, name", cases(SCENARIOS))
def test_nccl_at_world_size_one_equals_the_cpu_run(runs, module, name):
    cuda, cpu = runs(module, 1, "cuda"), runs(module, 1, "cpu")
    assert name in cuda, f"{name}: no result from the NCCL rank (it died; see the captured output)"
    assert_same_run(without_timing(name, cuda[name]), without_timing(name, cpu[name]), name, name in QUANTIZED)


@pytest.mark.parametrize("module, name", cases(GLOO_CUDA))
def test_two_ranks_sharing_the_gpu_through_gloo_equal_the_cpu_run(runs, module, name):
    for rank, (cuda, cpu) in enumerate(zip(runs(module, 2, "cuda"), runs(module, 2, "cpu"))):
        assert name in cuda, f"{name}: no result from rank {rank} (it died; see the captured output)"
        assert_same_run(cuda[name], cpu[name], f"rank {rank}: {name}", name in QUANTIZED)


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
