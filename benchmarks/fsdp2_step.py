"""FSDP2: our optimizer over each rank's local shards against torch.optim's AdamW on the same
``fully_shard`` model, in the same run; and Muon's orthogonalization of row-sharded matrices.

    python benchmarks/fsdp2_step.py                   # 1 and 2 gloo ranks, CPU, every section
    python benchmarks/fsdp2_step.py --ranks 1,2,4 --layers 8 --width 512 --sections optimizer,train

Each run spawns the ranks (gloo on 127.0.0.1, one thread each: ``common.on_gloo_ranks``), builds a stack of ``--layers``
linear layers of ``--width`` (float32), ``fully_shard`` on each layer and the root, and times
``--steps`` calls after 3 untimed. Sections (``--sections``):

``optimizer``: the optimizer step alone, on the gradients of one forward and backward:

- ``torch AdamW foreach`` and ``torch AdamW fused``: ``opt.step()`` on the DTensor parameters;
- ``fb.fuse(adamw)``: the gradients' local shards flattened (``layout.flatten``), the pure fused
  update and ``apply_updates``, the new values copied into the shards (``p.to_local()``);
- ``fb.fuse_inplace(adamw, kernel="torch")``: the same, with torch's fused kernel writing into
  the flat buffers in place.

``train``: the whole training step (forward, backward through FSDP2's hooks, update) on a batch
of 32: FSDP2 + torch's AdamW (foreach, fused) against ``fb.make_train_step`` on the model's
DTensor parameters (the update on DTensors) and on the flat buffers of their local shards
(torch's fused kernel in place, then copied into the shards).

``muon``: Newton-Schulz (5 steps, bfloat16) on every layer's gradient, a row-sharded
``width x width`` DTensor: its matmuls on the DTensors (a collective wherever DTensor needs one)
against each matrix gathered whole to an owner rank (``whole_tensors.map_dtensors``: two
all-to-alls); milliseconds and the collectives of one call (``CommDebugMode``).

The slowest rank's median (and its range), and the ratio to the section's first variant.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import on_gloo_ranks, record, spread, step_times_ms, table  # noqa: E402

HYPER = dict(lr=1e-3, weight_decay=0.01)


def _model(layers: int, width: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(8, width)).square().mean().backward()
    return model


def _torch_step(model: torch.nn.Module, fused: bool):
    opt = torch.optim.AdamW(model.parameters(), **HYPER, foreach=not fused, fused=fused)
    return opt.step


def _fb_step(model: torch.nn.Module, in_place: bool):
    import functional_bagua as fb

    named = dict(model.named_parameters())
    layout = fb.FlatLayout.of(named)
    flat = layout.flatten(named)
    tx = fb.adamw(HYPER["lr"], weight_decay=HYPER["weight_decay"])
    shards = [named[name].to_local() for name in layout.unflatten(flat)]
    if in_place:
        step_ = fb.fuse_inplace(tx, layout, kernel="torch")
        state = step_.init(flat)

        def step() -> None:
            step_(layout.flatten({n: p.grad for n, p in named.items()}), state, flat)
            with torch.no_grad():
                torch._foreach_copy_(shards, list(layout.unflatten(flat).values()))

        return step
    fused = fb.fuse(tx, layout)
    box = {"state": fused.init(flat), "flat": flat}

    def step() -> None:
        updates, box["state"] = fused.update(
            layout.flatten({n: p.grad for n, p in named.items()}), box["state"], box["flat"]
        )
        box["flat"] = fb.apply_updates(box["flat"], updates)
        with torch.no_grad():
            torch._foreach_copy_(shards, list(layout.unflatten(box["flat"]).values()))

    return step


OPTIMIZER_STEPS = {
    "torch AdamW foreach": lambda model: _torch_step(model, fused=False),
    "torch AdamW fused": lambda model: _torch_step(model, fused=True),
    "fb.fuse(adamw), pure": lambda model: _fb_step(model, in_place=False),
    "fb.fuse_inplace(adamw, kernel='torch')": lambda model: _fb_step(model, in_place=True),
}


def _torch_train_step(model: torch.nn.Module, batch: torch.Tensor, fused: bool):
    opt = torch.optim.AdamW(model.parameters(), **HYPER, foreach=not fused, fused=fused)

    def step() -> None:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def _fb_train_step(model: torch.nn.Module, batch: torch.Tensor, flat: bool):
    import functional_bagua as fb

    tx = fb.adamw(HYPER["lr"], weight_decay=HYPER["weight_decay"])
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params) if flat else None
    if layout is not None:
        params = layout.flatten(params)
    box = {"params": params, "state": (fb.fuse(tx, layout) if layout is not None else tx).init(params)}
    train = fb.make_train_step(model, lambda out, _: out.square().mean(), tx, compile=False, layout=layout)

    def step() -> None:
        box["params"], box["state"], _ = train(box["params"], box["state"], (batch, None))

    return step


TRAIN_STEPS = {
    "FSDP2 + torch AdamW foreach": lambda model, batch: _torch_train_step(model, batch, fused=False),
    "FSDP2 + torch AdamW fused": lambda model, batch: _torch_train_step(model, batch, fused=True),
    "fb.make_train_step, DTensor tree": lambda model, batch: _fb_train_step(model, batch, flat=False),
    "fb.make_train_step, flat local shards": lambda model, batch: _fb_train_step(model, batch, flat=True),
}


def _orthogonalizations(model: torch.nn.Module) -> dict:
    from functional_bagua.distributed import whole_tensors
    from functional_bagua.transforms.orthogonalize import newton_schulz

    grads = [p.grad for p in model.parameters() if p.dim() == 2]
    return {
        "Newton-Schulz on DTensors": lambda: [newton_schulz(g) for g in grads],
        "gathered to owner ranks": lambda: whole_tensors.map_dtensors(
            lambda g, _: newton_schulz(g).to(g.dtype), grads, [None] * len(grads)
        ),
    }


def _collectives(fn) -> int:  # noqa: ANN001
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return comm.get_total_counts()


def _timings(sections: list, layers: int, width: int, steps: int) -> dict:
    """On one rank: each section's variants' step times in milliseconds (and Muon's collectives)."""
    timings: dict = {}
    if "optimizer" in sections:
        for name, make in OPTIMIZER_STEPS.items():
            step = make(_model(layers, width))
            dist.barrier()
            timings[("optimizer", name)] = step_times_ms(step, "cpu", steps)
    if "train" in sections:
        batch = torch.randn(32, width)
        for name, make in TRAIN_STEPS.items():
            step = make(_model(layers, width), batch)
            dist.barrier()
            timings[("train", name)] = step_times_ms(step, "cpu", steps)
    if "muon" in sections:
        for name, fn in _orthogonalizations(_model(layers, width)).items():
            dist.barrier()
            timings[("muon", name)] = step_times_ms(fn, "cpu", steps)
            timings[("muon collectives", name)] = _collectives(fn)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sections", default="optimizer,train,muon")
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    args = parser.parse_args()
    sections = args.sections.split(",")
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        results = on_gloo_ranks(_timings, world, sections, args.layers, args.width, args.steps)
        for section in sections:
            names = [name for kind, name in results[0] if kind == section]
            base = max(statistics.median(r[(section, names[0])]) for r in results)
            for name in names:
                slowest = max(results, key=lambda r: statistics.median(r[(section, name)]))[(section, name)]
                ms = statistics.median(slowest)
                row = dict(section=section, ranks=world, variant=name, ms=ms, range=spread(slowest))
                row["x first"] = ms / base
                row["collectives"] = results[0].get(("muon collectives", name), "")
                rows.append(row)
    elements = args.layers * (args.width * args.width + args.width)
    title = (
        f"{args.layers} x Linear({args.width}, {args.width}), {elements / 1e6:.2f}M float32 parameters, fully_shard; "
        "one thread per rank; the slowest rank's median"
    )
    print(title)
    columns = ["section", "ranks", "variant", "ms", "range", "x first", "collectives"]
    print(table(rows, columns))
    if args.record:
        chart = dict(value="ms", label=["section", "ranks", "variant"], log=True)
        record("fsdp2_step", "cpu", [dict(title=title, columns=columns, rows=rows, chart=chart)])


if __name__ == "__main__":
    main()
