"""Bagua's data-parallel API (functional_bagua.compat) on 2 and 4 gloo ranks against torch's own
DDP and collectives: with_bagua and DistributedDataParallel with GradientAllReduce, ByteGrad,
no_sync, find_unused_parameters, the broadcast at wrap time, model switches, fuse_optimizer in
both orders, bad input, and the communication API."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import bagua_scenarios as sc
import pytest
import torch
from devices import seeded
from dist_harness import ScenarioError, run_ranks
from models import loss_fn, make_model

import functional_bagua.compat as bagua
import functional_bagua.distributed as fbd
from functional_bagua.compat.algorithms import Algorithm, GlobalAlgorithmRegistry, gradient_allreduce

pytestmark = pytest.mark.cpu_only("spawned gloo ranks on the CPU (CUDA ranks: test_cuda_distributed.py)")

TWO_RANKS = [
    "cache_shared_between_ranks",
    "gradient_allreduce_against_torch_ddp",
    "v1_9_0_with_bagua_defaults",
    "buckets_launch_during_backward",
    "no_sync_against_torch_ddp",
    "find_unused_parameters_against_torch_ddp",
    "broadcast_at_wrap_time",
    "model_switch",
    "bytegrad_against_float",
    "fused_optimizer_with_bagua",
    "mismatched_models",
    "mismatched_algorithms",
    "mismatched_algorithm_arguments",
    "replaced_learning_rate",
    "no_sync_under_decentralized",
    "uneven_inputs_under_join",
    "coalesced_and_object_collectives",
    "join_with_no_sync_and_buffers",
    "join_with_an_averaging_algorithm",
    "bad_arguments",
    "other_dtypes_and_compiled_modules",
    "find_unused_parameters_build_params",
    "multi_models",
    "wrapper_attributes",
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


def test_the_v1_9_0_class_takes_bagua_s_defaults_and_equals_torch_ddp(two):
    for result in two:
        got = ok(result["v1_9_0_with_bagua_defaults"])
        assert_same(got["v1_9_0"], got["torch"], exact=True)


def test_bfloat16_models_and_compiled_submodules_equal_torch_ddp(two):
    for result in two:
        got = ok(result["other_dtypes_and_compiled_modules"])
        for case in ("bf16", "compiled"):
            assert_same(got[f"{case}/ours"], got[f"{case}/torch"])


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


def test_build_params_names_what_got_gradients_with_find_unused_parameters(two):
    got = ok(two[1]["find_unused_parameters_build_params"])  # rank 1 does not use "sometimes"
    assert got[True] == ["fc.bias", "fc.weight"]
    assert got[False] == [
        "fc.bias",
        "fc.weight",
        "sometimes.bias",
        "sometimes.weight",
        "unused.bias",
        "unused.weight",
    ]
    assert ok(two[0]["find_unused_parameters_build_params"])[True] == [
        "fc.bias",
        "fc.weight",
        "sometimes.bias",
        "sometimes.weight",
    ]


def test_wrapped_models_keep_torch_ddps_keys_count_steps_and_stay_local_in_no_sync(two):
    results = [ok(r["wrapper_attributes"]) for r in two]
    for got in results:
        assert got["ours_keys"] == got["torch_keys"] and got["ours_keys"][0].startswith("module.")
        assert got["module"]
        assert torch.equal(got["local_grad"], got["reference_local_grad"])  # no_sync: this rank's own
        assert got["counter"] == 2  # two training forwards; the evaluation one does not count
    mean = sum(r["reference_local_grad"] for r in results) / len(results)
    torch.testing.assert_close(results[0]["synced_grad"], mean, rtol=1e-12, atol=1e-14)
    assert not torch.equal(results[0]["local_grad"], results[1]["local_grad"])


def test_two_models_sharing_one_algorithm_each_equal_torch_ddp(two):
    for result in two:
        got = ok(result["multi_models"])
        for ours, theirs in zip(got["ours"], got["torch"]):
            assert_same(ours, theirs)


def test_a_rank_that_dies_makes_the_others_fail_in_bounded_time():
    from dist_harness import PROCESS_GROUP_TIMEOUT_S

    results = run_ranks(2, ["dead_rank"], timeout_s=PROCESS_GROUP_TIMEOUT_S + 60, module="bagua_scenarios")
    error = results[0]["dead_rank"]
    assert isinstance(error, ScenarioError), f"rank 0 did not fail: {error}"
    assert error.seconds <= PROCESS_GROUP_TIMEOUT_S + 10, error


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


@pytest.mark.parametrize("name", list(sc.MISMATCHED_ARGUMENTS))
def test_an_algorithm_built_with_other_arguments_fails_on_every_rank(two, name):
    messages = [result["mismatched_algorithm_arguments"][name] for result in two]
    assert messages[0] == messages[1] and "ranks were built with different settings" in messages[0], messages
    assert "algorithm_arguments" in messages[0], messages[0]


def test_an_optimizer_number_replaced_by_rank_0s_is_warned_of(two):
    """Bagua broadcasts rank 0's optimizer state: rank 1's lr becomes rank 0's, as in Bagua, and
    rank 1 is told (rank 0 is not)."""
    rank0, rank1 = (result["replaced_learning_rate"] for result in two)
    assert rank0["lr"] == rank1["lr"] == 0.1
    assert rank0["warnings"] == []
    assert len(rank1["warnings"]) == 1 and "param group 0's lr: 0.01 here, 0.1 on rank 0" in rank1["warnings"][0]


def test_no_sync_accumulates_under_decentralized_without_unwaited_collectives(two):
    for rank, result in enumerate(two):
        got = result["no_sync_under_decentralized"]
        assert not isinstance(got, ScenarioError), got
        assert got["micro-batches"]["unwaited"] == 0, rank
        for a, b in zip(got["micro-batches"]["params"], got["one forward"]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_join_with_no_sync_micro_batches_and_broadcast_buffers_completes(two):
    results = [ok(result["join_with_no_sync_and_buffers"]) for result in two]
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name


def test_decentralized_interval_counts_synchronized_steps_not_micro_batches(two):
    for result in two:
        assert ok(result["no_sync_under_decentralized"])["averages_at_interval_2"] == 2  # 4 steps, every second


def test_the_v1_9_0_class_refuses_the_old_argument_order():
    from functional_bagua.compat.algorithms.decentralized import DecentralizedAlgorithm
    from functional_bagua.compat.data_parallel.distributed import DistributedDataParallel_V1_9_0

    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="pass optimizers and algorithm by keyword"):
        DistributedDataParallel_V1_9_0(model, [torch.optim.SGD(model.parameters(), lr=0.1)], DecentralizedAlgorithm())


def test_ranks_with_uneven_inputs_train_under_join_as_torch_ddp_does(two):
    """torch's Join with 3 and 5 steps on the two ranks: the rank that ran out shadows the
    others' all-reduces with zeros, and at the end every rank has the last joiner's weights;
    with_bagua and Bagua's DDP equal torch's DDP (ByteGrad: within its quantization)."""
    results = [ok(result["uneven_inputs_under_join"]) for result in two]
    for got in results:
        for how in ("with_bagua", "ddp"):
            for a, b in zip(got[how], got["torch"]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        for a, b in zip(got["ddp_bytegrad"], got["torch"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0.05)
    for how in ("torch", "with_bagua", "ddp", "ddp_bytegrad"):  # the same weights on both ranks
        assert all(torch.equal(a, b) for a, b in zip(results[0][how], results[1][how])), how


def test_join_with_an_averaging_algorithm_says_what_it_supports(two):
    for result in two:
        error = result["join_with_an_averaging_algorithm"]
        assert isinstance(error, ScenarioError) and error.type == "RuntimeError", error
        assert "Join supports the gradient algorithms" in error.message and error.seconds < 5


def test_coalesced_collectives_and_broadcast_object_equal_their_one_tensor_forms(two):
    for result in two:
        got = ok(result["coalesced_and_object_collectives"])
        for what in ("allreduce", "broadcast"):
            coalesced, single = got[what]
            assert all(torch.equal(a, b) for a, b in zip(coalesced, single)), what
        assert got["object"]["from"] == 1
        assert torch.equal(got["object"]["t"], ok(two[1]["coalesced_and_object_collectives"])["mine"])


def test_bagua_environment_readers(monkeypatch):
    from functional_bagua.compat import communication as c

    for name in ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK", "BAGUA_DEFAULT_BUCKET_SIZE", "BAGUA_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert (c.get_master_addr(), c.get_node_rank(), c.get_default_bucket_size(), c.get_bagua_service_port()) == (
        "127.0.0.1",
        0,
        10 * 1024**2,
        -1,
    )
    monkeypatch.setenv("NODE_RANK", "3")
    monkeypatch.setenv("GROUP_RANK", "5")
    assert c.get_node_rank() == 3  # not launched by an elastic launcher: NODE_RANK
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    assert c.get_node_rank() == 5  # torchrun's variables: GROUP_RANK
    port = c.find_free_network_port()
    assert 0 < port < 65536


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


def test_a_cached_dataset_on_the_default_store_is_made_once_for_all_ranks(two):
    results = [ok(r["cache_shared_between_ranks"]) for r in two]
    assert results[0]["made"] == list(range(6)) and all(r["made"] == [] for r in results[1:])
    for r in results:
        assert r["keys"] == 6 and all(torch.equal(s, torch.full((2,), float(i))) for i, s in enumerate(r["samples"]))


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
        internals = got["internals"]  # Bagua's module-level records and helpers
        assert internals["default_pg_is_default"] and internals["named_one_more"] and internals["by_name"]
        assert internals["group_ranks"] == {0: 0, n - 1: 1}
        assert internals["rank_mappings"] == {r: (0, r) for r in range(n)}  # one node
        assert internals["service_port"] == results[0]["internals"]["service_port"] > 0
        patched = got["patched"]  # torch's ProcessGroup with Bagua's methods; one node: intra is everyone
        assert patched["in_map"] and patched["once"] and patched["named"] and patched["ranks"] == list(range(n))
        assert "made from a torch process group on its members only" in patched["borrowed_intra"]
        assert (patched["global_nranks"], patched["intra_nranks"]) == (n, n)
        assert torch.equal(patched["intra_sum"], sum(xs))
        assert patched["inter"] == (1 if rank == 0 else "outside")  # one rank per node: the first's local rank
        assert "is gone (destroyed)" in got["gone"]
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
        pieces = [x.view(n, -1) for x in xs]
        assert torch.equal(
            got["gather"], torch.cat(xs) if rank == 0 else torch.zeros(n * xs[0].numel(), dtype=torch.float64)
        )
        expected_gather_inplace = torch.cat([pieces[r][0] for r in range(n)])  # each rank's first count elements
        if rank == 0:
            assert torch.equal(got["gather_inplace"][: n * 4], expected_gather_inplace)
        else:
            assert torch.equal(got["gather_inplace"], xs[rank])
        assert torch.equal(got["scatter_inplace"][:4], pieces[0][rank])
        assert torch.equal(got["reduce_scatter_inplace"].view(n, -1)[rank], sum(pieces)[rank])
        assert torch.equal(got["alltoall_inplace"], torch.cat([p[rank] for p in pieces]))
        assert torch.equal(got["alltoall_v"], torch.cat([xs[r][: r + 1] for r in range(n)]))
        assert torch.equal(got["recv"], torch.zeros(3, dtype=torch.float64))
        bits = [torch.tensor([0b1100, 0b1010, 0b0110 + r, 1 << r]) for r in range(n)]
        for op, fold in (("BOR", torch.bitwise_or), ("BAND", torch.bitwise_and), ("BXOR", torch.bitwise_xor)):
            expected = functools.reduce(fold, bits)
            native, gathered = got[f"bitwise_{op}"]
            assert torch.equal(native, expected) and torch.equal(gathered, expected), op
        if rank == 0:
            assert got["from_torch_ranks"] == [0] and got["from_torch_nranks"] == 1
        else:
            assert "not in that torch process group" in got["from_torch_ranks"]
        assert "twice" in got["second_init"]


def test_to_bagua_process_group_refuses_other_objects():
    with pytest.raises(TypeError, match="BaguaProcessGroup"):
        bagua.communication.to_bagua_process_group("world")


# ---- weight averaging, QAdam, async -----------------------------------------------------------------

SGD_LR = sc.SGD_LR


def local_gradient(model: torch.nn.Module, weights: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    return torch.func.grad(lambda w: loss_fn(torch.func.functional_call(model, w, (x,)), y))(weights)


def decentralized_reference(world_size: int, mode: str, interval: int) -> list:
    """Bagua's decentralized SGD written out: on communication steps each rank's weights become the
    average (all ranks, or itself and Bagua's shift_one peer), then take the local gradient step
    computed at the weights before averaging. Every rank starts from rank 0's model (the broadcast)."""
    model = make_model("shapes", sc.DTYPE, seed=0)
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()} for _ in range(world_size)]
    data = [sc.local_batches(r, world_size) for r in range(world_size)]
    traces: list = [[] for _ in range(world_size)]
    for t in range(sc.STEPS):
        grads = [local_gradient(model, weights[r], *data[r][t]) for r in range(world_size)]
        if t % interval == 0:
            k = t // interval
            if mode == "all":
                averaged = [{n: sum(w[n] for w in weights) / world_size for n in weights[0]}] * world_size
            else:
                averaged = [
                    {n: (weights[r][n] + weights[fbd.peer_of(r, world_size, k)][n]) / 2 for n in weights[r]}
                    for r in range(world_size)
                ]
        else:
            averaged = weights
        weights = [{n: averaged[r][n] - SGD_LR * grads[r][n] for n in weights[r]} for r in range(world_size)]
        for r in range(world_size):
            traces[r].append(weights[r])
    return traces


def assert_traces_close(actual: list, expected: list) -> None:
    for t, (got, want) in enumerate(zip(actual, expected)):
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"step {t} {name}: {m}"
            )


@pytest.fixture(scope="module")
def averaging_two():
    return run_ranks(
        2,
        ["decentralized_runs", "low_precision_runs", "qadam_runs", "async_average", "every_algorithm_in_turn"],
        module="bagua_scenarios",
    )


@pytest.fixture(scope="module")
def averaging_four():
    return run_ranks(4, ["decentralized_runs", "low_precision_runs"], module="bagua_scenarios")


@pytest.mark.parametrize("case", list(sc.DECENTRALIZED_CASES))
@pytest.mark.parametrize("world", ["averaging_two", "averaging_four"])
def test_decentralized_equals_the_rule_written_out(world, case, request):
    results = request.getfixturevalue(world)
    mode, interval = sc.DECENTRALIZED_CASES[case]
    expected = decentralized_reference(len(results), mode, interval)
    for rank, result in enumerate(results):
        assert_traces_close(ok(result["decentralized_runs"])[case]["trace"], expected[rank])


def low_precision_reference(world_size: int, interval: int) -> list:
    """Bagua's low-precision decentralized SGD written out (compat/algorithms/decentralized.py's
    docstring), with functional_bagua's 8-bit min-max quantizer over all the weights."""
    model = make_model("shapes", sc.DTYPE, seed=0)
    names = [n for n, _ in model.named_parameters()]
    flat = lambda w: torch.cat([w[n].reshape(-1) for n in names])  # noqa: E731
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = [dict(start) for _ in range(world_size)]
    x_hat = [flat(start) for _ in range(world_size)]
    left, right = [flat(start) for _ in range(world_size)], [flat(start) for _ in range(world_size)]
    data = [sc.local_batches(r, world_size) for r in range(world_size)]
    traces: list = [[] for _ in range(world_size)]
    for t in range(sc.STEPS):
        grads = [local_gradient(model, weights[r], *data[r][t]) for r in range(world_size)]
        weights = [{n: weights[r][n] - SGD_LR * grads[r][n] for n in names} for r in range(world_size)]
        if t % interval == 0:
            x = [flat(w) for w in weights]
            sent = [
                fbd.quantize((x[r] + left[r] / 3 + right[r] / 3 - 5 / 3 * x_hat[r]).unsqueeze(0))
                for r in range(world_size)
            ]
            received = [fbd.dequantize(c, sc.DTYPE)[0] for c in sent]
            for r in range(world_size):
                left[r] = left[r] + received[(r - 1) % world_size]
                right[r] = right[r] + received[(r + 1) % world_size]
                x_hat[r] = x_hat[r] + received[r]
                pieces = torch.split(x_hat[r], [start[n].numel() for n in names])
                weights[r] = {n: piece.view(start[n].shape) for n, piece in zip(names, pieces)}
        for r in range(world_size):
            traces[r].append(weights[r])
    return traces


@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("world", ["averaging_two", "averaging_four"])
def test_low_precision_decentralized_equals_the_rule_written_out(world, interval, request):
    results = request.getfixturevalue(world)
    expected = low_precision_reference(len(results), interval)
    for rank, result in enumerate(results):
        assert_traces_close(ok(result["low_precision_runs"])[f"interval-{interval}"]["trace"], expected[rank])


@pytest.mark.parametrize("world", ["averaging_two", "averaging_four"])
def test_baguas_bucket_attributes(world, request):
    """What Bagua's own tests read: the "all" average is the same on every rank; in the ring each
    rank's x_hat is what its neighbours hold as their right (left) peer's weights."""
    results = [ok(r["decentralized_runs"]) for r in request.getfixturevalue(world)]
    for got in results[1:]:
        assert torch.equal(got["all-1"]["bucket"]["_peer_weight"], results[0]["all-1"]["bucket"]["_peer_weight"])
    ring = [ok(r["low_precision_runs"])["interval-1"]["bucket"] for r in request.getfixturevalue(world)]
    n = len(ring)
    for r in range(n):
        assert torch.equal(ring[r]["_weight"], ring[(r - 1) % n]["_right_peer_weight"])
        assert torch.equal(ring[r]["_weight"], ring[(r + 1) % n]["_left_peer_weight"])


def test_utils_flatten_and_apply_flattened_call():
    tensors = [torch.arange(6.0).view(2, 3), torch.ones(4)]
    flat = bagua.utils.flatten(tensors)
    assert torch.equal(flat, torch.cat([tensors[0].reshape(-1), tensors[1]]))
    assert [tuple(v.shape) for v in bagua.utils.unflatten(flat, tensors)] == [(2, 3), (4,)]
    bagua.utils.apply_flattened_call(tensors, lambda t, k: t.mul_(k), [3.0])
    assert torch.equal(tensors[0], 3 * torch.arange(6.0).view(2, 3)) and torch.equal(tensors[1], 3 * torch.ones(4))


def test_utils_group_by_type_check_contiguity_and_name_dtypes_as_bagua():
    f32, f64 = torch.ones(3), torch.ones(2, dtype=torch.float64)
    other = torch.zeros(4)
    groups = bagua.utils._group_by_tensor_type([f32, f64, other])
    assert list(groups) == ["torch.FloatTensor", "torch.DoubleTensor"] and groups["torch.FloatTensor"] == [f32, other]
    bagua.utils.apply_flattened_call_all([f32, f64, other], lambda t: t.add_(1.0))  # once per type
    assert torch.equal(f32, torch.full((3,), 2.0)) and torch.equal(f64, torch.full((2,), 2.0, dtype=torch.float64))
    buffer = torch.arange(10.0)
    assert bagua.utils.check_contiguous([buffer[:4], buffer[4:7], buffer[7:]])
    assert not bagua.utils.check_contiguous([buffer[:4], buffer[5:]]) and not bagua.utils.check_contiguous([f32, other])
    assert torch.equal(bagua.utils.get_flattened_tensor([f32, other]), torch.cat([f32, other]))
    assert bagua.utils.get_flattened_tensor([]) is None
    names = [bagua.utils.to_bagua_datatype(d) for d in (torch.float32, torch.float16, torch.uint8, torch.int64)]
    assert names == ["f32", "f16", "u8", "i64"]
    with pytest.raises(ValueError, match="unsupported data type torch.float64"):
        bagua.utils.to_bagua_datatype(torch.float64)


def test_qadam_is_adam_on_averaged_gradients_during_warmup_then_compressed(averaging_two):
    ours = [ok(r["qadam_runs"])["ours"] for r in averaging_two]
    ref = [ok(r["qadam_runs"])["torch"] for r in averaging_two]
    for rank in range(2):
        for t in range(sc.QADAM_WARMUP - 1):  # steps 1 .. warmup-1: Adam on the averaged gradient
            assert_same(ours[rank][t], ref[rank][t])
    for t in range(sc.QADAM_WARMUP, 2 * sc.QADAM_WARMUP):
        assert_same(ours[1][t], ours[0][t])  # compressed momentum: the same bits on every rank
        assert not torch.equal(ours[0][t]["param/conv.weight"], ref[0][t]["param/conv.weight"])


def test_qadam_optimizer_is_torch_adam_before_its_warmup():
    from functional_bagua.compat.algorithms.q_adam import QAdamOptimizer

    gen = seeded(13)
    start = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opt = QAdamOptimizer(ours, lr=1e-3, warmup_steps=2000, weight_decay=0.1)
    ref = torch.optim.Adam(theirs, lr=1e-3, weight_decay=0.1, foreach=False)
    for _ in range(100):
        for ps, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            sum((p**2).sum() * (i + 1) for i, p in enumerate(ps)).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    with pytest.raises(ValueError, match="warmup_steps"):
        QAdamOptimizer(ours, warmup_steps=0)


def test_async_averaging_runs_in_the_background_and_stops_cleanly(averaging_two):
    results = [ok(r["async_average"]) for r in averaging_two]
    for name in results[0]["after_warmup"]:  # the warmup averaged gradients: replicas equal
        assert torch.equal(results[0]["after_warmup"][name], results[1]["after_warmup"][name])
    assert all(r["rounds"] > 0 for r in results)
    for name in results[0]["final"]:  # idle replicas averaged by the thread
        torch.testing.assert_close(results[0]["final"][name], results[1]["final"][name], rtol=1e-12, atol=1e-14)
    assert all(r["threads"] == [] for r in results)
    # Bagua's _AsyncInternalState: new at wrap time, started, stopped by abort, started by resume
    assert all(r["statuses"] == ["NEW", "STARTED", "STOPPED", "STARTED", "STOPPED"] for r in results)


def test_one_model_through_all_six_algorithms(averaging_two):
    for result in averaging_two:
        got = ok(result["every_algorithm_in_turn"])
        assert got["finite"]
        assert list(got["steps"]) == [
            "bytegrad",
            "decentralized",
            "gradient_allreduce",
            "qadam",
            "async",
            "low_precision_decentralized",
        ]


BAGUA_SHUTDOWN_SCRIPT = """
import os, sys
import torch
import functional_bagua.compat as bagua
from functional_bagua.compat import communication
from functional_bagua.compat.algorithms import gradient_allreduce

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if "gloo" in n]

def main():
    bagua.init_process_group()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())  # model and engine: a cycle
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert gloo_threads()

main()
communication._destroy_at_exit()  # what the exit hook runs
print("gloo threads after the exit hook:", gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
def test_the_exit_hook_leaves_no_gloo_thread_behind():
    """A wrapped model references its engine and back; the group they hold kept gloo's threads past
    destroy_process_group, and the interpreter's shutdown then aborted about one run in five."""
    from dist_harness import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    result = subprocess.run(
        [sys.executable, "-c", BAGUA_SHUTDOWN_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gloo threads after the exit hook: []" in result.stdout, result.stdout
