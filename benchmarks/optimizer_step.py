"""One optimizer step: torch.optim (for-loop, foreach, fused, torch.compile) vs functional_bagua
(fb.Optimizer with torch's kernel and with the pure update, tree eager, flat fused eager, flat
fused in-place with the fastest kernel, flat fused compiled).

    python benchmarks/optimizer_step.py                       # CPU, all configs, chart to benchmarks/
    python benchmarks/optimizer_step.py --device cuda --configs a,b,c

Configs: (a) 200 tensors x 5k, (b) 20 x 500k, (c) BERT-base's 199 parameter shapes, scaled down
(hidden 256, vocab 8192; ~11.7M elements). Prints a Markdown table per config: median step time,
ratio to torch's fused optimizer, compile time, peak memory, effective bandwidth (the bytes the
update must read and write / time) as a share of the measured copy bandwidth. Then the compile
time of the fused update for 20, 200 and 2000 tensors.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakMemory, bar_chart, copy_bandwidth_gbs, first_call_s, machine, median_ms, table  # noqa: E402

import functional_bagua as fb  # noqa: E402

# bytes read + written per element and step, in units of the element size (p, g, moments)
TRAFFIC = {"adamw": 7, "adam": 7, "sgd": 5, "lamb": 9}
TORCH = {
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw),
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw),
}
FB = {
    "adamw": lambda: fb.adamw(lr=1e-3, weight_decay=0.01),
    "adam": lambda: fb.adam(lr=1e-3),
    "sgd": lambda: fb.sgd(lr=1e-2, momentum=0.9),
    "lamb": lambda: fb.lamb(lr=1e-3, weight_decay=0.01),
}


def bert_base_shapes(hidden=256, layers=12, vocab=8192, positions=512) -> list[tuple]:
    """BERT-base's parameter shapes (199 tensors) with a smaller hidden size and vocabulary."""
    ffn = 4 * hidden
    shapes = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)]
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,), (hidden,), (hidden,)]
    return shapes + [(hidden, hidden), (hidden,)]


CONFIGS = {
    "a": ("(a) 200 x 5k", lambda: [(5000,)] * 200),
    "b": ("(b) 20 x 500k", lambda: [(500_000,)] * 20),
    "c": ("(c) BERT-base shapes", bert_base_shapes),
}


def make_params(shapes, device):
    gen = torch.Generator().manual_seed(0)
    params = {f"p{i:04d}": torch.randn(s, generator=gen).to(device) for i, s in enumerate(shapes)}
    grads = {k: torch.randn(v.shape, generator=gen).to(device) * 1e-2 for k, v in params.items()}
    return params, grads


def torch_variants(name, params, grads, device, with_compile):
    """(variant, step function, compile seconds or None) for torch.optim."""
    out = []
    kinds = [
        ("torch for-loop", dict(foreach=False)),
        ("torch foreach", dict(foreach=True)),
        ("torch fused", dict(fused=True)),
    ]
    if with_compile:
        kinds.append(("torch compiled", dict(foreach=True)))
    for variant, kw in kinds:
        tensors = [torch.nn.Parameter(p.clone()) for p in params.values()]
        for t, g in zip(tensors, grads.values()):
            t.grad = g.clone()
        opt = TORCH[name](tensors, **kw)
        if variant == "torch compiled":
            step = torch.compile(opt.step)
            out.append((variant, step, first_call_s(step, device)))
        else:
            out.append((variant, opt.step, None))
    return out


FB_OPTIMIZER = {  # fb.Optimizer's factory and hyperparameters, those of TORCH
    "adamw": (fb.adamw, dict(lr=1e-3, weight_decay=0.01)),
    "adam": (fb.adam, dict(lr=1e-3)),
    "sgd": (fb.sgd, dict(lr=1e-2, momentum=0.9)),
}


def fb_optimizer_variants(name, params, grads):
    """(variant, step function, None) for fb.Optimizer.step on parameters with a .grad: torch's
    fused kernel (its default for these aliases) and the pure update (fused=False)."""
    factory, hyper = FB_OPTIMIZER[name]
    out = []
    for variant, fused in (("fb.Optimizer kernel", None), ("fb.Optimizer pure", False)):
        tensors = [torch.nn.Parameter(p.clone()) for p in params.values()]
        for t, g in zip(tensors, grads.values()):
            t.grad = g.clone()
        out.append((variant, fb.Optimizer(tensors, factory, fused=fused, **hyper).step, None))
    return out


def fb_variants(name, params, grads, device):
    """(variant, step function, compile seconds or None) for functional_bagua."""
    tx = FB[name]()
    tree = {"params": params, "state": tx.init(params)}

    def tree_step():
        updates, tree["state"] = tx.update(grads, tree["state"], tree["params"])
        tree["params"] = fb.apply_updates(tree["params"], updates)

    layout = fb.FlatLayout.of(params)
    flat_grads = layout.flatten(grads)
    fused = fb.fuse(FB[name](), layout)
    pure = {"params": layout.flatten(params)}
    pure["state"] = fused.init(pure["params"])

    def flat_step():
        updates, pure["state"] = fused.update(flat_grads, pure["state"], pure["params"])
        pure["params"] = fb.apply_updates(pure["params"], updates)

    out = [("fb tree eager", tree_step, None), ("fb flat eager", flat_step, None)]
    best = "torch" if name in TORCH else "eager"
    for variant, kernel in ((f"fb flat in-place ({best})", best), ("fb flat compiled", "compiled")):
        flat_params = layout.flatten(params)
        state = fused.init(flat_params)
        step_ = fb.fuse_inplace(FB[name](), layout, kernel=kernel)

        def inplace_step(step_=step_, flat_params=flat_params, state=state):
            step_(flat_grads, state, flat_params)

        compile_s = first_call_s(inplace_step, device) if kernel == "compiled" else None
        out.append((variant, inplace_step, compile_s))
    return out


FAMILIES = ("torch", "fb.Optimizer", "fb")  # torch.optim, fb.Optimizer, the functional updates


def bench_config(key, names, device, steps, copy_gbs, torch_compile_for, families=FAMILIES):
    label, shapes_fn = CONFIGS[key]
    shapes = shapes_fn()
    params, grads = make_params(shapes, device)
    numel = sum(p.numel() for p in params.values())
    rows = []
    for name in names:
        variants = []
        if name in TORCH and "torch" in families:
            variants += torch_variants(name, params, grads, device, f"{name}:{key}" in torch_compile_for)
        if name in TORCH and "fb.Optimizer" in families:
            variants += fb_optimizer_variants(name, params, grads)
        if "fb" in families:
            variants += fb_variants(name, params, grads, device)
        for variant, step, compile_s in variants:
            with PeakMemory(device) as mem:
                ms = median_ms(step, device, steps)
            gbs = TRAFFIC[name] * numel * 4 / (ms * 1e-3) / 1e9
            rows.append(
                dict(
                    config=label,
                    optimizer=name,
                    variant=variant,
                    ms=ms,
                    compile_s=compile_s or "",
                    peak_mib=mem.mib,
                    gbs=gbs,
                    bw_share=f"{100 * gbs / copy_gbs:.0f}%",
                )
            )
            torch._dynamo.reset()
        fused_ref = next(
            (
                r["ms"]
                for r in rows
                if r["optimizer"] == name and r["variant"] == "torch fused" and r["config"] == label
            ),
            None,
        )
        for r in rows:
            if r["optimizer"] == name and r["config"] == label:
                r["vs_torch_fused"] = f"{r['ms'] / fused_ref:.2f}x" if fused_ref else "n/a"
    return label, len(shapes), numel, rows


def disable_compile_caches() -> None:
    """Compile times are measured cold: no FX-graph or AOT-autograd cache hits from earlier runs."""
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def compile_scaling(device, counts=(20, 200, 2000), total=1_000_000):
    """Seconds to compile the fused in-place AdamW update, for several tensor counts (same total size)."""
    warm = torch.compile(lambda x: x * 2 + 1)  # pay inductor's one-time start-up outside the timings
    warm(torch.ones(4, device=device))
    rows = []
    for n in counts:
        torch._dynamo.reset()
        params, grads = make_params([(total // n,)] * n, device)
        layout = fb.FlatLayout.of(params)
        flat, flat_grads = layout.flatten(params), layout.flatten(grads)
        state = fb.fuse(FB["adamw"](), layout).init(flat)
        step_ = fb.fuse_inplace(FB["adamw"](), layout, kernel="compiled")
        run = functools.partial(step_, flat_grads, state, flat)
        rows.append(dict(tensors=n, compile_s=first_call_s(run, device), step_ms=median_ms(run, device, 10)))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", default="a,b,c")
    parser.add_argument("--optimizers", default="adamw,adam,sgd,lamb")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--torch-compile",
        default="adamw:a",
        help="optimizer:config pairs for which to time torch.compile(opt.step) (slow to compile on CPU)",
    )
    parser.add_argument(
        "--chart",
        default=os.path.join(os.path.dirname(__file__), "optimizer_step.png"),
        help="where to draw the chart; an empty string draws none",
    )
    parser.add_argument("--no-scaling", action="store_true", help="skip the compile-time scaling run")
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help=f"which kinds of variants to time, of {', '.join(FAMILIES)}"
    )
    args = parser.parse_args(argv)
    disable_compile_caches()
    copy_gbs = copy_bandwidth_gbs(args.device)
    print(f"# optimizer step, {machine()}; copy bandwidth {copy_gbs:.1f} GB/s\n")
    chart = {}
    columns = ["optimizer", "variant", "ms", "vs_torch_fused", "compile_s", "peak_mib", "gbs", "bw_share"]
    for key in args.configs.split(","):
        label, count, numel, rows = bench_config(
            key,
            args.optimizers.split(","),
            args.device,
            args.steps,
            copy_gbs,
            set(args.torch_compile.split(",")),
            args.families.split(","),
        )
        print(f"## {label}: {count} tensors, {numel / 1e6:.2f}M elements\n\n{table(rows, columns)}\n", flush=True)
        for r in rows:
            chart.setdefault(f"{key}:{r['optimizer']}", {})[r["variant"]] = r["ms"]
    if args.chart and bar_chart(args.chart, f"optimizer step, {machine()}", chart, "median step (ms, log)"):
        print(f"chart: {args.chart}\n")
    if not args.no_scaling:
        print("## compile time of the fused in-place AdamW update (1M elements in all)\n")
        print(table(compile_scaling(args.device), ["tensors", "compile_s", "step_ms"]))


if __name__ == "__main__":
    main()
