"""FSDP2 (``fully_shard``) on gloo ranks (run by dist_harness.run_ranks, module
"fsdp2_scenarios"): a fused optimizer over the flat buffers of each rank's local shards; the
parameters after a few steps come back whole (``full_tensor``) for test_fsdp2.py to compare with
one process and with FSDP2 + torch.optim."""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import functional_bagua as fb

STEPS = 4
BATCH = 6  # per rank


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


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


def fused(
    model: torch.nn.Module,
    make: Callable = lambda: fb.adamw(1e-2, weight_decay=0.1),
    select: Callable = lambda p: True,
) -> list:
    """One part: the named DTensor parameters chosen by ``select(p)``, their layout (of the
    local shards), ``fb.fuse(make())`` over it and its initial state."""
    named = {name: p for name, p in model.named_parameters() if select(p)}
    layout = fb.FlatLayout.of(named)
    tx = fb.fuse(make(), layout)
    return [named, layout, tx, tx.init(layout.flatten(named))]


def fused_steps(
    model: torch.nn.Module, parts: list, batches: list, rank: int, whole_grads: Optional[list] = None
) -> list:
    """Fused steps of each part (:func:`fused`, its state replaced) on this rank's part of each
    batch, the new local values written into the shards after each; per step and part, the
    collectives its update issued (CommDebugMode's counts, by op). ``whole_grads``, when given,
    gets each step's gradients, whole (FSDP2's averages)."""
    from torch.distributed.tensor.debug import CommDebugMode

    flats = [layout.flatten(named) for named, layout, _, _ in parts]
    counts = []
    for x, y in batches:
        piece = slice(rank * BATCH, (rank + 1) * BATCH)
        loss_of(model, (x[piece], y[piece])).backward()
        if whole_grads is not None:
            whole_grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        counts.append([])
        for i, (named, layout, tx, state) in enumerate(parts):
            with CommDebugMode() as comm:
                updates, parts[i][3] = tx.update(layout.flatten({n: p.grad for n, p in named.items()}), state, flats[i])
            counts[-1].append({str(op): n for op, n in comm.get_comm_counts().items()})
            flats[i] = fb.apply_updates(flats[i], updates)
            with torch.no_grad():
                fb.tree.copy_into({n: p.to_local() for n, p in named.items()}, layout.unflatten(flats[i]))
        model.zero_grad()
    return counts


def fused_on_local_shards(
    rank: int, world_size: int, make: Callable = lambda: fb.adamw(1e-2, weight_decay=0.1)
) -> dict:
    """fb.fuse(make()) over FlatLayout.of(the DTensor parameters) for all the steps: the whole
    parameters, the buffers' keys and the elements of this rank's shards and moments."""
    model = sharded_model()
    part = fused(model, make)
    fused_steps(model, [part], global_batches(world_size), rank)
    named, layout, _, state = part
    moments = [t for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor) and t.dim() == 1]
    return {
        "params": whole(model),
        "keys": layout.keys,
        "local elements": sum(p.to_local().numel() for p in named.values()),
        "moment elements": [t.numel() for t in moments],
    }


MUON = {"lr": 0.02, "weight_decay": 0.1}


def muon_and_adamw() -> fb.GradientTransformation:
    """Muon on the matrices, AdamW on the rest (the unfused reference)."""
    labels = lambda params: fb.tree.tree_map(lambda v: "muon" if v.dim() == 2 else "adamw", params)  # noqa: E731
    return fb.partition({"muon": fb.muon(**MUON), "adamw": fb.adamw(1e-2, weight_decay=0.1)}, labels)


def fused_muon_on_local_shards(rank: int, world_size: int) -> dict:
    """fb.fuse(fb.muon) over the matrices' local shards (each orthogonalized whole by its owner
    rank), fb.fuse(fb.adamw) over the biases': the whole parameters after all the steps and
    the collectives of each update."""
    model = sharded_model()
    parts = [fused(model, lambda: fb.muon(**MUON), lambda p: p.dim() == 2), fused(model, select=lambda p: p.dim() < 2)]
    counts = fused_steps(model, parts, global_batches(world_size), rank)
    return {"params": whole(model), "muon collectives": [step[0] for step in counts]}


def optimizer_on_dtensors(rank: int, world_size: int, tx: fb.GradientTransformation = None) -> dict:
    """fb.Optimizer(tx) (muon on the matrices, adamw on the rest, by default) on the FSDP2
    model's DTensors: the whole parameters after all the steps, the whole gradients of each and
    the collectives of each ``step()``."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = sharded_model()
    opt = fb.Optimizer(model.parameters(), muon_and_adamw() if tx is None else tx)
    counts, grads = [], []
    for x, y in global_batches(world_size):
        piece = slice(rank * BATCH, (rank + 1) * BATCH)
        loss_of(model, (x[piece], y[piece])).backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        with CommDebugMode() as comm:
            opt.step()
        counts.append({str(op): n for op, n in comm.get_comm_counts().items()})
        opt.zero_grad()
    return {"params": whole(model), "collectives": counts, "whole grads": grads}


TRAIN_STEPS = {  # name: (make tx, on flat buffers of the local shards, compile)
    "tree, eager": (lambda: fb.adamw(1e-2, weight_decay=0.1), False, False),
    "tree, compiled": (lambda: fb.adamw(1e-2, weight_decay=0.1), False, {"backend": "aot_eager"}),
    "flat, torch kernel": (lambda: fb.adamw(1e-2, weight_decay=0.1), True, False),
    # a schedule: no torch kernel, so inductor compiles the fused update
    "flat, compiled": (lambda: fb.adamw(fb.schedules.constant(1e-2), weight_decay=0.1), True, True),
}
INDUCTOR_UP_TO = 2  # ranks: inductor compiles each rank's own update, and 2 cores compile for every rank at once


def inductor(compile) -> bool:
    """Whether a TRAIN_STEPS compile option has inductor generate code (aot_eager does not)."""
    return compile is True or (isinstance(compile, dict) and compile.get("backend", "inductor") == "inductor")


def train_steps(rank: int, world_size: int) -> dict:
    """fb.make_train_step on the FSDP2 model, each variant of TRAIN_STEPS: the whole parameters
    after all the steps and the losses."""
    out = {}
    for name, (make, flat, compile) in TRAIN_STEPS.items():
        if inductor(compile) and world_size > INDUCTOR_UP_TO:
            continue
        model = sharded_model()
        tx, params = make(), fb.params_of(model)
        layout = fb.FlatLayout.of(params) if flat else None
        if layout is not None:
            params = layout.flatten(params)
        state = (fb.fuse(tx, layout) if layout is not None else tx).init(params)
        step = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, compile=compile, layout=layout)
        losses = []
        for x, y in global_batches(world_size):
            piece = slice(rank * BATCH, (rank + 1) * BATCH)
            params, state, loss = step(params, state, (x[piece], y[piece]))
            losses.append(loss)
        out[name] = {"params": whole(model), "losses": losses}
    return out


def mixed_precision(rank: int, world_size: int) -> dict:
    """FSDP2 with bfloat16 compute and float32 gradient reduction over a float32 model:
    fb.make_train_step with AdamW fused over the float32 shards (the master weights), and
    FSDP2 + torch.optim.AdamW(fused=True) on the same model: the whole parameters of each, the
    keys and dtypes of the fused state."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batches = [(x.float(), y.float()) for x, y in global_batches(world_size)]
    piece = slice(rank * BATCH, (rank + 1) * BATCH)
    out: dict = {}
    for name in ("fb", "torch"):
        model = make_model().float()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if name == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
            for x, y in batches:
                torch.nn.functional.mse_loss(model(x[piece]), y[piece]).backward()
                opt.step()
                opt.zero_grad()
        else:
            tx, layout = fb.adamw(1e-2, weight_decay=0.1), fb.FlatLayout.of(fb.params_of(model))
            params = layout.flatten(fb.params_of(model))
            state = fb.fuse(tx, layout).init(params)
            step = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, layout=layout)
            for x, y in batches:
                params, state, _ = step(params, state, (x[piece], y[piece]))
            out["keys"] = layout.keys
            out["state dtypes"] = sorted({str(t.dtype) for t in fb.tree.flatten(state)[0] if t.dim() == 1})
        out[name] = whole(model)
    return out


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


ON_OWNERS = {  # whole-tensor rules with state, each tensor's on its owner rank
    "adafactor": lambda: fb.adafactor(1e-2),
    "soap": lambda: fb.soap(lr=3e-3, precondition_frequency=2),
    "shampoo": lambda: fb.shampoo(lr=3e-3, precondition_frequency=2),
}


def on_owners_soap() -> fb.GradientTransformation:
    import functional_bagua.distributed as fbd

    return fbd.on_owners(ON_OWNERS["soap"]())


def on_owners_over_local_shards(rank: int, world_size: int, make: Callable) -> dict:
    """fb.fuse(fbd.on_owners(make())) over the local shards: the whole parameters after all the
    steps and the whole gradients of each, the elements of this rank's state, the collectives of
    each update, and what distributed_state_dict says of the state."""
    import functional_bagua.distributed as fbd

    model = sharded_model()
    part = fused(model, lambda: fbd.on_owners(make()))
    grads: list = []
    counts = fused_steps(model, [part], global_batches(world_size), rank, grads)
    held = [t for t in fb.tree.flatten(part[3].inner)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    try:
        fbd.distributed_state_dict(part[3], part[0])
        refused = None
    except NotImplementedError as error:
        refused = str(error)
    out = {"params": whole(model), "state elements": sum(t.numel() for t in held), "collectives": counts}
    return {**out, "dcp refused": refused, "whole grads": grads}


PER_TENSOR_RULES = {  # each keeps state of whole tensors
    "adafactor": lambda: fb.adafactor(1e-2),
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
    tx = fb.fuse(fb.prodigy(), layout)  # not per tensor: its step size sums over every tensor
    try:
        tx.update(grads, tx.init(flat), flat)
        out["prodigy"] = None
    except NotImplementedError as error:
        out["prodigy"] = str(error)
    return out


def on_owners_without_a_gradient(model: torch.nn.Module) -> None:
    import functional_bagua.distributed as fbd

    params = fb.params_of(model)
    tx = fbd.on_owners(fb.adafactor(1e-2))
    grads = {name: None if i == 0 else torch.ones_like(p) for i, (name, p) in enumerate(params.items())}
    tx.update(grads, tx.init(params), params)


def on_owners_compiled(model: torch.nn.Module, batch: tuple) -> None:
    import functional_bagua.distributed as fbd

    tx, layout = fbd.on_owners(fb.adafactor(1e-2)), fb.FlatLayout.of(fb.params_of(model))
    params = layout.flatten(fb.params_of(model))
    step = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, layout=layout, compile={"backend": "eager"})
    step(params, fb.fuse(tx, layout).init(params), batch)


def refused_train_steps(rank: int, world_size: int) -> dict:
    """What would train wrong on the FSDP2 model (make_train_step given what it refuses, a capped
    layout of shards of uneven sizes, on_owners with a missing gradient): the error's text, or None."""
    from functional_bagua.distributed import allreduce_gradients

    model = sharded_model()
    x, y = global_batches(world_size)[0]
    batch = (x[:BATCH], y[:BATCH])
    mse = torch.nn.functional.mse_loss
    cases = {
        "allreduce_gradients": lambda: fb.make_train_step(model, mse, fb.chain(allreduce_gradients(), fb.adamw(1e-2))),
        "copies as params": lambda: fb.make_train_step(model, mse, fb.adamw(1e-2), compile=False)(
            {n: p.detach().clone() for n, p in fb.params_of(model).items()},
            fb.adamw(1e-2).init(fb.params_of(model)),
            batch,
        ),
        "max_buffer_mb": lambda: fb.FlatLayout.of(fb.params_of(model), max_buffer_mb=1),
        "on_owners without a gradient": lambda: on_owners_without_a_gradient(model),
        "on_owners compiled": lambda: on_owners_compiled(model, batch),
    }
    out: dict = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except ValueError as error:
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


def dcp_leg(rank: int, world_size: int) -> dict:
    """One leg of a run interrupted by checkpoints: the model and fused state loaded with DCP
    from $FB_DCP_LOAD (when set), the steps $FB_DCP_STEPS ("first:last") of the global
    batches of this world size, then both saved to $FB_DCP_SAVE (when set): the saved state's
    keys and the whole parameters."""
    import torch.distributed.checkpoint as dcp

    import functional_bagua.distributed as fbd

    model = sharded_model()
    part = fused(model)
    named, _, _, state = part

    def checkpoint() -> dict:
        return {"model": model.state_dict(), "opt": fbd.distributed_state_dict(part[3], named)}

    if os.environ.get("FB_DCP_LOAD"):
        dcp.load(checkpoint(), checkpoint_id=os.environ["FB_DCP_LOAD"])
    first, last = map(int, os.environ["FB_DCP_STEPS"].split(":"))
    fused_steps(model, [part], global_batches(world_size)[first:last], rank)
    saved = checkpoint()
    if os.environ.get("FB_DCP_SAVE"):
        dcp.save(saved, checkpoint_id=os.environ["FB_DCP_SAVE"])
    return {"opt keys": sorted(saved["opt"]), "params": whole(model)}


def all_scenarios(rank: int, world_size: int) -> dict:
    out = {
        "flattening": refused_flattening(rank, world_size),
        "fused": fused_on_local_shards(rank, world_size),
        **{name: fused_on_local_shards(rank, world_size, make) for name, make in SUMMING_RULES.items()},
        "muon": fused_muon_on_local_shards(rank, world_size),
        "optimizer muon": optimizer_on_dtensors(rank, world_size),
        "optimizer on owners, soap": optimizer_on_dtensors(rank, world_size, on_owners_soap()),
        **{
            f"on owners, {name}": on_owners_over_local_shards(rank, world_size, make)
            for name, make in ON_OWNERS.items()
        },
        "torch": torch_adamw(rank, world_size),
        "train steps": train_steps(rank, world_size),
        "mixed precision": mixed_precision(rank, world_size),
        "refused": refused_per_tensor_rules(rank, world_size),
        "refused steps": refused_train_steps(rank, world_size),
    }
    dist.barrier()
    return out
