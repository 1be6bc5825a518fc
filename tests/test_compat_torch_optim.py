"""functional_bagua.compat.optim against torch.distributed.optim's own classes on 2 and 4 gloo
ranks: PostLocalSGDOptimizer with the periodic and hierarchical averagers, state dicts, bad input."""

from __future__ import annotations

import pytest
import torch
from dist_harness import ScenarioError, run_ranks

from functional_bagua.compat.optim import averagers

pytestmark = pytest.mark.cpu_only("spawned gloo ranks on the CPU (CUDA ranks: test_cuda_distributed.py)")

TWO_RANKS = [
    "post_local_sgd_all",
    "averagers_take_parameters_groups_and_generators",
    "state_dict_round_trip",
    "bad_averagers",
]
FOUR_RANKS = ["post_local_sgd_all"]


@pytest.fixture(scope="module")
def two():
    return run_ranks(2, TWO_RANKS, module="torch_optim_scenarios")


@pytest.fixture(scope="module")
def four():
    return run_ranks(4, FOUR_RANKS, module="torch_optim_scenarios")


def ok(result):
    assert not isinstance(result, ScenarioError), result
    return result


@pytest.mark.parametrize(
    "world,averager",
    [(w, a) for w in ("two", "four") for a in ("periodic", "periodic-view", "hierarchical")]
    + [("four", "hierarchical-3")],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_post_local_sgd_equals_torchs_step_for_step(world, optimizer, averager, request):
    """torch DDP + post_localSGD_hook, 8 float64 steps: our PostLocalSGDOptimizer with our
    averager gives torch's parameters bit for bit after every step (also with DDP's gradients as
    bucket views, and with three levels of averaging groups of 1, 2 and 4 ranks)."""
    for result in request.getfixturevalue(world):
        got = ok(result["post_local_sgd_all"])
        ours, theirs = got[f"ours/{optimizer}/{averager}"], got[f"torch/{optimizer}/{averager}"]
        assert len(ours) == len(theirs) == 8
        for t, (a, b) in enumerate(zip(ours, theirs)):
            for name in b:
                assert torch.equal(a[name], b[name]), (t, name)


def test_averaging_is_not_a_no_op(four):
    """The runs above would agree if nothing averaged: the ranks' parameters differ between
    averages and agree right after one (step 5: (5 - 2) % 3 == 0)."""
    results = [ok(r["post_local_sgd_all"])["ours/sgd/periodic"] for r in four]
    assert not torch.equal(results[0][3]["fc.weight"], results[1][3]["fc.weight"])
    assert all(torch.equal(r[5]["fc.weight"], results[0][5]["fc.weight"]) for r in results)


def test_averagers_take_generators_and_param_groups_and_skip_parameters_without_gradients(two):
    rank0, rank1 = (ok(r["averagers_take_parameters_groups_and_generators"]) for r in two)
    for form in ("generator", "groups"):
        for name in ("conv.weight", "fc.weight"):
            expected = (rank0["start"][name] + rank1["start"][name]) / 2
            torch.testing.assert_close(rank0[form][name], expected, rtol=1e-15, atol=0)
            assert torch.equal(rank0[form][name], rank1[form][name])
        assert torch.equal(rank0[form]["fc.bias"], rank0["start"]["fc.bias"])  # no gradient: left alone
        assert not torch.equal(rank1[form]["fc.bias"], rank0[form]["fc.bias"])


def test_state_dict_keeps_the_averagers_step_and_warns_when_it_is_missing(two):
    got = ok(two[0]["state_dict_round_trip"])
    assert got["saved_step"] == 3 and got["loaded_step"] == 3 and got["loaded_state_equal"]
    assert got["missing_step"] == 0
    assert any("does not contain a step counter" in w for w in got["warnings"])


def test_bad_averagers_and_optimizers_are_named(two):
    got = ok(two[0]["bad_averagers"])
    assert got["period 0"][0] == "ValueError" and "period" in got["period 0"][1]
    assert got["negative warmup"][0] == "ValueError"
    assert got["empty hierarchy"][0] == "ValueError" and "must not be empty" in got["empty hierarchy"][1]
    assert (
        got["last size not the world"][0] == "ValueError"
        and "must be equal to the size" in got["last size not the world"][1]
    )
    assert got["not an optimizer"][0] == "TypeError"


def test_an_averager_without_a_process_group_says_so():
    with pytest.raises(RuntimeError, match="init_process_group"):
        averagers.PeriodicModelAverager(period=2)


# ---- ZeroRedundancyOptimizer -------------------------------------------------------------------

ZERO_TWO = [
    "zero_all",
    "zero_resume",
    "zero_bad_input",
    "zero_join_uneven_inputs",
    "zero_overlap_all",
    "zero_overlap_bad_input",
    "zero_behaviours",
    "zero_join_with_another_joinable",
]


@pytest.fixture(scope="module")
def zero_two():
    return run_ranks(2, ZERO_TWO, module="torch_optim_scenarios")


@pytest.fixture(scope="module")
def zero_four():
    return run_ranks(4, ["zero_all", "zero_overlap_all", "zero_on_a_subgroup"], module="torch_optim_scenarios")


def assert_traces_equal(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        for name in b:
            assert torch.equal(a[name], b[name]), (t, name, (a[name] - b[name]).abs().max())


def assert_state_dicts_equal(ours: dict, theirs: dict) -> None:
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert entry.keys() == ours["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(ours["state"][index][key]), torch.as_tensor(value)), (index, key)


@pytest.mark.parametrize("setup", ["plain", "bucket_view", "groups"])
@pytest.mark.parametrize("case", ["sgd", "adam-for-loop", "adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("world", ["zero_two", "zero_four"])
def test_zero_equals_torchs_step_for_step_and_in_its_state_dict(world, case, setup, request):
    """DDP + ZeroRedundancyOptimizer, 6 float64 steps: ours gives torch's parameters bit for bit
    after every step, and the same consolidated state dict (two param groups with a third added
    mid-training; parameters as bucket views)."""
    results = request.getfixturevalue(world)
    for rank, result in enumerate(results):
        got = ok(result["zero_all"])
        ours, theirs = got[f"ours/{case}/{setup}"], got[f"torch/{case}/{setup}"]
        assert_traces_equal(ours["trace"], theirs["trace"])
        assert 0 < ours["local_entries"] < ours["total"]  # this rank's shard of the state only
        assert ours["local_entries"] == theirs["local_entries"]
        if setup == "bucket_view":
            assert ours["params_view_buckets"]
        if rank == 0:
            assert_state_dicts_equal(ours["state"], theirs["state"])


def test_zero_resumes_from_a_consolidated_state_as_if_uninterrupted(zero_two):
    for result in zero_two:
        for got in ok(result["zero_resume"]).values():
            assert_traces_equal(got["resumed"], got["uninterrupted"])


def test_zero_state_saved_on_four_ranks_resumes_on_two(tmp_path, monkeypatch):
    """Beyond torch: the consolidated state of 4 ranks loads on 2, and training goes on exactly as
    the optimizer class holding the whole state would."""
    monkeypatch.setenv("FB_TEST_DIR", str(tmp_path))
    saved = run_ranks(4, ["zero_save_for_other_world"], module="torch_optim_scenarios")
    assert all(ok(r["zero_save_for_other_world"]) == "saved" for r in saved)
    for result in run_ranks(2, ["zero_load_from_other_world"], module="torch_optim_scenarios"):
        got = ok(result["zero_load_from_other_world"])
        assert_traces_equal(got["zero"], got["plain"])


def test_zero_under_join_with_uneven_inputs_equals_torchs(zero_two):
    for result in zero_two:
        got = ok(result["zero_join_uneven_inputs"])
        for name in got["torch"]:
            assert torch.equal(got["ours"][name], got["torch"][name]), name


def test_zero_bad_input_is_named(zero_two):
    got = ok(zero_two[0]["zero_bad_input"])
    assert got["state_dict before consolidating"][0] == "RuntimeError"
    assert "consolidate_state_dict" in got["state_dict before consolidating"][1]
    assert got["optimizer_class not a class"][0] == "TypeError"
    assert got["empty parameters"][0] == "ValueError"


def test_zero_without_a_process_group_says_so():
    from functional_bagua.compat.optim import ZeroRedundancyOptimizer

    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.ones(2))], optimizer_class=torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("setup", ["plain", "fp16", "view", "groups"])
@pytest.mark.parametrize("case", ["sgd", "adam-for-loop", "adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("world", ["zero_two", "zero_four"])
def test_zero_overlapped_with_ddp_equals_the_plain_optimizer_class(world, case, setup, request):
    """overlap_with_ddp=True with our hook_with_zero_step and hook_with_zero_step_interleaved on
    gloo (DDP buckets of ~1 KB, so several per backward): 6 float64 steps give the parameters of the
    optimizer class stepped after DDP's backward with the same comm hook, bit for bit, from the
    first step on, and the consolidated state dict is that class's own."""
    for rank, result in enumerate(request.getfixturevalue(world)):
        got = ok(result["zero_overlap_all"])
        reference = got[f"{case}/{setup}/none"]
        for hook in ("step", "interleaved"):
            mine = got[f"{case}/{setup}/{hook}"]
            assert_traces_equal(mine["trace"], reference["trace"])
            assert 0 < mine["local_entries"] < reference["local_entries"]
            if rank == 0:
                assert_state_dicts_equal(mine["state"], reference["state"])
            assert not torch.equal(mine["start"]["fc.weight"], mine["trace"][0]["fc.weight"])  # stepped at once


def test_zero_overlap_bad_input_is_named(zero_two):
    got = ok(zero_two[0]["zero_overlap_bad_input"])
    assert got["torch's hook"][0] == "TypeError" and "functional_bagua.compat.optim" in got["torch's hook"][1]
    assert got["without overlap"][0] == "ValueError" and "overlap_with_ddp=True" in got["without overlap"][1]
    assert got["torch's zero"][0] == "TypeError"
    assert got["another model's zero"][0] == "ValueError" and "fc.weight" in got["another model's zero"][1]
    assert got["step returns"] is None and got["unchanged"]
    assert any("does nothing" in m for m in got["step warned"])


def same(a, b) -> bool:
    """Equal trees of tensors, numbers, strings and containers (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(
    "behaviour",
    [
        "scheduler",
        "zero_grad",
        "kwargs",
        "without closure",
        "closure view=False",
        "closure view=True",
        "maximize",
        "toggled requires_grad view=False",
        "toggled requires_grad view=True",
        "plain state loaded",
        "constructor",
    ],
)
def test_zero_behaves_as_torchs_where_torchs_own_cpu_tests_look(zero_two, behaviour):
    """What torch's own ZeRO tests check on the CPU (an lr scheduler moving the lr, step keyword
    arguments and keys the inner step adds, optimizers whose step takes no closure, a closure's
    loss, maximize, parameters frozen and unfrozen mid-training, a plain optimizer's state loaded,
    the constructor's errors), ours against torch's class on the same ranks and data."""
    for result in zero_two:
        got = ok(result["zero_behaviours"])
        assert same(got["ours"][behaviour], got["torch"][behaviour]), behaviour
    got = ok(zero_two[0]["zero_behaviours"])["ours"]
    expected = {
        "zero_grad": lambda v: all(g is None for g in v),
        "kwargs": lambda v: v[0] == ["called"] and v[1] == 0.5,
        "scheduler": lambda v: [lr for _, lr in v] == [0.05, 0.025, 0.0125, 0.00625],
        "constructor": lambda v: (
            v["empty"] == "ValueError"
            and v["a tensor"] == v["a float"] == v["a list with an int"] == "TypeError"
            and v["sparse"] == v["two dtypes"] == "ValueError"
            and v["groups"] == 2
        ),
    }
    if behaviour in expected:
        assert expected[behaviour](got[behaviour]), got[behaviour]


def test_zero_under_join_with_a_joinable_reading_its_parameters_equals_torchs(zero_two):
    for result in zero_two:
        got = ok(result["zero_join_with_another_joinable"])
        assert same(got["ours"], got["torch"])


def test_zero_on_a_subgroup_equals_torchs(zero_four):
    for result in zero_four:
        got = ok(result["zero_on_a_subgroup"])
        assert same(got["ours"]["trace"], got["torch"]["trace"]) and got["ours"]["local"] == got["torch"]["local"]
    assert not same(ok(zero_four[0]["zero_on_a_subgroup"])["ours"], ok(zero_four[1]["zero_on_a_subgroup"])["ours"])
