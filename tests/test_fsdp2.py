"""FSDP2 on 2 and 4 gloo ranks: a fused optimizer over the flat buffers of each rank's local
shards equals one process training the whole model on the global batch, and FSDP2 with
torch.optim's AdamW; its state stays sharded; per-tensor rules are refused there."""

from __future__ import annotations

import pytest
import torch
from dist_harness import ScenarioError, run_ranks
from fsdp2_scenarios import (
    INDUCTOR_UP_TO,
    ON_OWNERS,
    PER_TENSOR_RULES,
    STEPS,
    SUMMING_RULES,
    TRAIN_STEPS,
    global_batches,
    inductor,
    loss_of,
    make_model,
    muon_and_adamw,
)

import functional_bagua as fb
from functional_bagua.distributed.whole_tensors import OwnerPlan, rows_per_rank

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


def one_process_on(tx: fb.GradientTransformation, grads: list) -> dict:
    """``tx`` unfused on the whole model's parameter tree, stepped with the given gradients."""
    params = {name: p.detach() for name, p in make_model().named_parameters()}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
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


def test_fused_muon_orthogonalizes_each_whole_matrix_on_its_owner_with_two_collectives_a_step(ranks):
    """Muon fused over the matrices' local shards: each matrix gathered whole to one rank,
    orthogonalized there, its rows sent back (two all-to-alls per step for all the matrices),
    equal to one process on the whole matrices (Newton-Schulz in bfloat16 on the same values)."""
    expected = one_process_of(muon_and_adamw(), len(ranks))
    for rank, result in enumerate(ranks):
        for key, want in expected.items():
            torch.testing.assert_close(
                result["muon"]["params"][key], want, rtol=1e-12, atol=1e-14, msg=lambda m: f"rank {rank} {key}: {m}"
            )
        for step in result["muon"]["muon collectives"]:
            assert step == {"c10d_functional.all_to_all_single": 2}, (rank, step)


@pytest.mark.parametrize("name", list(ON_OWNERS))
def test_on_owners_runs_a_whole_tensor_rule_with_state_on_each_tensors_owner(ranks, name):
    """fbd.on_owners(Adafactor or SOAP) fused over the local shards: each tensor's gradient and
    parameter gathered whole to its owner rank, which keeps its state (the ranks' states add up
    to one process's), two all-to-alls a step; the parameters of one process running the
    transform unfused on the same gradients (FSDP2's averages: SOAP's eigenbases of rank-deficient
    statistics turn with the last bits of a gradient, so one process's own sums would not do)."""
    expected = one_process_on(ON_OWNERS[name](), ranks[0][f"on owners, {name}"]["whole grads"])
    params = {k: p.detach() for k, p in make_model().named_parameters()}
    layout = fb.FlatLayout.of(params)  # the owners run it fused: per-buffer vectors (counts) included
    whole_state = fb.tree.flatten(fb.fuse(ON_OWNERS[name](), layout).init(layout.flatten(params)))[0]
    held = sum(t.numel() for t in whole_state if isinstance(t, torch.Tensor) and t.dim() > 0)
    assert sum(result[f"on owners, {name}"]["state elements"] for result in ranks) == held
    for rank, result in enumerate(ranks):
        got = result[f"on owners, {name}"]
        for key, want in expected.items():
            torch.testing.assert_close(
                got["params"][key], want, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} {key}: {m}"
            )
        for step in got["collectives"]:
            assert step == [{"c10d_functional.all_to_all_single": 2}], (rank, step)
        # each rank's state is its own tensors': DCP would save one rank's and load it into all
        assert "on_owners' state" in got["dcp refused"] and "torch.save(fb.state_dict(state))" in got["dcp refused"]


def test_optimizer_with_on_owners_steps_fsdp2s_dtensors_with_each_tensors_state_on_its_owner(ranks):
    """fb.Optimizer(fbd.on_owners(soap)) on the FSDP2 model's DTensor parameters: the local
    shards laid out in flat buffers inside, each tensor's SOAP on its owner (two all-to-alls a
    step), the updates back as DTensors; one process's unfused SOAP on the same gradients."""
    for rank, result in enumerate(ranks):
        got = result["optimizer on owners, soap"]
        expected = one_process_on(ON_OWNERS["soap"](), got["whole grads"])
        for key, want in expected.items():
            torch.testing.assert_close(
                got["params"][key], want, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} {key}: {m}"
            )
        # the first step() also makes the state, which gathers the parameters to their owners
        assert got["collectives"][0] == {"c10d_functional.all_to_all_single": 3}, (rank, got["collectives"])
        for step in got["collectives"][1:]:
            assert step == {"c10d_functional.all_to_all_single": 2}, (rank, step)


def test_optimizer_muon_on_dtensors_orthogonalizes_each_whole_matrix_on_its_owner(ranks):
    """fb.Optimizer(muon) on the FSDP2 model's DTensor parameters: the same gather to owners
    (two all-to-alls per step), not Newton-Schulz's matmuls on DTensors (a collective each)."""
    expected = one_process_of(muon_and_adamw(), len(ranks))
    for rank, result in enumerate(ranks):
        for key, want in expected.items():
            torch.testing.assert_close(
                result["optimizer muon"]["params"][key],
                want,
                rtol=1e-12,
                atol=1e-14,
                msg=lambda m: f"rank {rank} {key}: {m}",
            )
        for step in result["optimizer muon"]["collectives"]:
            assert step == {"c10d_functional.all_to_all_single": 2}, (rank, step)


def test_fused_adamw_on_local_shards_equals_one_process_and_fsdp2_with_torch_adamw(ranks):
    expected = one_process(len(ranks))
    for rank, result in enumerate(ranks):
        for name, want in expected.items():
            for got in (result["fused"]["params"][name], result["torch"]["params"][name]):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("variant", list(TRAIN_STEPS))
def test_make_train_step_on_an_fsdp2_model_equals_fsdp2_with_torch_adamw(ranks, variant):
    """The step runs forward and backward through the FSDP2 model (its gathers and reduce-
    scatters) and our update on the shards: the parameters of FSDP2 + torch.optim.AdamW. The
    variant inductor compiles runs on 2 ranks only (INDUCTOR_UP_TO); the one compiled with
    aot_eager (dynamo's graphs of FSDP2's hooks and the update) on 4 too."""
    if inductor(TRAIN_STEPS[variant][2]) and len(ranks) > INDUCTOR_UP_TO:
        pytest.skip(f"inductor's steps are tested on up to {INDUCTOR_UP_TO} ranks: each rank compiles its own update")
    for rank, result in enumerate(ranks):
        for name, want in result["torch"]["params"].items():
            torch.testing.assert_close(
                result["train steps"][variant]["params"][name],
                want,
                rtol=1e-12,
                atol=1e-14,
                msg=lambda m: f"rank {rank} {name}: {m}",
            )
        assert len(result["train steps"][variant]["losses"]) == STEPS


def test_mixed_precision_trains_float32_master_shards_as_fsdp2_with_torch_adamw(ranks):
    """bfloat16 forward and backward, float32 reduce-scatter: the fused AdamW steps the float32
    shards FSDP2 keeps (master weights, float32 moments) to the numbers of torch's fused AdamW
    (within float32 rounding: torch's CPU kernel computes an element in a vector lane or in its
    scalar tail depending on where it lies, a flat buffer or a tensor of its own)."""
    for rank, result in enumerate(ranks):
        got = result["mixed precision"]
        assert got["keys"] == ["float32@cpu:shard0"] and got["state dtypes"] == ["torch.float32"]
        for name, want in got["torch"].items():
            assert got["fb"][name].dtype == torch.float32
            torch.testing.assert_close(
                got["fb"][name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}"
            )


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
        assert "fbd.on_owners(tx)" in message, message


def test_prodigy_over_local_shards_is_refused_with_the_reason(ranks):
    """Its estimate d sums over every coordinate of every tensor: one rank's shards would give
    each rank its own d."""
    for rank, result in enumerate(ranks):
        message = result["refused"]["prodigy"]
        assert message is not None, f"rank {rank} ran on"
        assert "scale_by_prodigy cannot run inside fuse() over DTensors' local shards" in message, message
        assert "its step size d sums over every coordinate of every tensor" in message, message


@pytest.mark.parametrize(
    "case, words",
    [
        ("allreduce_gradients", ["reduce-scatters itself", "drop allreduce_gradients"]),
        ("copies as params", ["is not the model's parameter", "fb.params_of(model)"]),
        ("max_buffer_mb", ["max_buffer_mb cuts buffers", "max_buffer_mb=None"]),
        ("on_owners without a gradient", ["a gradient is None", "requires_grad_(False)"]),
        ("on_owners compiled", ["on_owners runs eagerly", "compile=False"]),
    ],
)
def test_what_would_train_wrong_on_an_fsdp2_model_is_refused(ranks, case, words):
    """A second all-reduce of FSDP2's reduced gradients; parameters that are copies (the step
    writes into the model's shards, which FSDP2 gathers, so copies would not train); buffers cut
    by each rank's shard sizes (the ranks' buffers would differ); on_owners missing a gradient or
    compiled (its bookkeeping is not traceable: a clear error instead of dynamo's)."""
    for result in ranks:
        message = result["refused steps"][case]
        assert message is not None and all(word in message for word in words), message


def test_on_owners_outside_a_fused_update_over_shards_says_where_it_runs():
    import functional_bagua.distributed as fbd

    params = {"w": torch.zeros(3, 2)}
    with pytest.raises(ValueError, match=r"runs on DTensors sharded by rows .* or inside fb.fuse\(tx, layout\)"):
        fbd.on_owners(fb.adafactor()).init(params)
    layout = fb.FlatLayout.of(params)  # plain tensors: whole already
    with pytest.raises(ValueError, match="use inner itself"):
        fb.fuse(fbd.on_owners(fb.adafactor()), layout).init(layout.flatten(params))
    with pytest.raises(TypeError, match="not a GradientTransformation"):
        fbd.on_owners(fb.adafactor)


def test_rows_per_rank_are_torch_chunks_split():
    for rows in range(12):
        for world_size in range(1, 6):
            chunks = [len(c) for c in torch.arange(rows).chunk(world_size)] if rows else []
            assert rows_per_rank(rows, world_size) == chunks + [0] * (world_size - len(chunks)), (rows, world_size)


def test_an_owner_plan_refuses_shards_of_another_split():
    with pytest.raises(ValueError, match=r"local shard of shape \(4, 3\) on rank 1.*gives \(3, 3\)"):
        OwnerPlan([(10, 3)], [(4, 3)], rank=1, world_size=4, group=None)


@pytest.mark.parametrize("name", ["flatten_parameters", "flatten_module"])
def test_re_pointing_dtensor_parameters_into_flat_buffers_is_refused(ranks, name):
    """FSDP2 owns its shards: p.data = view would leave them where they are (the buffers' writes lost)."""
    for rank, result in enumerate(ranks):
        message = result["flattening"][name]
        assert message is not None, f"rank {rank} ran on"
        assert "DTensors" in message and "p.to_local()" in message


def test_a_fused_state_over_local_shards_saved_with_dcp_resumes_on_other_numbers_of_ranks(tmp_path, monkeypatch):
    """A run on 4 ranks saved after its first step (each buffer's piece of a parameter as a
    DTensor of that parameter), resumed on 2 for two steps and saved, resumed on 3 (uneven
    shards) for the last: the parameters of one process running AdamW through the same global
    batches."""
    legs = [(4, None, "a", (0, 1)), (2, "a", "b", (1, 3)), (3, "b", None, (3, STEPS))]
    for world_size, load, save, (first, last) in legs:
        monkeypatch.setenv("FB_DCP_LOAD", str(tmp_path / load) if load else "")
        monkeypatch.setenv("FB_DCP_SAVE", str(tmp_path / save) if save else "")
        monkeypatch.setenv("FB_DCP_STEPS", f"{first}:{last}")
        results = run_ranks(world_size, ["dcp_leg"], module="fsdp2_scenarios")
        for rank, result in enumerate(results):
            got = result.get("dcp_leg")
            assert not isinstance(got, ScenarioError) and got is not None, (world_size, rank, got)
    assert any(key.endswith("/0.weight") for key in got["opt keys"])  # per parameter
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for world_size, _, _, (first, last) in legs:
        for batch in global_batches(world_size)[first:last]:
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad()
    for rank, result in enumerate(results):
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                result["dcp_leg"]["params"][name],
                p.detach(),
                rtol=1e-12,
                atol=1e-14,
                msg=lambda m: f"rank {rank} {name}: {m}",
            )
