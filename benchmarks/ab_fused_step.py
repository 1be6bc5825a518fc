"""A/B of ``fuse_step`` between another checkout's ``compat/`` and this tree's, balanced for order.

    git worktree add ../old <commit>
    python benchmarks/ab_fused_step.py --other ../old/compat
    python benchmarks/ab_fused_step.py --other compat              # identical code: the noise floor

Each row builds a plain optimizer (``step``) and two fused copies, A (the other checkout) and B
(this tree), on the 200-tensor model of benchmarks/fused_optimizer.py, and times them in
rotation so that each variant follows ``step`` equally often. The optimizer built later tends
to run a few percent faster (up to 9% on identical code here), so every row is run twice, A
built first and then B built first, and the reported ``B/A`` is the geometric mean of the two
time ratios: below 1, this tree's fused step is faster.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from common import machine, steady_malloc, table  # noqa: E402
from fused_optimizer import CONFIGS, IMPLEMENTATIONS, make_tensors, optimizer_on_copies  # noqa: E402

import functional_bagua.compat as this_compat  # noqa: E402

PACKAGE = "functional_bagua.compat"


def load_compat(path: str):
    """The ``compat`` package at ``path``, imported under its own name next to this tree's."""
    path = os.path.abspath(path)
    ours = {k: v for k, v in sys.modules.items() if k.startswith(PACKAGE)}
    for name in ours:
        del sys.modules[name]
    try:
        spec = importlib.util.spec_from_file_location(
            PACKAGE, os.path.join(path, "__init__.py"), submodule_search_locations=[path]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    finally:
        for name in [k for k in sys.modules if k.startswith(PACKAGE)]:
            del sys.modules[name]
        sys.modules.update(ours)
    return module


def trial(name, kwargs, params, grads, fresh, order, steps) -> dict:
    """Median milliseconds of ``step`` and of A's and B's ``fuse_step``, built in ``order``."""
    plain_params, plain = optimizer_on_copies(name, kwargs, params, grads)
    variants, keep = {"step": (plain_params, plain.step)}, [plain]
    for label, compat in order:
        ps, optimizer = optimizer_on_copies(name, kwargs, params, grads)
        keep.append(compat.fuse_optimizer(optimizer))
        variants[label] = (ps, optimizer.fuse_step)
    labels = list(variants)
    times = {label: [] for label in labels}
    for i in range(steps + 3):
        for label in labels[i % 3 :] + labels[: i % 3]:
            ps, step = variants[label]
            if fresh:
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
            start = time.perf_counter()
            step()
            if i >= 3:
                times[label].append(time.perf_counter() - start)
    del keep, variants
    gc.collect()
    return {label: statistics.median(t) * 1e3 for label, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="path of the other checkout's compat/ folder")
    parser.add_argument("--optimizers", default="SGD momentum,Adam,AdamW,Adadelta")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    print(f"# fuse_step A/B, A = {args.other}, B = this tree; {machine()}, {steady_malloc()}\n")
    other = load_compat(args.other)
    params, grads = make_tensors(CONFIGS["mlp"][1]())
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in args.optimizers.split(","):
            for impl, kwargs in IMPLEMENTATIONS.items():
                for fresh in (False, True):
                    a_first = trial(name, kwargs, params, grads, fresh, (("A", other), ("B", this_compat)), args.steps)
                    b_first = trial(name, kwargs, params, grads, fresh, (("B", this_compat), ("A", other)), args.steps)
                    ratio = math.sqrt(a_first["B"] / a_first["A"] * b_first["B"] / b_first["A"])
                    rows.append(
                        dict(
                            optimizer=name,
                            impl=impl,
                            grads="fresh" if fresh else "in place",
                            step_ms=statistics.mean([a_first["step"], b_first["step"]]),
                            A_ms=statistics.mean([a_first["A"], b_first["A"]]),
                            B_ms=statistics.mean([a_first["B"], b_first["B"]]),
                            B_over_A=f"{ratio:.3f}",
                        )
                    )
                    print(rows[-1], flush=True)
    print("\n" + table(rows, ["optimizer", "impl", "grads", "step_ms", "A_ms", "B_ms", "B_over_A"]))


if __name__ == "__main__":
    main()
