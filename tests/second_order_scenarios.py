"""Second-order transforms sharded over gloo ranks (run by dist_harness.run_ranks, module
"second_order_scenarios"): each rank computes some of the eigendecompositions, roots and
PSGD-Kron fits and shares them; test_second_order_sharded.py compares with one process on the
global batch. The probes of PSGD-Kron come from torch's global RNG, seeded per step (alike on
every rank, or differently per rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import functional_bagua as fb
import functional_bagua.distributed as fbd
from functional_bagua.transforms.batched_matrices import Owners, owner_computes

SHAPES = {"a": (6, 6), "b": (6, 6), "c": (6, 6), "d": (5, 5), "e": (5, 5), "f": (4, 3, 3, 3)}
STEPS = 5


def local_gradients(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}


def start() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}


MAKERS = {
    "soap": lambda group: fb.soap(precondition_frequency=2, matrix_dtype=torch.float64, group=group),
    "shampoo": lambda group: fb.shampoo(grafting="adam", precondition_frequency=2, group=group),
    "psgd_kron": lambda group: fb.psgd_kron(lr=1e-2, precond_dtype=torch.float64, group=group),
}


def seed(step: int, rank: int = 0) -> None:
    """The global RNG before a step (PSGD-Kron's probes)."""
    torch.manual_seed(100 * step + rank)


NAN_STEP = 1  # the step where NaN_AT's gradient is NaN (on rank 1 only, in the NaN scenarios)
NAN_AT = "b"  # the second row of its batch: rank 1's to compute


def with_nan(grads: dict, rank: int, step: int) -> dict:
    """``grads`` with a NaN in ``NAN_AT``'s at ``NAN_STEP`` on rank 1."""
    if rank == 1 and step == NAN_STEP:
        grads = dict(grads, **{NAN_AT: grads[NAN_AT].clone().fill_(float("nan"))})
    return grads


def run(
    tx: fb.GradientTransformation, rank: int, allreduce: bool = True, seed_rank: int = 0, nan: bool = False
) -> dict:
    """The parameters after STEPS steps of ``tx`` on this rank's gradients (averaged by
    ``allreduce_gradients`` first where ``allreduce``; with a NaN where ``nan``, skipped by
    ``apply_if_finite``)."""
    if nan:  # inside the all-reduce: it decides on the averaged gradients, alike on every rank
        tx = fb.apply_if_finite(tx, 3)
    if allreduce:
        tx = fb.chain(fbd.allreduce_gradients(), tx)
    params = start()
    state = tx.init(params)
    for step in range(STEPS):
        seed(step, seed_rank)
        grads = local_gradients(rank, step)
        u, state = tx.update(with_nan(grads, rank, step) if nan else grads, state, params)
        params = fb.apply_updates(params, u)
    return params


def sharded_second_order(rank: int, world_size: int) -> dict:
    """Each rank its own gradients, averaged by allreduce_gradients, then the transform with its
    decompositions shared among the ranks: the parameters after STEPS steps."""
    out = {name: run(make(dist.group.WORLD), rank) for name, make in MAKERS.items()}
    # probes drawn from RNGs seeded per rank: each fit is its owner's, shared with its perturbed
    # momentum, so the ranks still agree
    out["psgd_kron, RNG per rank"] = run(MAKERS["psgd_kron"](dist.group.WORLD), rank, seed_rank=rank)
    for name, make in MAKERS.items():  # the gradients not averaged: refused on every rank alike
        try:
            run(make(dist.group.WORLD), rank, allreduce=False)
            out[f"{name}, not averaged"] = None
        except ValueError as error:
            out[f"{name}, not averaged"] = str(error)
    # a NaN gradient under apply_if_finite: PSGD-Kron's fit takes it (the step is then skipped)
    out["psgd_kron, a NaN step skipped"] = run(MAKERS["psgd_kron"](dist.group.WORLD), rank, nan=True)
    # Shampoo's eigh raises on the NaN statistic, on the rank that owns it: every rank raises
    try:
        run(MAKERS["shampoo"](dist.group.WORLD), rank, nan=True)
        out["shampoo, a NaN statistic"] = None
    except RuntimeError as error:
        out["shampoo, a NaN statistic"] = str(error)
    return out


def balanced_owners(rank: int, world_size: int) -> dict:
    """Six batches through one update's Owners (four single 8 x 8 matrices, then three 4 x 4 and
    one 2 x 2): each matrix's norm, computed by its owner and gathered, and the loads after."""
    owners = Owners(dist.group.WORLD, "balance test", "norms")
    owners.begin_update()
    results = [owner_computes(torch.linalg.matrix_norm, batch, owners) for batch in owner_batches()]
    return {"results": results, "loads": list(owners.loads)}


def owner_batches() -> list:
    gen = torch.Generator().manual_seed(3)
    shapes = [(1, 8, 8)] * 4 + [(3, 4, 4), (1, 2, 2)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
