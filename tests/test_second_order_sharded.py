"""SOAP's eigendecompositions, Shampoo's inverse roots and PSGD-Kron's fits computed by one rank
each and shared (owner-computes), on 2 and 4 gloo ranks after allreduce_gradients, against one
process on the mean of all ranks' gradients; ranks whose gradients differ are refused alike."""

from __future__ import annotations

import re

import pytest
import torch
from dist_harness import ScenarioError, run_ranks
from second_order_scenarios import MAKERS, STEPS, local_gradients, owner_batches, seed, start, with_nan

import functional_bagua as fb

pytestmark = pytest.mark.cpu_only("spawned gloo ranks on the CPU")


@pytest.fixture(scope="module", params=[2, 4], ids=["two", "four"])
def ranks(request):
    return run_ranks(request.param, ["sharded_second_order", "balanced_owners"], module="second_order_scenarios")


@pytest.mark.parametrize("fused", [False, True], ids=["tree", "fused"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_shared_decompositions_equal_one_process_on_the_global_batch(ranks, name, fused):
    """Per tensor, and inside ``fb.fuse`` (eagerly, the state stacked per shape; PSGD-Kron then
    draws its probes in the buffer's order of shapes), against one process doing the same."""
    world = len(ranks)
    params = start()
    layout = fb.FlatLayout.of(params)
    tx, into = (fb.fuse(MAKERS[name](None), layout), layout.flatten) if fused else (MAKERS[name](None), dict)
    flat = into(params)
    state = tx.init(flat)
    for step in range(STEPS):
        seed(step)
        per_rank = [local_gradients(r, step) for r in range(world)]
        mean = {k: sum(g[k] for g in per_rank) / world for k in params}
        u, state = tx.update(into(mean), state, flat)
        flat = fb.apply_updates(flat, u)
    expected = layout.unflatten(flat) if fused else flat
    for rank, result in enumerate(ranks):
        got = result["sharded_second_order"]
        assert not isinstance(got, ScenarioError), got
        for k in params:
            torch.testing.assert_close(
                got[f"{name}, fused" if fused else name][k],
                expected[k],
                rtol=1e-10,
                atol=1e-12,
                msg=lambda m: f"rank {rank} {k}: {m}",
            )


def test_psgd_kron_ranks_agree_also_with_probes_from_rngs_seeded_per_rank(ranks):
    first = ranks[0]["sharded_second_order"]["psgd_kron, RNG per rank"]
    for rank, result in enumerate(ranks[1:], start=1):
        got = result["sharded_second_order"]["psgd_kron, RNG per rank"]
        for k in first:
            assert torch.equal(got[k], first[k]), f"rank {rank} {k}"
    seeded_alike = ranks[0]["sharded_second_order"]["psgd_kron"]
    # "b" is the second row of its batch: fitted by rank 1, with rank 1's probe (other numbers)
    assert not torch.equal(first["b"], seeded_alike["b"])


@pytest.mark.parametrize("name", list(MAKERS))
def test_ranks_holding_different_gradients_are_refused_alike(ranks, name):
    for rank, result in enumerate(ranks):
        message = result["sharded_second_order"][f"{name}, not averaged"]
        assert message is not None, f"rank {rank} ran on"
        assert "every rank of the group must hold the same gradients" in message
        assert "allreduce_gradients" in message


def test_shampoo_shares_all_the_roots_of_an_update_in_one_all_gather(ranks):
    """Blocks of three shapes (3 batches, 8 dimensions): each step one all-gather that checks the
    ranks step alike, and in the steps that refresh (every 2nd) one more with every root."""
    for rank, result in enumerate(ranks):
        assert result["sharded_second_order"]["shampoo, all-gathers per step"] == [1, 2, 1, 2], f"rank {rank}"


def test_soap_shares_all_the_decompositions_of_an_update_in_one_all_gather(ranks):
    """Three batches of tensors: each step one all-gather that checks the ranks step alike, and
    one more with every eigendecomposition of the update (the first step's eigh, every 2nd
    step's QR) in the steps that decompose."""
    for rank, result in enumerate(ranks):
        assert result["sharded_second_order"]["soap, all-gathers per step"] == [2, 1, 2, 1], f"rank {rank}"


def test_ranks_holding_gradients_of_other_shapes_are_refused_alike_not_a_hang(ranks):
    for rank, result in enumerate(ranks):
        message = result["sharded_second_order"]["shampoo, other shapes"]
        assert message is not None, f"rank {rank} ran on"
        assert "every rank of the group must step the same tensors (shapes, dtypes) at the same counts" in message


@pytest.mark.parametrize("name", list(MAKERS))
def test_ranks_at_different_counts_are_refused_alike_not_a_hang(ranks, name):
    """Rank 1 a step ahead would refresh in other steps than the others, calling the shared
    computation a different number of times: every rank raises before any of it."""
    for rank, result in enumerate(ranks):
        message = result["sharded_second_order"][f"{name}, counts differ"]
        assert message is not None, f"rank {rank} ran on"
        assert "every rank of the group must step the same tensors (shapes, dtypes) at the same counts" in message


def test_a_nan_gradient_under_apply_if_finite_is_skipped_as_by_one_process(ranks):
    world = len(ranks)
    tx = fb.apply_if_finite(MAKERS["psgd_kron"](None), 3)
    params = start()
    state = tx.init(params)
    for step in range(STEPS):
        seed(step)
        per_rank = [with_nan(local_gradients(r, step), r, step) for r in range(world)]
        mean = {k: sum(g[k] for g in per_rank) / world for k in params}
        u, state = tx.update(mean, state, params)
        params = fb.apply_updates(params, u)
    for rank, result in enumerate(ranks):
        got = result["sharded_second_order"]["psgd_kron, a NaN step skipped"]
        for k in params:
            torch.testing.assert_close(got[k], params[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("roots", ["shampoo", "shampoo newton"])
def test_a_decomposition_that_raises_on_its_owner_raises_on_every_rank_not_a_hang(ranks, roots):
    for rank, result in enumerate(ranks):
        message = result["sharded_second_order"][f"{roots}, a NaN statistic"]
        assert message is not None, f"rank {rank} ran on"
        assert re.search(r"the computation of rank \d's rows raised", message), message


def test_rows_of_all_batches_spread_by_cost_and_gather_right(ranks):
    """Single-row batches go to the least-loaded rank of the update so far, not each to rank 0:
    every rank ends with a load within one row's cost (8^3) of the others', makes the same
    choices, and gets each matrix's own result."""
    expected = [torch.linalg.matrix_norm(batch) for batch in owner_batches()]
    loads = ranks[0]["balanced_owners"]["loads"]
    assert max(loads) - min(loads) <= 8**3, loads
    for rank, result in enumerate(ranks):
        got = result["balanced_owners"]
        assert got["loads"] == loads, f"rank {rank} chose other owners"
        for e, g in zip(expected, got["results"]):
            assert torch.equal(g, e), f"rank {rank}"
        # owner_computes_all: the same owners and results, every batch in one all-gather
        assert got["loads at once"] == loads, f"rank {rank}"
        for e, g in zip(expected, got["all at once"]):
            assert torch.equal(g, e), f"rank {rank}"
        for here, shared in zip(got["tuples here"], got["tuples at once"]):
            assert isinstance(shared, tuple) and all(torch.equal(a, b) for a, b in zip(here, shared)), f"rank {rank}"
        assert got["all-gathers"] == 2, f"rank {rank}: {got['all-gathers']} all-gathers for two calls"
