"""Pure (out-of-place) AdamW updates of large buffers: what the allocator costs.

    python benchmarks/pure_update_allocator.py            # glibc's default malloc
    python benchmarks/pure_update_allocator.py --pin      # glibc pinned (common.steady_malloc)

AdamW on 10M float32 elements held in 1, 3 or 10 buffers: torch's fused kernel in place, the same
kernel in its functional form (``aten::_fused_adamw``: new tensors out), and the multi-op pure
update (one out-of-place ``torch._foreach_*`` op per term). A pure update writes new buffers every
step; whether those cost page faults depends on the allocator and on the buffers' sizes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, median_ms, record, steady_malloc, table  # noqa: E402

N = 10_000_000
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)


def buffers(pieces: int) -> tuple[list, list, list, list, list]:
    sizes = [N // pieces] * pieces
    p, g, m, v = ([torch.randn(s) for s in sizes] for _ in range(4))
    return p, g, m, v, [torch.tensor(3.0)] * pieces


def multi_op(p: list, g: list, m: list, v: list) -> tuple:
    new_m = torch._foreach_lerp(m, g, 0.1)
    new_v = torch._foreach_mul(v, 0.999)
    torch._foreach_addcmul_(new_v, g, g, 0.001)
    denom = torch._foreach_sqrt(new_v)
    torch._foreach_add_(denom, 1e-8)
    new_p = torch._foreach_mul(p, 0.99999)
    torch._foreach_addcdiv_(new_p, new_m, denom, -1e-3)
    return new_p, new_m, new_v


def time_update(kind: str, pieces: int) -> float:
    """Median ms of one ``kind`` update of the buffers cut in ``pieces``."""
    p, g, m, v, steps = buffers(pieces)
    if kind == "in place":
        return median_ms(lambda: torch._fused_adamw_(p, g, m, v, [], steps, **HYPER), "cpu", 15)
    if kind == "functional":
        return median_ms(lambda: torch.ops.aten._fused_adamw(p, g, m, v, [], steps, **HYPER), "cpu", 15)
    return median_ms(lambda: multi_op(p, g, m, v), "cpu", 15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", action="store_true", help="pin glibc's malloc first (common.steady_malloc)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    allocator = steady_malloc() if args.pin else "glibc's default malloc"
    rows = [dict(update="torch fused, in place", buffers=1, ms=time_update("in place", 1))]
    for pieces in (1, 3, 10):
        rows.append(dict(update="fused kernel, functional form", buffers=pieces, ms=time_update("functional", pieces)))
        rows.append(dict(update="multi-op pure (foreach)", buffers=pieces, ms=time_update("multi-op", pieces)))
    title = f"AdamW on {N / 1e6:.0f}M float32 elements; {allocator}"
    print(f"# {title}, {machine()}\n")
    print(table(rows, ["update", "buffers", "ms"]))
    if args.record:
        chart = dict(value="ms", label=["update", "buffers"], log=False)
        name = "pure_update_allocator-" + ("pinned" if args.pin else "default")
        record(name, "cpu", [dict(title=title, columns=["update", "buffers", "ms"], rows=rows, chart=chart)])


if __name__ == "__main__":
    main()
