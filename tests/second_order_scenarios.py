"""Second-order transforms sharded over gloo ranks (run by dist_harness.run_ranks, module
"second_order_scenarios"): each rank computes some of the eigendecompositions and roots and
shares them; test_second_order_sharded.py compares with one process on the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

import functional_bagua as fb
import functional_bagua.distributed as fbd

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
}


def sharded_second_order(rank: int, world_size: int) -> dict:
    """Each rank its own gradients, averaged by allreduce_gradients, then the transform with its
    decompositions shared among the ranks: the parameters after STEPS steps."""
    out = {}
    for name, make in MAKERS.items():
        tx = fb.chain(fbd.allreduce_gradients(), make(dist.group.WORLD))
        params = start()
        state = tx.init(params)
        for step in range(STEPS):
            u, state = tx.update(local_gradients(rank, step), state, params)
            params = fb.apply_updates(params, u)
        out[name] = params
    return out
