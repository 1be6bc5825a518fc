"""First compile of a second-order step against the number of tensors: SOAP compiled over flat
buffers (``fb.fuse``, state stacked per shape) against heavyball's SOAP (compiled per tensor list),
at 20, 200 and 2000 tensors of one shape, each size in a fresh process with a fresh inductor cache.

    python benchmarks/second_order_compile.py                            # 20, 200, 2000 x (50, 100)
    python benchmarks/second_order_compile.py --sizes 20,200 --heavyball-sizes 20 --steps 10

Per size and variant: the first step in seconds (trace, compile, and the step itself: the
initial eigendecompositions), and the median step after it in milliseconds with its range; the
ratio of our first step to heavyball's at the same size. Hyperparameters as in
``second_order.py`` (eigenbases refreshed every 10 steps; heavyball's schedule off, float32
storage).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPE = (50, 100)


def run_one(variant: str, size: int, steps: int, threads: int) -> dict:
    """One measurement, in this process (called in a child)."""
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from common import spread
    from second_order import stepper_compiled_fused, stepper_heavyball

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(SHAPE, generator=gen).div_(10) for _ in range(size)]
    make = {"fb.soap compiled, fused": stepper_compiled_fused, "heavyball SOAP (compiled)": stepper_heavyball}[variant]
    step = make(params, "cpu")
    if step is None:
        return {}
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return dict(first_s=first, ms=statistics.median(times), range=spread(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,200,2000")
    parser.add_argument("--heavyball-sizes", default="20,200", help="heavyball compiles for minutes past 200")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, size = args.child.rsplit(":", 1)
        print(json.dumps(run_one(variant, int(size), args.steps, args.threads)))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from common import machine, steady_malloc, table

    print(f"{machine('cpu')}; {steady_malloc()}; tensors of shape {SHAPE}, float32")
    rows = []
    plan = [("fb.soap compiled, fused", int(n)) for n in args.sizes.split(",")]
    plan += [("heavyball SOAP (compiled)", int(n)) for n in args.heavyball_sizes.split(",") if n]
    for variant, size in plan:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
        child = [sys.executable, __file__, "--child", f"{variant}:{size}", "--steps", str(args.steps)]
        child += ["--threads", str(args.threads)]
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if result:
            rows.append(dict(variant=variant, tensors=size, **result))
    ours = {r["tensors"]: r["first_s"] for r in rows if r["variant"].startswith("fb.")}
    for r in rows:
        if not r["variant"].startswith("fb.") and r["tensors"] in ours:
            r["ours / this first"] = ours[r["tensors"]] / r["first_s"]
    print()
    print(table(rows, ["variant", "tensors", "first_s", "ms", "range", "ours / this first"]))


if __name__ == "__main__":
    main()
