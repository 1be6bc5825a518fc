"""functional_bagua.compat.optim.DistributedOptimizer against torch's, over RPC (3 TensorPipe
workers on loopback): SGD, Adam, AdamW through functional_bagua's aliases, a user's class,
parameters without a gradient, concurrent clients, remote errors."""

from __future__ import annotations

import pytest
import torch
from dist_harness import ScenarioError, run_rpc

pytestmark = pytest.mark.cpu_only("RPC workers (TensorPipe) on the CPU")

NAMES = ["against_torch", "custom_class", "concurrent_clients", "errors", "torch_test_configs", "frozen_parameters"]


@pytest.fixture(scope="module")
def results():
    return run_rpc(3, NAMES, module="rpc_scenarios")


def remote_start() -> dict:
    from rpc_scenarios import SHAPES, make_param

    return {name: make_param(i, shape).detach() for i, (name, shape) in enumerate(SHAPES.items())}


def ok(result):
    assert not isinstance(result, ScenarioError), result
    return result


def assert_traces_close(ours: list, theirs: list, exact: bool = False) -> None:
    assert len(ours) == len(theirs) == 5
    for t, (a, b) in enumerate(zip(ours, theirs)):
        for name in b:
            if exact:
                assert torch.equal(a[name], b[name]), (t, name)
            else:
                torch.testing.assert_close(
                    a[name], b[name], rtol=1e-12, atol=1e-14, msg=lambda m: f"step {t} {name}: {m}"
                )


@pytest.mark.parametrize("case", ["sgd", "adam", "adamw", "adamw-foreach", "adagrad"])
def test_equals_torchs_distributed_optimizer_step_for_step(results, case):
    """The owners step with functional_bagua's alias (torch's fused kernel for SGD/Adam/AdamW, the
    compiled pure update for Adagrad); torch's uses its TorchScript functional optimizer: the same
    numbers up to float64 rounding, a skipped bias included (step 2). With foreach=True, which
    torch's refuses, ours equals torch's run without it."""
    got = ok(results["against_torch"])[case]
    assert_traces_close(got["ours"], got["torch"])
    assert torch.equal(got["ours"][2]["b1"], got["ours"][1]["b1"])  # no gradient on step 2: not moved
    assert not torch.equal(got["ours"][3]["b1"], got["ours"][2]["b1"])


def test_a_parameter_whose_first_gradient_comes_late_starts_its_momentum_then(results):
    got = ok(results["against_torch"])["sgd-late-bias"]
    assert_traces_close(got["ours"], got["torch"])
    assert torch.equal(got["ours"][0]["b1"], remote_start()["b1"])  # no gradient on step 0: not moved


def test_torchs_refuses_foreach_where_ours_runs(results):
    assert "foreach" in ok(results["against_torch"])["torch refuses foreach"]


def test_a_class_without_an_alias_runs_itself_and_skips_parameters_without_a_gradient(results):
    """A user's class runs as itself: torch's numbers while every parameter has a gradient. On
    step 2 the bias has none: ours leaves it; torch's, without TorchScript, steps it again with the
    gradient of the step before (it only sets the gradients the context has)."""
    got = ok(results["custom_class"])
    for t in (0, 1):
        for name in got["torch"][t]:
            assert torch.equal(got["ours"][t][name], got["torch"][t][name]), (t, name)
    assert torch.equal(got["ours"][2]["b1"], got["ours"][1]["b1"])
    assert not torch.equal(got["torch"][2]["b1"], got["torch"][1]["b1"])


def test_concurrent_clients_each_step(results):
    got = ok(results["concurrent_clients"])
    for name, start in got["start"].items():
        expected = start.clone()
        for _ in range(12):
            expected -= 0.125  # lr * gradient 1, exact in binary
        assert torch.equal(got["end"][name], expected), name


def test_remote_errors_reach_the_caller(results):
    got = ok(results["errors"])
    assert "fails on purpose" in got["remote step error"][1]
    assert "Invalid learning rate" in got["remote constructor error"][1]
    assert got["not an rref"][0] == "TypeError"


@pytest.mark.parametrize(
    "config", ["adam-amsgrad", "adamw-amsgrad", "sgd-nesterov", "adadelta", "rmsprop", "adamax", "rprop"]
)
def test_the_configurations_of_torchs_own_tests_equal_torchs(results, config):
    """As torch's tests check: equal to the torch.optim class stepping local parameters (to float64
    rounding); and within 1e-7 of torch's DistributedOptimizer, except for Rprop, where torch's
    own DistributedOptimizer is up to 2e-4 (relative) away from torch.optim.Rprop after 5 steps."""
    got = ok(results["torch_test_configs"])[config]
    assert_traces_close(got["ours"], got["local"])
    if config == "rprop":
        return
    for ours, theirs in zip(got["ours"], got["torch"]):
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("case", ["sgd", "rmsprop"])
def test_a_parameter_that_does_not_require_grad_is_accepted_and_never_stepped(results, case):
    """As torch's: accepted, left as it is; the caller is warned which one it is."""
    got = ok(results["frozen_parameters"])[case]
    start = remote_start()
    for ours, theirs in zip(got["ours"]["steps"], got["torch"]["steps"]):
        torch.testing.assert_close(ours["w"], theirs["w"], rtol=1e-12, atol=1e-14)
        assert torch.equal(ours["frozen"], theirs["frozen"])
    assert not torch.equal(got["ours"]["steps"][0]["w"], got["ours"]["steps"][1]["w"])
    assert any("params_rref[1]" in w and "do not require grad" in w for w in got["ours"]["warnings"])
    del start
