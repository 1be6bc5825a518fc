"""Bagua's data-parallel API (functional_bagua.compat) on 2 and 4 gloo ranks against torch's own
DDP and collectives: with_bagua and DistributedDataParallel with GradientAllReduce, ByteGrad,
no_sync, find_unused_parameters, the broadcast at wrap time, model switches, fuse_optimizer in
both orders, bad input, and the communication API."""

from __future__ import annotations

import pytest
import torch
from dist_harness import ScenarioError, run_ranks

import functional_bagua.compat as bagua
from functional_bagua.compat.algorithms import Algorithm, GlobalAlgorithmRegistry, gradient_allreduce

TWO_RANKS = [
    "gradient_allreduce_against_torch_ddp",
    "buckets_launch_during_backward",
    "no_sync_against_torch_ddp",
    "find_unused_parameters_against_torch_ddp",
    "broadcast_at_wrap_time",
    "model_switch",
    "bytegrad_against_float",
    "fused_optimizer_with_bagua",
    "mismatched_models",
    "mismatched_algorithms",
    "bad_arguments",
]
FOUR_RANKS = ["gradient_allreduce_against_torch_ddp", "model_switch", "bytegrad_against_float"]


@pytest.fixture(scope="module")
def two():
    return run_ranks(2, TWO_RANKS, module="bagua_scenarios")


@pytest.fixture(scope="module")
def four():
    return run_ranks(4, FOUR_RANKS, module="bagua_scenarios")


def ok(result):
    assert not isinstance(result, ScenarioError), result
    return result


def assert_same(actual: dict, expected: dict, keys=None, exact: bool = True) -> None:
    """Bit for bit, or (``exact=False``) within float64's rounding of a sum in another order."""
    keys = expected.keys() if keys is None else keys
    for key in keys:
        if exact:
            assert torch.equal(actual[key], expected[key]), (key, (actual[key] - expected[key]).abs().max())
        else:
            torch.testing.assert_close(actual[key], expected[key], rtol=1e-12, atol=1e-14, msg=lambda m: f"{key}: {m}")


def params_and_state(result: dict) -> list:
    return [k for k in result if not k.startswith("buffer/")]


@pytest.mark.parametrize("world", ["two", "four"])
def test_gradient_allreduce_equals_torch_ddp_bit_for_bit(world, request):
    """float64, 4 steps, SGD with momentum and Adam with weight decay, BatchNorm buffers, an
    ignored parameter, DDP's default and tiny buckets: with_bagua (parameters and optimizer state)
    and DistributedDataParallel (buffers too, as it broadcasts them before each forward) equal torch
    DDP: bit for bit on 2 ranks; on 4, gloo sums each element in an order that depends on where it
    sits in its bucket, and torch's DDP re-forms its buckets after the first step, so there only to
    float64 rounding."""
    results = request.getfixturevalue(world)
    exact = world == "two"
    for result in results:
        got = ok(result["gradient_allreduce_against_torch_ddp"])
        for optimizer in ("sgd", "adam"):
            reference, tiny = got[f"torch/{optimizer}"], got[f"torch_tiny/{optimizer}"]
            assert_same(got[f"with_bagua/{optimizer}"], reference, params_and_state(reference), exact=exact)
            assert_same(got[f"ddp/{optimizer}"], tiny, exact=exact)
        assert not torch.equal(
            ok(results[0]["gradient_allreduce_against_torch_ddp"])["torch/sgd"]["param/fc.bias"],
            ok(results[1]["gradient_allreduce_against_torch_ddp"])["torch/sgd"]["param/fc.bias"],
        ), "the ignored parameter should train apart on each rank"


def test_buckets_are_launched_during_backward(two):
    for result in two:
        got = ok(result["buckets_launch_during_backward"])
        assert got["buckets"] >= 2
        # all buckets but the one holding conv.weight were in flight when its gradient came
        assert got["launched_before_last"] == [got["buckets"] - 1]


def test_no_sync_accumulates_like_torch_ddp(two):
    for result in two:
        got = ok(result["no_sync_against_torch_ddp"])
        assert_same(got["ours"], got["torch"])


def test_find_unused_parameters_like_torch_ddp(two):
    """A parameter no rank uses keeps grad None (momentum untouched); one used on rank 0 only gets
    the average of rank 0's gradient and nothing, as with torch's DDP."""
    for result in two:
        got = ok(result["find_unused_parameters_against_torch_ddp"])
        assert_same(got["ours"], got["torch"])
        assert got["ours/unused_grad_is_none"] and got["torch/unused_grad_is_none"]


def test_wrapping_broadcasts_parameters_buffers_and_optimizer_state(two):
    for optimizer in ("sgd", "adam"):
        rank0, rank1 = (ok(r["broadcast_at_wrap_time"]) for r in two)
        assert_same(rank1[optimizer], rank0[optimizer])
        assert any(k.startswith("buffer/") for k in rank0[optimizer])
        assert any(k.startswith("state/") for k in rank0[optimizer])
        assert rank1[f"{optimizer}/lr"] == rank0[f"{optimizer}/lr"] == 0.5


@pytest.mark.parametrize("world", ["two", "four"])
def test_model_switch_keeps_replicas_equal_and_drops_old_hooks(world, request):
    results = [ok(r["model_switch"]) for r in request.getfixturevalue(world)]
    for got in results[1:]:
        assert_same(got["state"], results[0]["state"])
    assert all(got["hooks"] == 2 for got in results)  # the engine's and the reducer's, of the last wrap


@pytest.mark.parametrize("world", ["two", "four"])
def test_bytegrad_is_the_same_bits_everywhere_and_within_the_quantization_bound(world, request):
    results = [ok(r["bytegrad_against_float"]) for r in request.getfixturevalue(world)]
    n = len(results)
    for name, exact in results[0]["float"].items():
        for got in results[1:]:
            assert torch.equal(got["bytegrad"][name], results[0]["bytegrad"][name]), name
        # exact mean of the local gradients, written out
        mean = sum(r["local"][name] for r in results) / n
        torch.testing.assert_close(exact, mean, rtol=1e-12, atol=1e-14)
    # each quantization errs by at most half a step of its chunk: (max - min) / 255 / 2, twice
    flat = lambda grads: torch.cat([g.reshape(-1) for g in reversed(list(grads.values()))])  # noqa: E731
    spread = max((flat(r["local"]).max() - flat(r["local"]).min()).item() for r in results)
    error = (flat(results[0]["bytegrad"]) - flat(results[0]["float"])).abs().max().item()
    assert 0 < error <= spread / 255, (error, spread)


def test_fuse_optimizer_composes_with_with_bagua_in_both_orders(two):
    for result in two:
        got = ok(result["fused_optimizer_with_bagua"])
        for order in ("fuse_first", "wrap_first"):
            assert_same(got[order], got["torch"])
            assert got[f"{order}/fused_count"] > 0


def test_models_that_differ_across_ranks_fail_on_every_rank(two):
    for result in two:
        for name in ("mismatched_models", "mismatched_algorithms"):
            error = result[name]
            assert isinstance(error, ScenarioError) and error.type == "ValueError", error
            assert error.seconds < 10
    assert "parameters differ across ranks" in two[0]["mismatched_models"].message
    assert "different settings" in two[1]["mismatched_algorithms"].message


def test_bad_arguments_are_named(two):
    for result in two:
        got = ok(result["bad_arguments"])
        assert (
            got["not an algorithm"][0] == "TypeError" and "GradientAllReduceAlgorithm()" in got["not an algorithm"][1]
        )
        assert got["optimizer of another model"][0] == "ValueError"
        assert "not this Linear's" in got["optimizer of another model"][1]
        assert got["not a process group"][0] == "TypeError"


def test_with_bagua_before_init_process_group_says_so():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], gradient_allreduce.GradientAllReduceAlgorithm())


def test_algorithm_registry_names_baguas_algorithms():
    assert isinstance(
        Algorithm.init("gradient_allreduce", average=False), gradient_allreduce.GradientAllReduceAlgorithm
    )
    assert {"gradient_allreduce", "bytegrad"} <= set(GlobalAlgorithmRegistry.names())
    with pytest.raises(KeyError, match="known"):
        Algorithm.init("no_such_algorithm")
    with pytest.raises(ValueError, match="registered"):
        GlobalAlgorithmRegistry.register("bytegrad", gradient_allreduce.GradientAllReduceAlgorithm)


def test_importing_compat_gives_modules_baguas_methods():
    model = torch.nn.Linear(2, 2)
    assert callable(model.with_bagua) and callable(model.bagua_build_params)
    assert [name for name, _ in model.bagua_build_params()] == [".weight", ".bias"]


# ---- communication ---------------------------------------------------------------------------------


def test_communication_api_matches_torch_collectives():
    results = [
        ok(r["communication_api"]) for r in run_ranks(2, ["communication_api"], module="bagua_scenarios", init=False)
    ]
    n = len(results)
    xs = [torch.arange(4 * n, dtype=torch.float64) + 100 * r for r in range(n)]
    for rank, got in enumerate(results):
        assert got["initialized"] and (got["rank"], got["world_size"]) == (rank, n)
        assert (got["local_rank"], got["local_size"], got["backend"]) == (rank, n, "gloo")
        assert torch.equal(got["allreduce_avg"], sum(xs) / n)
        assert torch.equal(got["allreduce_max"], torch.maximum(*xs))
        assert torch.equal(got["broadcast"], xs[n - 1])
        assert torch.equal(got["reduce"], sum(xs) if rank == 0 else xs[rank])  # others untouched
        assert torch.equal(got["allgather"], torch.stack(xs))
        assert torch.equal(got["allgather_inplace"], torch.cat([x.view(n, -1)[r] for r, x in enumerate(xs)]))
        assert torch.equal(got["reduce_scatter"], sum(xs).view(n, -1)[rank])
        assert torch.equal(got["alltoall"], torch.cat([x.view(n, -1)[rank] for x in xs]))
        assert torch.equal(got["scatter"], xs[0].view(n, -1)[rank])
        assert torch.equal(got["subgroup_allreduce"], sum(xs))
        if rank == 0:
            assert got["from_torch_ranks"] == [0] and got["from_torch_nranks"] == 1
        else:
            assert "not in that torch process group" in got["from_torch_ranks"]
        assert "twice" in got["second_init"]


def test_to_bagua_process_group_refuses_other_objects():
    with pytest.raises(TypeError, match="BaguaProcessGroup"):
        bagua.communication.to_bagua_process_group("world")
