"""One optimizer step: torch.optim (for-loop, foreach, fused, torch.compile), the peers (heavyball,
torchopt: optional) and functional_bagua (fb.Optimizer, the pure tree update, flat fused eager,
flat fused in place with torch's kernel, flat fused compiled), in one run.

    python benchmarks/optimizer_step.py --record              # CPU, all configs, tables kept for the docs
    python benchmarks/optimizer_step.py --device cuda --configs a,b,c,d --json step.json
    python benchmarks/optimizer_step.py --device cuda --roofline --only-roofline
    python benchmarks/optimizer_step.py --device cuda --only-scaling --families fb,peers,torch

Configs: (a) 200 tensors x 5k, (b) 20 x 500k, (c) BERT-base's 199 parameter shapes (full size
on a GPU, 109M elements; hidden 256 and vocabulary 8192 on the CPU, 11.7M), (d) GPT-2 small's
148 shapes (124M elements). Optimizers: AdamW, Adam, SGD (momentum 0.9), LAMB, Lion, Adafactor
and Muon (Muon on the config's 2-D tensors only, as it is used). Each row: median step time and
its range, the ratio to torch's fused step (torch's foreach step where torch has no fused kernel,
n/a where torch lacks the optimizer), first-call (compile) time, peak memory above the start,
effective bandwidth (the bytes the update must read and write / time) and its share of the
device-to-device copy bandwidth measured in the same run (the memory roofline).

``--roofline``: AdamW on one flat buffer of 1M to 100M elements (torch's fused kernel, our
``fuse_inplace`` with torch's kernel and compiled), each step as a share of the time its 7 arrays
need at the measured copy bandwidth. ``--scaling``: first-call time of the compiled update for
20, 200 and 2000 tensors (ours, heavyball's AdamW, ``torch.compile(opt.step)``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    PeakMemory,
    bar_chart,
    copy_bandwidth_gbs,
    first_call_s,
    machine,
    record,
    spread,
    step_times_ms,
    table,
    write_json,
)

import functional_bagua as fb  # noqa: E402


class Spec(NamedTuple):
    """One optimizer: our alias and the hyperparameters it and torch's class (if torch has one)
    are built with, torch's implementations to time, the peers' constructors, and the bytes per
    element its update must move (elements read plus written, in units of the element size; 0:
    not memory-bound, no bandwidth column)."""

    alias: Callable
    hyper: dict
    traffic: int
    torch_cls: Optional[Callable] = None
    torch_kinds: tuple = ()
    heavyball: Optional[Callable] = None
    torchopt: Optional[Callable] = None
    matrices_only: bool = False
    flat_compiled: bool = True  # False: per-matrix work (factored moments, Newton-Schulz) compiles per tensor

    def fb(self):
        return self.alias(**self.hyper)

    def torch(self, params, **kw):
        return self.torch_cls(params, **self.hyper, **kw)


LOOP, FOREACH, FUSED = (
    ("torch for-loop", dict(foreach=False)),
    ("torch foreach", dict(foreach=True)),
    ("torch fused", dict(fused=True)),
)


def _heavyball(name: str, **kw):
    def make(ps):
        import heavyball

        return getattr(heavyball, name)(ps, **kw)

    return make


def _torchopt(name: str, *args, **kw):
    def make():
        import torchopt

        return getattr(torchopt, name)(*args, **kw)

    return make


SPECS = {
    "adamw": Spec(
        fb.adamw,
        dict(lr=1e-3, weight_decay=0.01),
        7,
        torch.optim.AdamW,
        (LOOP, FOREACH, FUSED),
        heavyball=_heavyball("AdamW", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
        torchopt=_torchopt("adamw", 1e-3, weight_decay=0.01),
    ),
    "adam": Spec(fb.adam, dict(lr=1e-3), 7, torch.optim.Adam, (LOOP, FOREACH, FUSED), torchopt=_torchopt("adam", 1e-3)),
    # heavyball's SGD compiles with max-autotune as its AdamW does; its AdamW is the comparison
    "sgd": Spec(
        fb.sgd,
        dict(lr=1e-2, momentum=0.9),
        5,
        torch.optim.SGD,
        (LOOP, FOREACH, FUSED),
        torchopt=_torchopt("sgd", 1e-2, momentum=0.9),
    ),
    "lamb": Spec(fb.lamb, dict(lr=1e-3, weight_decay=0.01), 9),
    "lion": Spec(fb.lion, dict(lr=1e-4, weight_decay=0.01), 5),
    "adafactor": Spec(
        fb.adafactor,
        dict(lr=1e-2),
        3,
        getattr(torch.optim, "Adafactor", None),
        (LOOP, FOREACH),
        flat_compiled=False,
    ),
    "muon": Spec(
        fb.muon,
        dict(lr=1e-3, weight_decay=0.1),
        0,
        getattr(torch.optim, "Muon", None),
        (("torch", {}),),
        matrices_only=True,
        flat_compiled=False,
    ),
}
FB_VARIANTS = ("fb.Optimizer", "fb tree eager", "fb flat eager", "fb flat in-place (torch)", "fb flat compiled")


def bert_base_shapes(hidden=256, layers=12, vocab=8192, positions=512) -> list[tuple]:
    """BERT-base's parameter shapes (199 tensors); full size with hidden=768, vocab=30522."""
    ffn = 4 * hidden
    shapes = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)]
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,), (hidden,), (hidden,)]
    return shapes + [(hidden, hidden), (hidden,)]


def gpt2_small_shapes(hidden=768, layers=12, vocab=50257, positions=1024) -> list[tuple]:
    """GPT-2 small's parameter shapes (148 tensors, 124M elements; the head tied to the embedding)."""
    shapes = [(vocab, hidden), (positions, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden,), (hidden, 3 * hidden), (3 * hidden,), (hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,), (hidden, 4 * hidden), (4 * hidden,), (4 * hidden, hidden), (hidden,)]
    return shapes + [(hidden,), (hidden,)]


def configs(device: str) -> dict:
    full = device.startswith("cuda")
    bert = ("(c) BERT-base shapes", lambda: bert_base_shapes(768, vocab=30522))
    bert_small = ("(c) BERT-base shapes (hidden 256, vocab 8192)", bert_base_shapes)
    return {
        "a": ("(a) 200 x 5k", lambda: [(5000,)] * 200),
        "b": ("(b) 20 x 500k", lambda: [(500_000,)] * 20),
        "c": bert if full else bert_small,
        "d": ("(d) GPT-2 small shapes", gpt2_small_shapes),
    }


CONFIGS = configs("cpu")


def make_params(shapes, device):
    gen = torch.Generator().manual_seed(0)
    params = {f"p{i:04d}": (torch.randn(s, generator=gen) * 0.02).to(device) for i, s in enumerate(shapes)}
    grads = {k: (torch.randn(v.shape, generator=gen) * 1e-3).to(device) for k, v in params.items()}
    return params, grads


def leaves_with_grads(params, grads):
    tensors = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for t, g in zip(tensors, grads.values()):
        t.grad = g.clone()
    return tensors


# --- the variants: each yields (variant, make) where make() -> (step function, compile seconds) -----


def torch_variants(spec, name, key, params, grads, device, compile_for):
    if spec.torch_cls is None:
        return
    for variant, kw in spec.torch_kinds:
        yield variant, lambda kw=kw: (spec.torch(leaves_with_grads(params, grads), **kw).step, None)
    if f"{name}:{key}" in compile_for:

        def compiled():
            step = torch.compile(spec.torch(leaves_with_grads(params, grads), foreach=True).step)
            return step, first_call_s(step, device)

        yield "torch.compile(opt.step)", compiled


def peer_variants(spec, params, grads, device):
    if spec.heavyball is not None:

        def heavyball_step():
            optimizer = spec.heavyball(leaves_with_grads(params, grads))
            optimizer.consume_grad = False  # heavyball drops .grad after a step by default
            return optimizer.step, first_call_s(optimizer.step, device)

        yield "heavyball", heavyball_step
    if spec.torchopt is not None:

        def torchopt_step():
            import torchopt

            tx = spec.torchopt()
            ps = tuple(p.clone() for p in params.values())
            gs = tuple(grads.values())
            state = [tx.init(ps)]

            def step():
                updates, state[0] = tx.update(gs, state[0], params=ps, inplace=True)
                torchopt.apply_updates(ps, updates, inplace=True)

            return step, None

        yield "torchopt", torchopt_step


def fb_variants(spec, params, grads, device, variants):
    def optimizer():
        return fb.Optimizer(leaves_with_grads(params, grads), spec.alias, **spec.hyper).step, None

    def tree():
        tx = spec.fb()
        carry = {"params": dict(params), "state": tx.init(params)}

        def step():
            updates, carry["state"] = tx.update(grads, carry["state"], carry["params"])
            carry["params"] = fb.apply_updates(carry["params"], updates)

        return step, None

    def flat_eager():
        layout = fb.FlatLayout.of(params)
        fused, flat_grads = fb.fuse(spec.fb(), layout), layout.flatten(grads)
        carry = {"params": layout.flatten(params)}
        carry["state"] = fused.init(carry["params"])

        def step():
            updates, carry["state"] = fused.update(flat_grads, carry["state"], carry["params"])
            carry["params"] = fb.apply_updates(carry["params"], updates)

        return step, None

    def in_place(kernel):
        layout = fb.FlatLayout.of(params)
        flat_params, flat_grads = layout.flatten(params), layout.flatten(grads)
        state = fb.fuse(spec.fb(), layout).init(flat_params)
        step = functools.partial(fb.fuse_inplace(spec.fb(), layout, kernel=kernel), flat_grads, state, flat_params)
        return step, (first_call_s(step, device) if kernel == "compiled" else None)

    makers = {
        "fb.Optimizer": optimizer,
        "fb tree eager": tree,
        "fb flat eager": flat_eager,
        "fb flat in-place (torch)": lambda: in_place("torch"),
        "fb flat compiled": lambda: in_place("compiled"),
    }
    for variant in variants:
        if variant == "fb flat in-place (torch)" and fb.kernels.spec_of(spec.fb()) is None:
            continue  # torch has no fused kernel for it
        if variant == "fb flat compiled" and not spec.flat_compiled:
            continue
        yield variant, makers[variant]


def measure(variant, make, device, steps):
    """One row's numbers: build the variant (its compile timed), time ``steps`` steps; an error
    becomes the row's ``error`` (the run goes on)."""
    try:
        with PeakMemory(device) as mem:
            step, compile_s = make()
            times = step_times_ms(step, device, steps)
        return dict(
            variant=variant,
            ms=statistics.median(times),
            range=spread(times),
            compile_s=compile_s or "",
            peak_mib=mem.mib,
        )
    except Exception as e:  # reported in the table
        return dict(variant=variant, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    finally:
        torch._dynamo.reset()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def progress(*parts) -> None:
    """One line per measured row as it ends (a run stopped at its time limit still shows its rows)."""
    print("  " + " | ".join(str(p) for p in parts), flush=True)


def bench_config(key, names, device, steps, copy_gbs, compile_for, families, fb_variant_names, on_row=None):
    label, shapes_fn = configs(device)[key]
    all_params, all_grads = make_params(shapes_fn(), device)
    rows = []
    for name in names:
        spec = SPECS[name]
        params, grads = all_params, all_grads
        if spec.matrices_only:
            params = {k: v for k, v in all_params.items() if v.dim() == 2}
            grads = {k: all_grads[k] for k in params}
            if not params:
                continue
        numel = sum(p.numel() for p in params.values())
        makers = []
        if "torch" in families:
            makers += list(torch_variants(spec, name, key, params, grads, device, set()))
        if "fb.Optimizer" in families:
            makers += [(v, m) for v, m in fb_variants(spec, params, grads, device, ["fb.Optimizer"])]
        if "fb" in families:
            makers += list(
                fb_variants(spec, params, grads, device, [v for v in fb_variant_names if v != "fb.Optimizer"])
            )
        if "peers" in families:
            makers += list(peer_variants(spec, params, grads, device))
        if "torch" in families and f"{name}:{key}" in compile_for:  # last: its compile is the slowest
            makers += [
                m
                for m in torch_variants(spec, name, key, params, grads, device, compile_for)
                if m[0] == "torch.compile(opt.step)"
            ]
        named = f"{name} (2-D tensors: {len(params)})" if spec.matrices_only else name
        these = []
        for variant, make in makers:
            row = dict(config=label, optimizer=named, **measure(variant, make, device, steps))
            if "ms" in row and spec.traffic:
                gbs = spec.traffic * numel * 4 / (row["ms"] * 1e-3) / 1e9
                row.update(gbs=gbs, bw_share=f"{100 * gbs / copy_gbs:.0f}%")
            these.append(row)
            progress(label, named, variant, row.get("ms", row.get("error")), row.get("compile_s", ""))
            if on_row is not None:
                on_row(rows + these)
        reference = next((r for r in these if r["variant"] == "torch fused" and "ms" in r), None)
        reference = reference or next(
            (r for r in these if r["variant"] in ("torch foreach", "torch") and "ms" in r), None
        )
        for r in these:
            if "ms" in r:
                r["vs_torch"] = f"{r['ms'] / reference['ms']:.2f}x" if reference else "n/a"
                r["reference"] = reference["variant"] if reference else ""
        rows += these
    return label, len(all_params), sum(p.numel() for p in all_params.values()), rows


# --- the memory roofline ------------------------------------------------------------------------


def roofline(device, copy_gbs, steps, sizes=(1_000_000, 10_000_000, 30_000_000, 100_000_000)):
    """AdamW on one flat float32 buffer of each size: ms and the share of the time its 7 arrays
    (read p, g, m, v; write p, m, v) need at the measured copy bandwidth."""
    rows = []
    for n in sizes:
        params, grads = {"w": torch.randn(n, device=device) * 0.02}, {"w": torch.randn(n, device=device) * 1e-3}
        ideal_ms = 7 * n * 4 / (copy_gbs * 1e9) * 1e3
        makers = [
            (
                "torch fused (one flat tensor)",
                lambda p=params, g=grads: (SPECS["adamw"].torch(leaves_with_grads(p, g), fused=True).step, None),
            ),
            *fb_variants(SPECS["adamw"], params, grads, device, ["fb flat in-place (torch)", "fb flat compiled"]),
        ]
        for variant, make in makers:
            row = dict(elements=f"{n / 1e6:.0f}M", ideal_ms=ideal_ms, **measure(variant, make, device, steps))
            if "ms" in row:
                row["roofline_share"] = f"{100 * ideal_ms / row['ms']:.0f}%"
            rows.append(row)
            progress(f"{n / 1e6:.0f}M", variant, row.get("ms", row.get("error")), row.get("roofline_share", ""))
        del makers
    torch_fused = {r["elements"]: r["ms"] for r in rows if r["variant"].startswith("torch fused") and "ms" in r}
    for r in rows:
        if "ms" in r and r["elements"] in torch_fused:
            r["vs_torch_fused"] = f"{r['ms'] / torch_fused[r['elements']]:.2f}x"
    return rows


# --- first-compile time against tensor count ---------------------------------------------------------


def compile_scaling(device, families, counts=(20, 200, 2000), total=10_000_000):
    """Seconds of the first call (the compile) of AdamW's step for several tensor counts (the same
    total size): our compiled in-place flat update; heavyball's AdamW (it compiles its update
    functions); ``torch.compile(opt.step)`` (20 and 200 tensors: it grows with the count)."""
    warm = torch.compile(lambda x: x * 2 + 1)  # pay inductor's one-time start-up outside the timings
    warm(torch.ones(4, device=device))
    rows = []
    spec = SPECS["adamw"]
    for n in counts:
        params, grads = make_params([(total // n,)] * n, device)
        makers = []
        if "fb" in families:
            makers += list(fb_variants(spec, params, grads, device, ["fb flat compiled"]))
        if "peers" in families and spec.heavyball is not None:
            makers += list(peer_variants(spec._replace(torchopt=None), params, grads, device))
        if "torch" in families and n <= 200:
            makers += list(
                torch_variants(spec._replace(torch_kinds=()), "adamw", "x", params, grads, device, {"adamw:x"})
            )
        for variant, make in makers:
            torch._dynamo.reset()
            rows.append(dict(tensors=n, **measure(variant, make, device, steps=10)))
            progress(n, variant, rows[-1].get("compile_s", rows[-1].get("error")))
        del params, grads
    return rows


def disable_compile_caches() -> None:
    """Compile times are measured cold: no FX-graph or AOT-autograd cache hits from earlier runs."""
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


FAMILIES = (
    "torch",
    "fb.Optimizer",
    "fb",
    "peers",
)  # torch.optim, fb.Optimizer, our functional updates, heavyball/torchopt


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", default="a,b,c")
    parser.add_argument("--optimizers", default="adamw,adam,sgd,lamb")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--torch-compile",
        default="adamw:a",
        help="optimizer:config pairs for which to time torch.compile(opt.step) (slow to compile)",
    )
    parser.add_argument(
        "--chart",
        default="",
        help="also draw the chart into this PNG file (the docs draw theirs from --record's tables)",
    )
    parser.add_argument("--no-scaling", action="store_true", help="skip the compile-time scaling run")
    parser.add_argument("--only-scaling", action="store_true", help="only the compile-time scaling run")
    parser.add_argument("--roofline", action="store_true", help="also AdamW on flat buffers of 1M-100M elements")
    parser.add_argument("--only-roofline", action="store_true", help="only the roofline run")
    parser.add_argument(
        "--families", default="torch,fb.Optimizer,fb", help=f"which kinds of variants to time, of {', '.join(FAMILIES)}"
    )
    parser.add_argument("--fb-variants", default=",".join(FB_VARIANTS[1:]), help="which of our functional variants")
    parser.add_argument("--json", default="", help="also write every table as JSON to this path")
    parser.add_argument("--record", action="store_true", help="keep the tables in benchmarks/results/ for the docs")
    parser.add_argument(
        "--record-as", default="optimizer_step", help="the recorded run's name (several runs of one machine)"
    )
    args = parser.parse_args(argv)
    disable_compile_caches()
    families = args.families.split(",")
    copy_gbs = copy_bandwidth_gbs(args.device)
    print(f"# optimizer step, {machine(args.device)}; copy bandwidth {copy_gbs:.1f} GB/s\n", flush=True)
    out: dict = dict(machine=machine(args.device), copy_gbs=copy_gbs, configs={})
    recorded: list[dict] = []
    chart = {}
    columns = ["optimizer", "variant", "ms", "range", "vs_torch", "compile_s", "peak_mib", "gbs", "bw_share", "error"]
    if not (args.only_scaling or args.only_roofline):
        for key in args.configs.split(","):
            start = time.perf_counter()
            label = configs(args.device)[key][0]

            def partial(rows, label=label):
                out["configs"][label] = dict(rows=rows, partial=True)
                write_json(args.json, out)

            label, count, numel, rows = bench_config(
                key,
                args.optimizers.split(","),
                args.device,
                args.steps,
                copy_gbs,
                set(args.torch_compile.split(",")),
                families,
                args.fb_variants.split(","),
                on_row=partial,
            )
            took = time.perf_counter() - start
            print(f"## {label}: {count} tensors, {numel / 1e6:.2f}M elements ({took:.0f} s)\n", flush=True)
            print("ratios: to torch fused, else torch foreach (Adafactor), else torch's only kind (Muon)\n")
            print(f"{table(rows, columns)}\n", flush=True)
            out["configs"][label] = dict(tensors=count, elements=numel, rows=rows)
            write_json(args.json, out)
            recorded.append(
                dict(
                    title=f"{label}: {count} tensors, {numel / 1e6:.2f}M elements",
                    columns=columns,
                    rows=rows,
                    chart=dict(value="ms", label=["optimizer", "variant"], log=True),
                )
            )
            for r in rows:
                if "ms" in r:
                    chart.setdefault(f"{key}:{r['optimizer']}", {})[r["variant"]] = r["ms"]
        if args.chart and bar_chart(
            args.chart, f"optimizer step, {machine(args.device)}", chart, "median step (ms, log)"
        ):
            print(f"chart: {args.chart}\n")
    if args.roofline or args.only_roofline:
        rows = roofline(args.device, copy_gbs, args.steps)
        print(f"## AdamW on one flat buffer: the memory roofline at {copy_gbs:.0f} GB/s\n")
        print(
            table(
                rows,
                [
                    "elements",
                    "variant",
                    "ms",
                    "range",
                    "ideal_ms",
                    "roofline_share",
                    "vs_torch_fused",
                    "compile_s",
                    "error",
                ],
            )
        )
        print(flush=True)
        out["roofline"] = rows
        write_json(args.json, out)
        recorded.append(
            dict(
                title=f"AdamW on one flat buffer: the memory roofline at {copy_gbs:.0f} GB/s",
                columns=["elements", "variant", "ms", "range", "ideal_ms", "roofline_share", "vs_torch_fused"],
                rows=rows,
            )
        )
    if args.only_scaling or not (args.no_scaling or args.only_roofline):
        print("## first-call (compile) time of the AdamW step, 10M elements in all\n", flush=True)
        rows = compile_scaling(args.device, families)
        print(table(rows, ["tensors", "variant", "compile_s", "ms", "range", "error"]), flush=True)
        out["compile_scaling"] = rows
        write_json(args.json, out)
        recorded.append(
            dict(
                title="first-call (compile) time of the AdamW step, 10M elements in all",
                columns=["tensors", "variant", "compile_s", "ms", "range", "error"],
                rows=rows,
            )
        )
    if args.record:
        record(args.record_as, args.device, recorded)


if __name__ == "__main__":
    main()
