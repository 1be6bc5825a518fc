"""FSDP2: the optimizer step over each rank's local shards, ours (fused over flat buffers)
against torch.optim's AdamW on the same ``fully_shard`` model, in the same run.

    python benchmarks/fsdp2_step.py                   # 1 and 2 gloo ranks, CPU
    python benchmarks/fsdp2_step.py --ranks 1,2,4 --layers 8 --width 512

Each run spawns the ranks (gloo on 127.0.0.1, one thread each: ``common.on_gloo_ranks``), builds a stack of ``--layers``
linear layers of ``--width`` (float32), ``fully_shard`` on each layer and the root, runs one
forward and backward, and then times the optimizer step alone, ``--steps`` times after 3
untimed, on the same gradients:

- ``torch AdamW foreach`` and ``torch AdamW fused``: ``opt.step()`` on the DTensor parameters;
- ``fb.fuse(adamw)``: the gradients' local shards flattened (``layout.flatten``), the pure fused
  update and ``apply_updates``, the new values copied into the shards (``p.to_local()``);
- ``fb.fuse_inplace(adamw, kernel="torch")``: the same, with torch's fused kernel writing into
  the flat buffers in place.

The slowest rank's median (and its range), and the ratio to torch's foreach step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import on_gloo_ranks, spread, step_times_ms, table  # noqa: E402

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


VARIANTS = {
    "torch AdamW foreach": lambda model: _torch_step(model, fused=False),
    "torch AdamW fused": lambda model: _torch_step(model, fused=True),
    "fb.fuse(adamw), pure": lambda model: _fb_step(model, in_place=False),
    "fb.fuse_inplace(adamw, kernel='torch')": lambda model: _fb_step(model, in_place=True),
}


def _timings(layers: int, width: int, steps: int) -> dict:
    """On one rank: each variant's step times in milliseconds."""
    timings = {}
    for name, make in VARIANTS.items():
        step = make(_model(layers, width))
        dist.barrier()
        timings[name] = step_times_ms(step, "cpu", steps)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        results = on_gloo_ranks(_timings, world, args.layers, args.width, args.steps)
        base = max(statistics.median(r["torch AdamW foreach"]) for r in results)
        for name in VARIANTS:
            slowest = max(results, key=lambda r: statistics.median(r[name]))[name]
            ms = statistics.median(slowest)
            rows.append(dict(ranks=world, variant=name, ms=ms, range=spread(slowest), **{"x torch foreach": ms / base}))
    elements = args.layers * (args.width * args.width + args.width)
    print(
        f"{args.layers} x Linear({args.width}, {args.width}), {elements / 1e6:.2f}M float32 parameters, fully_shard; "
        "one thread per rank; the slowest rank's median optimizer step"
    )
    print(table(rows, ["ranks", "variant", "ms", "range", "x torch foreach"]))


if __name__ == "__main__":
    main()
