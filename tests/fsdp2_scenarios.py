"""FSDP2 (``fully_shard``) on gloo ranks (run by dist_harness.run_ranks, module
"fsdp2_scenarios"): a fused optimizer over the flat buffers of each rank's local shards; the
parameters after a few steps come back whole (``full_tensor``) for test_fsdp2.py to compare with
one process and with FSDP2 + torch.optim."""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import functional_bagua as fb

STEPS = 4
BATCH = 6  # per rank


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3)).double()


def global_batches(world_size: int) -> list:
    gen = torch.Generator().manual_seed(1)
    n = BATCH * world_size
    return [
        (torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randn(n, 3, generator=gen, dtype=torch.float64))
        for _ in range(STEPS)
    ]


def loss_of(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def sharded_model() -> torch.nn.Module:
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


SUMMING_RULES = {  # norms: this rank's parts summed across the ranks
    "lamb": lambda: fb.lamb(1e-2, weight_decay=0.1),
    "lars": lambda: fb.lars(0.5, momentum=0.9, weight_decay=1e-3),
    "clip + adamw": lambda: fb.chain(fb.clip_by_global_norm(0.05), fb.adamw(1e-2)),  # the global norm
}


def fused(model: torch.nn.Module, make: Callable = lambda: fb.adamw(1e-2, weight_decay=0.1)) -> tuple:
    """The named DTensor parameters, their layout (of the local shards), ``fb.fuse(make())`` over
    it and its initial state."""
    named = dict(model.named_parameters())
    layout = fb.FlatLayout.of(named)
    tx = fb.fuse(make(), layout)
    return named, layout, tx, tx.init(layout.flatten(named))


def fused_steps(model: torch.nn.Module, named: dict, layout, tx, state, batches: list, rank: int):  # noqa: ANN001
    """Fused steps on this rank's part of each batch, the new local values written into the
    shards after each; the state after them."""
    flat = layout.flatten(named)
    for x, y in batches:
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        loss_of(model, (x[part], y[part])).backward()
        updates, state = tx.update(layout.flatten({n: p.grad for n, p in named.items()}), state, flat)
        flat = fb.apply_updates(flat, updates)
        with torch.no_grad():
            fb.tree.copy_into({n: p.to_local() for n, p in named.items()}, layout.unflatten(flat))
        model.zero_grad()
    return state


def fused_on_local_shards(
    rank: int, world_size: int, make: Callable = lambda: fb.adamw(1e-2, weight_decay=0.1)
) -> dict:
    """fb.fuse(make()) over FlatLayout.of(the DTensor parameters) for all the steps: the whole
    parameters, the buffers' keys and the elements of this rank's shards and moments."""
    model = sharded_model()
    named, layout, tx, state = fused(model, make)
    state = fused_steps(model, named, layout, tx, state, global_batches(world_size), rank)
    moments = [t for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor) and t.dim() == 1]
    return {
        "params": whole(model),
        "keys": layout.keys,
        "local elements": sum(p.to_local().numel() for p in named.values()),
        "moment elements": [t.numel() for t in moments],
    }


def whole(model: torch.nn.Module) -> dict:
    """The model's parameters, each whole (gathered from the ranks' shards)."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def torch_adamw(rank: int, world_size: int) -> dict:
    """FSDP2 with torch.optim.AdamW (foreach) on the same model and batches."""
    model = sharded_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    for x, y in global_batches(world_size):
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        loss_of(model, (x[part], y[part])).backward()
        opt.step()
        opt.zero_grad()
    return {"params": whole(model)}


PER_TENSOR_RULES = {
    "adafactor": lambda: fb.adafactor(1e-2),
    "muon": lambda: fb.muon(lr=0.02),
    "soap": lambda: fb.soap(),
    "shampoo": lambda: fb.shampoo(),
    "psgd_kron": lambda: fb.psgd_kron(),
}


def refused_per_tensor_rules(rank: int, world_size: int) -> dict:
    """Per-tensor rules fused over the local shards: each refused, with the reason (the error's
    text; ``None`` where one ran on)."""
    model = sharded_model()
    named = dict(model.named_parameters())
    layout = fb.FlatLayout.of(named)
    flat = layout.flatten(named)
    grads = layout.flatten({k: torch.ones_like(v) for k, v in named.items()})
    out: dict = {}
    for name, make in PER_TENSOR_RULES.items():
        tx = fb.fuse(make(), layout)
        try:
            tx.update(grads, tx.init(flat), flat)
            out[name] = None
        except NotImplementedError as error:
            out[name] = str(error)
    return out


def refused_flattening(rank: int, world_size: int) -> dict:
    """flatten_parameters and flatten_module on DTensor parameters: the error's text, or None."""
    out: dict = {}
    for name, flatten in (
        ("flatten_parameters", lambda model: fb.flatten_parameters(dict(model.named_parameters()))),
        ("flatten_module", fb.flatten_module),
    ):
        try:
            flatten(sharded_model())
            out[name] = None
        except TypeError as error:
            out[name] = str(error)
    return out


def dcp_save(rank: int, world_size: int) -> dict:
    """The first half of the steps, then the model and the fused state saved with DCP to $FB_DCP_DIR."""
    import torch.distributed.checkpoint as dcp

    import functional_bagua.distributed as fbd

    model = sharded_model()
    named, layout, tx, state = fused(model)
    state = fused_steps(model, named, layout, tx, state, global_batches(world_size)[: STEPS // 2], rank)
    saved = {"model": model.state_dict(), "opt": fbd.distributed_state_dict(state, named)}
    dcp.save(saved, checkpoint_id=os.environ["FB_DCP_DIR"])
    return {"opt keys": sorted(saved["opt"])}


def dcp_resume(rank: int, world_size: int) -> dict:
    """Model and fused state loaded with DCP from $FB_DCP_DIR, then the second half of the steps:
    the whole parameters."""
    import torch.distributed.checkpoint as dcp

    import functional_bagua.distributed as fbd

    model = sharded_model()
    named, layout, tx, state = fused(model)
    dcp.load(
        {"model": model.state_dict(), "opt": fbd.distributed_state_dict(state, named)},
        checkpoint_id=os.environ["FB_DCP_DIR"],
    )
    fused_steps(model, named, layout, tx, state, global_batches(world_size)[STEPS // 2 :], rank)
    return whole(model)


def all_scenarios(rank: int, world_size: int) -> dict:
    out = {
        "flattening": refused_flattening(rank, world_size),
        "fused": fused_on_local_shards(rank, world_size),
        **{name: fused_on_local_shards(rank, world_size, make) for name, make in SUMMING_RULES.items()},
        "torch": torch_adamw(rank, world_size),
        "refused": refused_per_tensor_rules(rank, world_size),
    }
    dist.barrier()
    return out
