"""A/B of the pure eager update (``tx.update`` + ``apply_updates`` on a parameter dict) between
another checkout and this tree, each in its own process, alternating A and B.

    git worktree add ../old <commit>
    python benchmarks/ab_eager_update.py --other ../old --rounds 3

One process per checkout and round (run in the checkout, which it imports; one thread each,
glibc's malloc pinned as in ``common.steady_malloc``), timing 200 tensors x 5k elements
(``--config a``) or 20 x 500k (``--config b``) for AdamW, SGD with momentum and plain SGD: the
median of 50 steps after 10 warm-up steps. Prints, per optimizer, the median over the rounds of
each side's median and the range, and B/A (above 1: this tree is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CONFIGS = {"a": (200, 5000), "b": (20, 500_000)}

TIMING = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, HERE)
import common
common.steady_malloc()
torch.set_num_threads(1)
import functional_bagua as fb
gen = torch.Generator().manual_seed(0)
params = {f"p{i:04d}": torch.randn(SIZE, generator=gen) for i in range(COUNT)}
grads = {k: torch.randn(SIZE, generator=gen) for k in params}
out = {}
for name, tx in (("adamw", fb.adamw(1e-3, weight_decay=0.01)), ("sgd momentum", fb.sgd(1e-2, momentum=0.9)),
                 ("sgd", fb.sgd(1e-2))):
    state = tx.init(params)
    times = []
    for _ in range(60):
        start = time.perf_counter()
        updates, _ = tx.update(grads, state, params)
        fb.apply_updates(params, updates)
        times.append(time.perf_counter() - start)
    out[name] = statistics.median(times[10:]) * 1e3
print(json.dumps(out))
"""


def run(checkout: str, config: str) -> dict:
    """The timings of ``checkout``'s functional_bagua (``python -c`` puts the working directory
    first on ``sys.path``, so the process runs in the checkout)."""
    checkout = os.path.abspath(checkout)
    count, size = CONFIGS[config]
    code = (
        TIMING.replace(
            "import functional_bagua as fb",
            f"import functional_bagua as fb\nassert fb.__file__.startswith({checkout!r})",
        )
        .replace("HERE", repr(HERE))
        .replace("COUNT", str(count))
        .replace("SIZE", str(size))
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=checkout,
        env=dict(os.environ, PYTHONPATH=checkout),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--other", required=True, help="path of the other checkout (A)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="a", help="a: 200 x 5k, b: 20 x 500k")
    args = parser.parse_args()
    a_runs, b_runs = [], []
    for _ in range(args.rounds):
        a_runs.append(run(args.other, args.config))
        b_runs.append(run(ROOT, args.config))
    count, size = CONFIGS[args.config]
    print(f"| update ({count} x {size}, 1 thread) | A ms (range) | B ms (range) | B/A |")
    print("|---|---|---|---|")
    for name in a_runs[0]:
        a, b = [r[name] for r in a_runs], [r[name] for r in b_runs]
        print(
            f"| {name} | {statistics.median(a):.2f} ({min(a):.2f}-{max(a):.2f}) | "
            f"{statistics.median(b):.2f} ({min(b):.2f}-{max(b):.2f}) | {statistics.median(b) / statistics.median(a):.3f} |"
        )


if __name__ == "__main__":
    main()
