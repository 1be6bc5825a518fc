"""FSDP2 on 2 and 4 gloo ranks: a fused optimizer over the flat buffers of each rank's local
shards equals one process training the whole model on the global batch, and FSDP2 with
torch.optim's AdamW; its state stays sharded; per-tensor rules are refused there."""

from __future__ import annotations

import pytest
import torch
from dist_harness import ScenarioError, run_ranks
from fsdp2_scenarios import PER_TENSOR_RULES, STEPS, SUMMING_RULES, global_batches, loss_of, make_model

import functional_bagua as fb

pytestmark = pytest.mark.cpu_only("spawned gloo ranks on the CPU")


@pytest.fixture(scope="module", params=[2, 4], ids=["two", "four"])
def ranks(request):
    results = run_ranks(request.param, ["all_scenarios"], module="fsdp2_scenarios")
    for rank, result in enumerate(results):
        assert not isinstance(result.get("all_scenarios"), ScenarioError), (rank, result.get("all_scenarios"))
    return [result["all_scenarios"] for result in results]


def one_process(world_size: int) -> dict:
    """torch.optim.AdamW on the whole model, each step on the whole global batch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in global_batches(world_size):
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def one_process_of(tx: fb.GradientTransformation, world_size: int) -> dict:
    """``tx`` unfused on the whole model's parameter tree, each step on the whole global batch."""
    model = make_model()
    params = {name: p.detach() for name, p in model.named_parameters()}
    state = tx.init(params)
    for batch in global_batches(world_size):
        grads = torch.func.grad(lambda p: loss_of(lambda x: torch.func.functional_call(model, p, (x,)), batch))(params)
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("name", list(SUMMING_RULES))
def test_norms_over_local_shards_are_the_whole_tensors_norms(ranks, name):
    """LAMB's and LARS's per-tensor norms and clip_by_global_norm's global norm: this rank's
    parts summed across the ranks (one all-reduce per buffer), as one process on the whole
    tensors."""
    expected = one_process_of(SUMMING_RULES[name](), len(ranks))
    for rank, result in enumerate(ranks):
        for key, want in expected.items():
            torch.testing.assert_close(
                result[name]["params"][key], want, rtol=1e-12, atol=1e-14, msg=lambda m: f"rank {rank} {key}: {m}"
            )


def test_fused_adamw_on_local_shards_equals_one_process_and_fsdp2_with_torch_adamw(ranks):
    expected = one_process(len(ranks))
    for rank, result in enumerate(ranks):
        for name, want in expected.items():
            for got in (result["fused"]["params"][name], result["torch"]["params"][name]):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=lambda m: f"rank {rank} {name}: {m}")


def test_the_fused_state_holds_this_ranks_shards_only(ranks):
    whole = sum(p.numel() for p in make_model().parameters())
    local = [result["fused"]["local elements"] for result in ranks]
    assert sum(local) == whole
    for rank, result in enumerate(ranks):
        assert result["fused"]["keys"] == ["float64@cpu:shard0"]
        # mu and nu: one buffer each, of this rank's elements (the count is 0-dim)
        assert result["fused"]["moment elements"] == [local[rank], local[rank]], f"rank {rank}"


@pytest.mark.parametrize("name", list(PER_TENSOR_RULES))
def test_a_per_tensor_rule_over_local_shards_is_refused_with_the_reason(ranks, name):
    for rank, result in enumerate(ranks):
        message = result["refused"][name]
        assert message is not None, f"rank {rank} ran on"
        assert "local shards" in message and "each rank holds a part of each tensor" in message, message


@pytest.mark.parametrize("name", ["flatten_parameters", "flatten_module"])
def test_re_pointing_dtensor_parameters_into_flat_buffers_is_refused(ranks, name):
    """FSDP2 owns its shards: p.data = view would leave them where they are (the buffers' writes lost)."""
    for rank, result in enumerate(ranks):
        message = result["flattening"][name]
        assert message is not None, f"rank {rank} ran on"
        assert "DTensors" in message and "p.to_local()" in message


def test_a_fused_state_over_local_shards_saved_with_dcp_resumes_on_another_number_of_ranks(tmp_path, monkeypatch):
    """Saved on 2 ranks after half the steps (each buffer's piece of a parameter as a DTensor of
    that parameter), resumed on 4: the parameters of one process running AdamW through the
    same global batches."""
    monkeypatch.setenv("FB_DCP_DIR", str(tmp_path))
    saved = run_ranks(2, ["dcp_save"], module="fsdp2_scenarios")
    assert not isinstance(saved[0].get("dcp_save"), ScenarioError), saved[0].get("dcp_save")
    assert any(key.endswith("/0.weight") for key in saved[0]["dcp_save"]["opt keys"])  # per parameter
    resumed = run_ranks(4, ["dcp_resume"], module="fsdp2_scenarios")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    half = STEPS // 2
    for batch in global_batches(2)[:half] + global_batches(4)[half:]:
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
    for rank, result in enumerate(resumed):
        got = result.get("dcp_resume")
        assert not isinstance(got, ScenarioError) and got is not None, got
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                got[name], p.detach(), rtol=1e-12, atol=1e-14, msg=lambda m: f"rank {rank} {name}: {m}"
            )
