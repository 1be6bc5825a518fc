"""shard_by_tensor on 2 and 4 gloo ranks: each rank keeps the state of the whole tensors it owns,
and the parameters equal one process running the transform on the mean of all ranks' gradients
(SOAP, Shampoo, LAMB, Muon, AdamW); PSGD-Kron, whose probes each owner draws, equals one process
running it on the owner's tensors with the owner's draws."""

from __future__ import annotations

import pytest
import torch
from dist_harness import ScenarioError, run_ranks
from second_order_scenarios import (
    MATRIX_SHAPES,
    SHAPES,
    STEPS,
    WHOLE_TENSOR_MAKERS,
    local_gradients,
    seed,
    start,
)

import functional_bagua as fb
from functional_bagua.distributed.tensor_sharding import owners_by_size, weights

pytestmark = pytest.mark.cpu_only("spawned gloo ranks on the CPU")


@pytest.fixture(scope="module", params=[2, 4], ids=["two", "four"])
def ranks(request):
    results = run_ranks(request.param, ["sharded_by_tensor", "refused_by_tensor"], module="second_order_scenarios")
    for rank, result in enumerate(results):
        for name in ("sharded_by_tensor", "refused_by_tensor"):
            assert not isinstance(result[name], ScenarioError), (rank, result[name])
    return [{**result["sharded_by_tensor"], **result["refused_by_tensor"]} for result in results]


def one_process(inner, world, shapes=SHAPES, only=None):
    """The parameters after STEPS steps of ``inner`` on the mean gradients (of the tensors in
    ``only``, where given: the others stay as they start)."""
    params = {k: v for k, v in start().items() if k in shapes}
    keys = [k for k in params if only is None or k in only]
    state = inner.init({k: params[k] for k in keys})
    for step in range(STEPS):
        seed(step)
        per_rank = [local_gradients(r, step) for r in range(world)]
        mean = {k: sum(g[k] for g in per_rank) / world for k in keys}
        u, state = inner.update(mean, state, {k: params[k] for k in keys})
        params = {**params, **fb.apply_updates({k: params[k] for k in keys}, u)}
    return params


def assert_params_close(got, expected, rank):
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("name", ["soap", "shampoo", "lamb"])
def test_whole_tensor_transforms_equal_one_process_on_the_global_batch(ranks, name):
    expected = one_process(WHOLE_TENSOR_MAKERS[name](), len(ranks))
    for rank, result in enumerate(ranks):
        assert_params_close(result[name][0], expected, rank)


@pytest.mark.parametrize("name", ["soap"])
def test_a_compiled_second_order_update_under_it_equals_one_process(ranks, name):
    """Compiled, each shape's tensors step as one batch with the decompositions under
    ``torch.cond``, between the reduce-scatter and the all-gather (2 ranks)."""
    if len(ranks) != 2:
        pytest.skip("compiled on 2 ranks only (each rank compiles: the suite's time)")
    expected = one_process(WHOLE_TENSOR_MAKERS[name](), len(ranks))
    for rank, result in enumerate(ranks):
        assert_params_close(result[f"{name}, compiled"][0], expected, rank)


def test_muon_and_adamw_equal_one_process_on_the_global_batch(ranks):
    muon = one_process(fb.muon(lr=0.02), len(ranks), MATRIX_SHAPES)
    adamw = one_process(fb.adamw(1e-2), len(ranks))
    for rank, result in enumerate(ranks):
        assert_params_close(result["muon"][0], muon, rank)
        assert_params_close(result["adamw"][0], adamw, rank)


def test_psgd_kron_fits_each_tensor_on_its_owner_with_the_owners_draws(ranks):
    world = len(ranks)
    leaves = list(start().values())
    owners = owners_by_size(weights(WHOLE_TENSOR_MAKERS["psgd_kron"](), leaves, list(SHAPES)), world)
    for owner in range(world):
        mine = [k for k, r in zip(SHAPES, owners) if r == owner]
        expected = one_process(WHOLE_TENSOR_MAKERS["psgd_kron"](), world, only=mine)
        for rank, result in enumerate(ranks):
            assert_params_close(result["psgd_kron"][0], {k: expected[k] for k in mine}, rank)


def test_each_rank_holds_the_state_of_its_own_tensors_only(ranks):
    """The ranks' state bytes add up to one process's, each at most the whole over the ranks plus
    the largest tensor's share."""
    world = len(ranks)
    whole = fb.soap(group=None).init(start())
    whole_bytes = sum(t.numel() * t.element_size() for t in fb.tree.flatten(whole)[0] if isinstance(t, torch.Tensor))
    per_rank = [result["soap"][1] for result in ranks]
    assert sum(per_rank) == whole_bytes
    assert max(per_rank) < whole_bytes / world + whole_bytes / 3, per_rank


def test_a_none_gradient_is_refused_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        message = result["a None gradient"]
        assert message is not None and "gradient of 'a' is None" in message, f"rank {rank}: {message}"


def test_a_checkpoint_resumes_the_run_and_another_ranks_is_refused(ranks):
    expected = one_process(WHOLE_TENSOR_MAKERS["soap"](), len(ranks))
    for rank, result in enumerate(ranks):
        resumed = result["soap, resumed"]
        assert_params_close(resumed["params"], expected, rank)
        assert "the checkpoint belongs elsewhere" in (resumed["another rank's"] or ""), resumed["another rank's"]


def test_tensors_weigh_their_gradient_and_the_state_inner_keeps_for_them():
    """SOAP keeps two eigenbases and two statistics per matrix: a 6 x 6 weighs 36 + 2 * 36 (the
    moments) + 4 * 36 elements of float64, and the owners follow the weights, largest first."""
    leaves = [torch.zeros(6, 6, dtype=torch.float64), torch.zeros(40, dtype=torch.float64)]
    soap = weights(fb.soap(), leaves, ["m", "v"])
    adamw = weights(fb.adamw(), leaves, ["m", "v"])
    assert adamw == [8 * 36 * 3 + 8, 8 * 40 * 3 + 8]  # the gradient, two moments, and a count of int64
    assert soap[0] > adamw[0] and soap[0] >= 8 * 36 * 7
    assert owners_by_size([5, 9, 4, 3], 2) == [1, 0, 1, 0]


@pytest.mark.parametrize(
    "case, says",
    [
        ("clip_by_global_norm", "NotImplementedError: clip_by_global_norm cannot run inside shard_by_tensor()"),
        ("apply_if_finite", "NotImplementedError: apply_if_finite cannot run inside shard_by_tensor()"),
        ("soap with group=", "ValueError: scale_by_soap: group= inside shard_by_tensor()"),
    ],
)
def test_what_needs_every_tensor_or_shares_work_itself_is_refused_on_every_rank(ranks, case, says):
    """A global norm or a decision over all tensors would see one rank's tensors only (silently
    other numbers), and group= would pair its collectives with other ranks' (a hang)."""
    for rank, result in enumerate(ranks):
        assert (result[case] or "").startswith(says), f"rank {rank}: {result[case]}"


def test_an_inner_that_raises_on_one_rank_raises_on_every_rank_not_a_hang(ranks):
    owner = owners_by_size(weights(fb.identity(), list(start().values()), list(SHAPES)), len(ranks))
    owner_of_f = owner[list(SHAPES).index("f")]
    others = f"RuntimeError: shard_by_tensor: inner's update raised on rank {owner_of_f} (its own error says why)"
    for rank, result in enumerate(ranks):
        message = result["an inner that raises on one rank"] or ""
        assert message == ("ValueError: the update of 'f' failed here" if rank == owner_of_f else others), message


def test_two_tensors_of_one_name_are_refused(ranks):
    for result in ranks:
        assert "the parameters ['a/b'] share a name" in (result["two tensors of one name"] or "")


def test_an_empty_tensor_of_its_own_dtype_gets_its_update(ranks):
    world = len(ranks)
    mean = sum(range(1, world + 1)) / world
    for rank, result in enumerate(ranks):
        updates = result["updates with an empty tensor"]
        assert updates["z"] is not None and updates["z"].shape == (0, 3), f"rank {rank}"
        assert torch.equal(updates["a"], torch.full((10,), -0.1 * mean, dtype=torch.float64)), f"rank {rank}"
        assert torch.equal(updates["b"], torch.full((4,), -0.1 * mean, dtype=torch.float64)), f"rank {rank}"
