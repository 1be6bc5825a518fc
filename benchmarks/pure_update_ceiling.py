"""The ceiling of a pure (out-of-place) optimizer update on this machine, next to torch's own.

    python benchmarks/pure_update_ceiling.py [--configs a,b,c] [--rounds 3]

For AdamW and SGD with momentum on the optimizer_step.py configs, in one run: torch's foreach
and fused steps (in place), functional_bagua's pure update on the tree (``tx.update`` +
``apply_updates``) and on flat buffers (``fuse``: one buffer per dtype, or buffers of 16 MiB),
torchopt's (when installed: an optional peer, not a dependency), and hand-written pure updates: one out-of-place ``torch._foreach_*`` op per
line of the update rule (the fewest Python calls a multi-op pure update can make), torch's fused
AdamW kernel in its functional form (one pass, new tensors out), and the multi-op math over one
flat buffer, whole or in cache-sized pieces (what a pure ``fuse`` update could reach), and the
multi-tensor calls the tree path itself makes, in its order and roundings, with no Python around
them (the floor of the tree path for its bits). Medians
of ``--rounds`` rounds with their range; ratios to torch's foreach step of the same round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, median_ms, record, steady_malloc, table  # noqa: E402
from optimizer_step import CONFIGS  # noqa: E402

import functional_bagua as fb  # noqa: E402

LR, B1, B2, EPS, WD, MOMENTUM = 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.9


def number(x: float, like: list) -> torch.Tensor:
    """``x`` as a 0-dim tensor of the tensors' dtype: torch's CPU multi-tensor ops convert a Python
    number once per tensor (about 1 us each), a 0-dim tensor once, to the same bits (float32 and
    float64; what :mod:`functional_bagua.foreach` passes them)."""
    return torch.tensor(x, dtype=like[0].dtype)


def numbers(x: float, like: list) -> list:
    """``x`` as a list of one 0-dim tensor, for add and sub (their multi-tensor form with a
    0-dim tensor converts it per tensor too)."""
    return [number(x, like)] * len(like)


def pure_foreach_adamw(ps: list, gs: list, ms: list, vs: list, step: int) -> tuple:
    """AdamW out of place, one foreach op per term: the new (params, m, v)."""
    bc1, bc2 = 1 - B1**step, 1 - B2**step
    m = torch._foreach_lerp(ms, gs, 1 - B1)
    v = torch._foreach_mul(vs, number(B2, vs))
    torch._foreach_addcmul_(v, gs, gs, 1 - B2)  # in place on a fresh temporary: still pure
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, number(bc2**0.5, v))
    torch._foreach_add_(denom, numbers(EPS, v))
    new_p = torch._foreach_mul(ps, number(1 - LR * WD, ps))
    torch._foreach_addcdiv_(new_p, m, denom, -LR / bc1)
    return new_p, m, v


def pure_foreach_sgd(ps: list, gs: list, bufs: list) -> tuple:
    buf = torch._foreach_mul(bufs, number(MOMENTUM, bufs))
    torch._foreach_add_(buf, gs)
    return torch._foreach_add(ps, buf, alpha=-LR), buf


def chain_ops_adamw(ps: list, gs: list, ms: list, vs: list, step: int) -> list:
    """The multi-tensor calls ``fb.adamw``'s pure update and ``apply_updates`` make, in their
    order, with their roundings and operands (the chain's links: Adam's direction, the decayed
    weights, the learning rate; then the sum), without any of the Python around them: the floor
    of the tree path for these bits."""
    bc1, bc2 = torch.tensor(1 - B1**step, dtype=torch.float64), torch.tensor(1 - B2**step, dtype=torch.float64)
    m = torch._foreach_lerp(ms, gs, 1 - B1)
    v = torch._foreach_mul(vs, number(B2, vs))
    torch._foreach_addcmul_(v, gs, gs, 1 - B2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2.sqrt().to(v[0].dtype))
    torch._foreach_add_(denom, numbers(EPS, v))
    u = torch._foreach_div(m, bc1.to(m[0].dtype))
    torch._foreach_div_(u, denom)
    torch._foreach_add_(u, ps, alpha=WD)
    torch._foreach_mul_(u, number(-LR, u))
    return torch._foreach_add(ps, u)


def chain_ops_sgd(ps: list, gs: list, bufs: list) -> list:
    """``fb.sgd``'s multi-tensor calls with momentum (the buffer, the learning rate, the sum),
    without the Python around them."""
    buf = torch._foreach_mul(bufs, number(MOMENTUM, bufs))
    torch._foreach_add_(buf, gs)
    return torch._foreach_add(ps, torch._foreach_mul(buf, number(-LR, buf)))


def pure_flat_adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, piece: int) -> tuple:
    """AdamW out of place over one flat buffer, ``piece`` elements at a time (0: whole)."""
    bc1, bc2 = 1 - B1**step, 1 - B2**step
    new_p, new_m, new_v = torch.empty_like(p), torch.empty_like(m), torch.empty_like(v)
    n = p.numel()
    size = piece or n
    for start in range(0, n, size):
        sl = slice(start, min(n, start + size))
        mm = torch.lerp(m[sl], g[sl], 1 - B1, out=new_m[sl])
        vv = torch.mul(v[sl], B2, out=new_v[sl]).addcmul_(g[sl], g[sl], value=1 - B2)
        denom = vv.sqrt().div_(bc2**0.5).add_(EPS)
        torch.mul(p[sl], 1 - LR * WD, out=new_p[sl]).addcdiv_(mm, denom, value=-LR / bc1)
    return new_p, new_m, new_v


def torch_step(make, ps: list, gs: list, **kwargs):  # noqa: ANN001, ANN201
    tensors = [p.clone().requires_grad_() for p in ps]
    for p, g in zip(tensors, gs):
        p.grad = g
    return make(tensors, **kwargs).step


def fb_tree_step(tx: fb.GradientTransformation, ps: list, gs: list):  # noqa: ANN201
    params = {str(i): p for i, p in enumerate(ps)}
    grads = {str(i): g for i, g in enumerate(gs)}
    holder = [tx.init(params)]

    def step() -> None:
        updates, holder[0] = tx.update(grads, holder[0], params)
        fb.apply_updates(params, updates)

    return step


def fb_flat_step(tx: fb.GradientTransformation, ps: list, gs: list, max_buffer_mb=None):  # noqa: ANN001, ANN201
    """``fuse(tx, layout)``'s pure update + ``apply_updates`` on flat buffers (``max_buffer_mb``
    cuts each dtype into buffers of at most that size)."""
    params = {str(i): p for i, p in enumerate(ps)}
    layout = fb.FlatLayout.of(params, max_buffer_mb=max_buffer_mb)
    flat, grads = layout.flatten(params), layout.flatten({str(i): g for i, g in enumerate(gs)})
    fused = fb.fuse(tx, layout)
    holder = [fused.init(flat)]

    def step() -> None:
        updates, holder[0] = fused.update(grads, holder[0], flat)
        fb.apply_updates(flat, updates)

    return step


def torchopt_step(make, ps: list, gs: list):  # noqa: ANN001, ANN201
    """torchopt's functional update (``update`` + ``apply_updates``, out of place), if installed."""
    import torchopt

    params = tuple(ps)
    holder = [make(torchopt).init(params)]
    tx = make(torchopt)

    def step() -> None:
        updates, holder[0] = tx.update(tuple(gs), holder[0], params=params, inplace=False)
        torchopt.apply_updates(params, updates, inplace=False)

    return step


def pure_fused_adamw(ps: list, gs: list):  # noqa: ANN201
    """torch's fused AdamW kernel in its functional form (``aten::_fused_adamw``: new tensors out)."""
    ms, vs, steps = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], [torch.tensor(3.0)] * len(ps)
    kw = dict(lr=LR, beta1=B1, beta2=B2, weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
    return lambda: torch.ops.aten._fused_adamw(ps, gs, ms, vs, [], steps, **kw)


def adamw_ceilings(ps: list, gs: list) -> dict:
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (ps, gs)] + [torch.zeros(sum(p.numel() for p in ps))] * 2
    return {
        "pure foreach (ceiling of the tree path)": lambda: pure_foreach_adamw(ps, gs, ms, vs, 3),
        "fb.adamw's own multi-tensor calls, no Python": lambda: chain_ops_adamw(ps, gs, ms, vs, 3),
        "pure fused kernel (aten::_fused_adamw)": pure_fused_adamw(ps, gs),
        "pure flat, whole buffer": lambda: pure_flat_adamw(*flat, 3, 0),
        "pure flat, pieces of 65536": lambda: pure_flat_adamw(*flat, 3, 1 << 16),
    }


def sgd_ceilings(ps: list, gs: list) -> dict:
    bufs = [torch.zeros_like(p) for p in ps]
    return {
        "pure foreach (ceiling of the tree path)": lambda: pure_foreach_sgd(ps, gs, bufs),
        "fb.sgd's own multi-tensor calls, no Python": lambda: chain_ops_sgd(ps, gs, bufs),
    }


OPTIMIZERS = {  # torch's class, functional_bagua's transform, the ceilings, torchopt's transform
    "adamw": (
        lambda p, **kw: torch.optim.AdamW(p, lr=LR, weight_decay=WD, **kw),
        lambda: fb.adamw(LR, weight_decay=WD),
        adamw_ceilings,
        lambda torchopt: torchopt.adamw(LR, weight_decay=WD),
    ),
    "sgd": (
        lambda p, **kw: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM, **kw),
        lambda: fb.sgd(LR, momentum=MOMENTUM),
        sgd_ceilings,
        lambda torchopt: torchopt.sgd(LR, momentum=MOMENTUM),
    ),
}


def has_torchopt() -> bool:
    try:
        import torchopt  # noqa: F401
    except ImportError:
        return False
    return True


def run(key: str) -> list[dict]:
    label, shapes_fn = CONFIGS[key]
    shapes = shapes_fn()
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen) for s in shapes]
    gs = [torch.randn(s, generator=gen) for s in shapes]
    rows = []
    for opt, (torch_cls, fb_tx, ceilings, torchopt_tx) in OPTIMIZERS.items():
        variants = {
            "torch foreach": torch_step(torch_cls, ps, gs, foreach=True),
            "torch fused": torch_step(torch_cls, ps, gs, fused=True),
            "fb tree eager": fb_tree_step(fb_tx(), ps, gs),
            "fb flat eager (fuse), one buffer": fb_flat_step(fb_tx(), ps, gs),
            "fb flat eager (fuse), buffers of 16 MiB": fb_flat_step(fb_tx(), ps, gs, max_buffer_mb=16),
            **({"torchopt (pure)": torchopt_step(torchopt_tx, ps, gs)} if has_torchopt() else {}),
            **ceilings(ps, gs),
        }
        for variant, fn in variants.items():
            rows.append(dict(config=label, optimizer=opt, variant=variant, ms=median_ms(fn, "cpu", steps=20)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="a,b,c")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="keep the tables in benchmarks/results/ for the docs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    allocator = steady_malloc()
    print(f"# {machine()}; {allocator}; medians of {args.rounds} rounds (range)\n")
    columns = ["config", "optimizer", "variant", "ms", "vs_torch_foreach"]
    tables = []
    for key in args.configs.split(","):
        rounds = [run(key) for _ in range(args.rounds)]
        rows = []
        for i, r in enumerate(rounds[0]):
            times = [rd[i]["ms"] for rd in rounds]
            foreach = [
                rd[j]["ms"]
                for rd in rounds
                for j, x in enumerate(rd)
                if x["optimizer"] == r["optimizer"] and x["variant"] == "torch foreach"
            ]
            ratios = [t / f for t, f in zip(times, foreach)]
            rows.append(
                dict(
                    config=r["config"],
                    optimizer=r["optimizer"],
                    variant=r["variant"],
                    ms=f"{statistics.median(times):.3g} ({min(times):.3g}-{max(times):.3g})",
                    vs_torch_foreach=f"{statistics.median(ratios):.2f}x",
                    ratio=statistics.median(ratios),
                )
            )
        print(table(rows, columns))
        print()
        title = f"{rows[0]['config']}: medians of {args.rounds} rounds (range); {allocator}"
        tables.append(
            dict(
                title=title,
                columns=columns,
                rows=rows,
                chart=dict(value="ratio", label=["optimizer", "variant"], log=True),
            )
        )
    if args.record:
        record("pure_update_ceiling", "cpu", tables)


if __name__ == "__main__":
    main()
