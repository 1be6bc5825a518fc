"""First compile of a second-order step against the number of tensors: SOAP, Shampoo and
PSGD-Kron compiled over flat buffers (``fb.fuse``, state stacked per shape) against heavyball's
SOAP and PSGDKron (compiled per tensor list; heavyball has no plain Shampoo), at 20, 200 and 2000
tensors of one shape, each size in a fresh process with a fresh inductor cache.

    python benchmarks/second_order_compile.py                            # SOAP: 20, 200, 2000 x (50, 100)
    python benchmarks/second_order_compile.py --optimizer shampoo        # or kron
    python benchmarks/second_order_compile.py --sizes 20,200 --heavyball-sizes 20 --steps 10

Per size and variant: the first step in seconds (trace, compile, and the step itself: the
initial eigendecompositions), and the median step after it in milliseconds with its range; the
ratio of our first step to heavyball's at the same size. Hyperparameters as in
``second_order.py`` (SOAP's eigenbases and Shampoo's float32 roots refreshed every 10 steps;
heavyball's SOAP schedule off, float32 storage; PSGD-Kron's defaults, lr 3e-4).
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
VARIANTS = {  # per optimizer: ours, and heavyball's where it has one (second_order.py's names)
    "soap": ("fb.soap compiled, fused", "heavyball SOAP (compiled)"),
    "shampoo": ("fb.shampoo compiled, fused (float32 roots)",),
    "kron": ("fb.psgd_kron compiled, fused", "heavyball PSGDKron (compiled)"),
}


def run_one(variant: str, size: int, steps: int, threads: int) -> dict:
    """One measurement, in this process (called in a child)."""
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    import second_order
    from common import spread

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(SHAPE, generator=gen).div_(10) for _ in range(size)]
    make = {
        **{name: second_order.VARIANTS[name] for name in VARIANTS["soap"]},
        **{name: second_order.SHAMPOO_VARIANTS[name] for name in VARIANTS["shampoo"]},
        **{name: second_order.KRON_VARIANTS[name] for name in VARIANTS["kron"]},
    }[variant]
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
    parser.add_argument("--optimizer", default="soap", choices=sorted(VARIANTS))
    parser.add_argument("--sizes", default="20,200,2000")
    parser.add_argument("--heavyball-sizes", default="20,200", help="heavyball compiles for minutes past 200")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, size = args.child.rsplit(":", 1)
        print(json.dumps(run_one(variant, int(size), args.steps, args.threads)))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from common import machine, record, steady_malloc, table

    print(f"{machine('cpu')}; {steady_malloc()}; tensors of shape {SHAPE}, float32")
    rows = []
    ours, *peers = VARIANTS[args.optimizer]
    plan = [(ours, int(n)) for n in args.sizes.split(",")]
    plan += [(peer, int(n)) for peer in peers for n in args.heavyball_sizes.split(",") if n]
    for variant, size in plan:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
        child = [sys.executable, __file__, "--child", f"{variant}:{size}", "--steps", str(args.steps)]
        child += ["--threads", str(args.threads)]
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if result:
            rows.append(dict(variant=variant, tensors=size, **result))
    first = {r["tensors"]: r["first_s"] for r in rows if r["variant"] == ours}
    for r in rows:
        if r["variant"] != ours and r["tensors"] in first:
            r["ours / this first"] = first[r["tensors"]] / r["first_s"]
    print()
    columns = ["variant", "tensors", "first_s", "ms", "range", "ours / this first"]
    print(table(rows, columns))
    if args.record:
        title = f"{args.optimizer}: first call (compile) against the number of tensors of shape {SHAPE}"
        chart = dict(value="first_s", label=["variant", "tensors"], log=True)
        record(
            f"second_order_compile-{args.optimizer}",
            "cpu",
            [dict(title=title, columns=columns, rows=rows, chart=chart)],
        )


if __name__ == "__main__":
    main()
