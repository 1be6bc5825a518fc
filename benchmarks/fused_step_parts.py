"""Where a ``fuse_step`` spends its time, part by part, on the 200-tensor model.

    python benchmarks/fused_step_parts.py                          # Adam foreach, gradients in place
    python benchmarks/fused_step_parts.py --optimizer "SGD momentum" --fresh

Each ``fuse_step`` runs right after a plain ``step()`` of a second copy of the optimizer (as in
benchmarks/fused_optimizer.py, so the caches are as cold as a training loop leaves them). The
parts are timed by wrapping the methods of ``functional_bagua.compat`` that do them; the table
gives each part's median over the calls, in microseconds. ``before`` / ``optimizer step`` /
``after``: the time up to the optimizer's own ``step``, inside it, and after it. The wrapped parts
nest (``_plan_to_fuse`` holds ``_plan``, which holds ``_GroupPlan.holds``, which holds
``Run.holds``; ``Run.bring_in_grads`` is the copy of fresh gradients; ``Run.take_back`` writes the
state back).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from common import machine, record, steady_malloc, table  # noqa: E402
from fused_optimizer import CONFIGS, IMPLEMENTATIONS, OPTIMIZERS, make_tensors, optimizer_on_copies  # noqa: E402

import functional_bagua.compat.fuse as fuse  # noqa: E402
from functional_bagua.compat.runs import Run  # noqa: E402

PARTS = [
    (fuse._Fusion, "_plan_to_fuse"),
    (fuse._Fusion, "_plan"),
    (fuse._GroupPlan, "holds"),
    (Run, "holds"),
    (Run, "bring_in_grads"),
    (Run, "chunk_states"),
    (Run, "take_back"),
]


def timing(times: dict, label: str, fn):
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(label, []).append(time.perf_counter_ns() - start)

    return timed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="Adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--impl", default="foreach", choices=sorted(IMPLEMENTATIONS))
    parser.add_argument("--fresh", action="store_true", help="new gradient tensors before every step")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    args = parser.parse_args(argv)
    allocator = steady_malloc()
    params, grads = make_tensors(CONFIGS["mlp"][1]())
    kwargs = IMPLEMENTATIONS[args.impl]
    plain_params, plain = optimizer_on_copies(args.optimizer, kwargs, params, grads)
    fused_params, fused = optimizer_on_copies(args.optimizer, kwargs, params, grads)
    fuse_step = fuse.fuse_optimizer(fused).fuse_step
    fuse_step()  # plans and probes

    times: dict = {}
    for owner, name in PARTS:
        setattr(owner, name, timing(times, f"{owner.__name__}.{name}", getattr(owner, name)))
    marks = {}
    plain_step_of = fuse._plain_step

    def marked_step(optimizer):
        step = plain_step_of(optimizer)

        def run(*a):
            marks["in"] = time.perf_counter_ns()
            result = step(*a)
            marks["out"] = time.perf_counter_ns()
            return result

        return run

    fuse._plain_step = marked_step
    phases = {"before": [], "optimizer step": [], "after": [], "fuse_step": []}

    def renew_grads(ps):
        if args.fresh:
            for p, g in zip(ps, grads):
                p.grad = g.clone()

    for _ in range(args.steps):
        renew_grads(plain_params)
        plain.step()  # leaves the caches as the benchmark's rotation does
        renew_grads(fused_params)
        start = time.perf_counter_ns()
        fuse_step()
        end = time.perf_counter_ns()
        for key, value in (
            ("before", marks["in"] - start),
            ("optimizer step", marks["out"] - marks["in"]),
            ("after", end - marks["out"]),
            ("fuse_step", end - start),
        ):
            phases[key].append(value)
    rows = [dict(part=k, us=statistics.median(v) / 1e3) for k, v in {**phases, **times}.items()]
    regime = "fresh gradients" if args.fresh else "gradients in place"
    title = f"fuse_step parts: {args.optimizer} {args.impl}, {regime}, 200 tensors; {allocator}"
    print(f"# {title}; {machine()}\n")
    print(table(rows, ["part", "us"]))
    if args.record:
        name = "fused_step_parts-" + "_".join(
            f"{args.optimizer} {args.impl} {'fresh' if args.fresh else 'in place'}".lower().split()
        )
        chart = dict(value="us", label=["part"], log=True)
        record(name, "cpu", [dict(title=title, columns=["part", "us"], rows=rows, chart=chart)])


if __name__ == "__main__":
    main()
