"""The newer first-order optimizers: one step of ours against the reference packages' step, in one
run, with torch's AdamW (foreach) for scale.

    python benchmarks/first_order.py                                 # CPU, every optimizer
    python benchmarks/first_order.py --optimizers schedule_free_adamw,prodigy --steps 50
    python benchmarks/first_order.py --device cuda --json out.json
    python benchmarks/first_order.py --device cuda --config many --profile fb.Optimizer   # where the time goes

Per optimizer, on the same parameters (``--config``: ``mlp``, 8 layers of 512 x 512 and their
biases, 2.1M float32 elements in 16 tensors; ``many``, 200 matrices of 50 x 100, 1M elements;
``tiny``, 16 one-element tensors: what a step costs beside its arithmetic) and gradients:

- ``reference``: the package's ``step()`` (schedulefree, prodigyopt, dadaptation, torch-adopt,
  pytorch-optimizer), with its default flags (foreach where it defaults to it: schedulefree's
  and pytorch-optimizer's do on the CPU too, torch-adopt's on a GPU only);
- ``reference for-loop`` (schedule-free, AdEMAMix, LaProp): the same package's step with
  ``foreach=False``, one tensor at a time;
- ``fb.Optimizer``: ours as a torch.optim optimizer (the update on the parameter tree, each
  operation one multi-tensor op per dtype and device, its state given up, then added into the
  parameters, with the learning rate as ``alpha`` where the chain ends in it, or written into
  them as the reference writes it: schedule-free, Prodigy, D-Adaptation);
- ``fb.Optimizer factory``: the same in torch.optim's form, ``fb.Optimizer(params, fb.prodigy,
  weight_decay=0.01)``: its hyperparameters held as tensors (for torch's schedulers), read as
  numbers each step;
- ``fuse_inplace eager``: the pure update over one flat buffer, copied back in place;
- ``fuse_inplace compiled``: the same through ``torch.compile`` (inductor writes the update into
  the buffers in place); its first call (the compile, caches off) is reported apart;
- ``out-of-place minimum`` (schedule-free AdamW and SGD): the ceiling of any pure eager step, the
  fewest multi-tensor ops that compute the new state and parameters as new tensors (Python
  numbers for every factor), then copy the parameters back: what a functional update cannot
  avoid beside the references' in-place ops;
- ``grouped minimum`` (ADOPT): the reference's own in-place operations, each one multi-tensor
  op over every tensor, and nothing else (no checks, Python numbers for every factor): the
  ceiling of any grouped eager step;
- with ``--scheduled``, ``reference, lr scheduled`` and ``fb.Optimizer, lr scheduled``: the
  same steps, each followed by a ``LambdaLR`` step that changes the learning rate (timed with
  it), as a training loop with a scheduler runs them.

The median of ``--steps`` calls after 3 untimed ones, with its range, and its ratio to the
reference's median in the same run. With ``--rounds N``, the variants take turns: each runs its
``--steps`` calls in each of N rounds, on optimizers made afresh each round (the same gradients
every step would grow Prodigy's and D-Adaptation's estimate past float32 in a few hundred
steps; a compiled variant compiles again); the time is the median of all calls, the ratio the
median of the rounds' ratios (each round's median against the reference's in that round), with
their range: on a shared machine whose speed drifts, each ratio compares times taken together.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import first_call_s, machine, record, spread, steady_malloc, step_times_ms, table, write_json  # noqa: E402

import functional_bagua as fb  # noqa: E402


def reference(module: str, name: str, **kwargs: Any) -> Callable[[list], Any]:
    """A maker of the reference optimizer ``module.name(params, **kwargs)``; it raises ImportError
    where the package is not installed (the run then times ours only)."""

    def make(params: list, **more: Any) -> Any:
        package = __import__(module, fromlist=[name])
        cls = getattr(package, name)
        if not hasattr(cls, "_cuda_graph_capture_health_check"):  # torch 2.11 renamed it; torch-adopt calls it
            check = torch.optim.Optimizer._accelerator_graph_capture_health_check
            cls = type(name, (cls,), dict(_cuda_graph_capture_health_check=check))
        with contextlib.redirect_stdout(io.StringIO()):  # some print their settings
            return cls(params, **kwargs, **more)

    return make


# name: (the reference's maker, our alias, its keyword arguments)
OPTIMIZERS: dict[str, tuple[Callable[[list], Any], Callable[..., fb.GradientTransformation], dict]] = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), fb.adamw, dict(lr=1e-3)),
    "schedule_free_adamw": (
        reference("schedulefree", "AdamWScheduleFree", lr=2.5e-3, warmup_steps=10),
        fb.schedule_free_adamw,
        dict(lr=2.5e-3, warmup_steps=10),
    ),
    "schedule_free_sgd": (
        reference("schedulefree", "SGDScheduleFree", lr=1.0, warmup_steps=10),
        fb.schedule_free_sgd,
        dict(lr=1.0, warmup_steps=10),
    ),
    "prodigy": (reference("prodigyopt", "Prodigy", weight_decay=0.01), fb.prodigy, dict(weight_decay=0.01)),
    "dadapt_adam": (reference("dadaptation", "DAdaptAdam"), fb.dadapt_adam, {}),
    "adopt": (reference("adopt", "ADOPT", lr=1e-3), fb.adopt, dict(lr=1e-3)),
    "ademamix": (reference("pytorch_optimizer", "AdEMAMix", lr=1e-3), fb.ademamix, dict(lr=1e-3)),
    "laprop": (reference("pytorch_optimizer", "LaProp", lr=4e-4), fb.laprop, dict(lr=4e-4)),
}


# whose reference package runs multi-tensor ops by default: also timed with foreach=False
FOR_LOOP_REFERENCES = ("schedule_free_adamw", "schedule_free_sgd", "ademamix", "laprop")


def shapes_of(config: str) -> list[tuple[int, ...]]:
    if config == "mlp":
        return [s for _ in range(8) for s in ((512, 512), (512,))]
    if config == "many":
        return [(50, 100)] * 200
    if config == "tiny":
        return [(1,)] * 16
    raise SystemExit(f"unknown config {config!r}: mlp, many or tiny")


def problem(config: str, device: str) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(0)
    shapes = shapes_of(config)
    params = {f"p{i}": torch.randn(s, generator=gen).to(device) for i, s in enumerate(shapes)}
    grads = {k: (torch.randn(v.shape, generator=gen) * 1e-2).to(device) for k, v in params.items()}
    return params, grads


def out_of_place_minimum(name: str, params: dict, grads: dict) -> Callable[[], object]:
    """The hand-written schedule-free step with the fewest out-of-place multi-tensor ops (module
    docstring); the factors are fixed numbers of a step past the warmup."""
    ys = [p.clone() for p in params.values()]
    zs, gs, vs = [y.clone() for y in ys], list(grads.values()), [torch.zeros_like(y) for y in ys]
    lr, c, coef, b2, eps = 2.5e-3, 0.1, -0.9 * 2.5e-3, 0.999, 1e-8

    def sgd() -> object:
        new_z = torch._foreach_add(zs, gs, alpha=-lr)
        new_y = torch._foreach_lerp(ys, zs, c)
        torch._foreach_add_(new_y, gs, alpha=coef)
        torch._foreach_copy_(ys, new_y)
        return new_z

    def adamw() -> object:
        new_v = torch._foreach_mul(vs, b2)
        torch._foreach_addcmul_(new_v, gs, gs, value=1 - b2)
        denom = torch._foreach_div(new_v, 0.5)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        normalized = torch._foreach_div(gs, denom)
        new_z = torch._foreach_add(zs, normalized, alpha=-lr)
        new_y = torch._foreach_lerp(ys, zs, c)
        torch._foreach_add_(new_y, normalized, alpha=coef)
        torch._foreach_copy_(ys, new_y)
        return new_z, new_v

    return sgd if name == "schedule_free_sgd" else adamw


def grouped_minimum(params: dict, grads: dict) -> Callable[[], object]:
    """torch-adopt's step past the first, its own operations each one multi-tensor op over
    every tensor and nothing else (no checks, Python numbers for every factor): the ceiling of
    any grouped eager ADOPT step (module docstring)."""
    ps, gs = [p.clone() for p in params.values()], list(grads.values())
    mus, nus = [torch.zeros_like(p) for p in ps], [torch.addcmul(torch.zeros_like(g), g, g) for g in gs]
    lr, b1, b2, eps, clip = 1e-3, 0.9, 0.9999, 1e-6, 2.0**0.25

    def adopt() -> object:
        denom = torch._foreach_sqrt(nus)
        torch._foreach_clamp_min_(denom, eps)
        normalized = torch._foreach_div(gs, denom)
        torch._foreach_clamp_min_(normalized, -clip)
        torch._foreach_clamp_max_(normalized, clip)
        torch._foreach_lerp_(mus, normalized, 1 - b1)
        torch._foreach_add_(ps, mus, alpha=-lr)
        torch._foreach_mul_(nus, b2)
        torch._foreach_addcmul_(nus, gs, gs, value=1 - b2)
        return ps

    return adopt


def scheduled(optimizer: Any) -> Callable[[], object]:
    """``optimizer``'s step and then a ``LambdaLR`` step, which changes its learning rate."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1 / (1 + 0.01 * t))

    def step() -> object:
        optimizer.step()
        scheduler.step()
        return None

    return step


def variants(name: str, params: dict, grads: dict, with_scheduler: bool = False) -> dict[str, Callable[[], object]]:
    """Each variant's step (module docstring), made on its own copy of the parameters."""
    make_reference, alias, kwargs = OPTIMIZERS[name]

    def make_tx() -> fb.GradientTransformation:
        return alias(**kwargs)

    out: dict[str, Callable[[], object]] = {}
    references = {"reference": make_reference}
    if name in FOR_LOOP_REFERENCES:
        references["reference for-loop"] = functools.partial(make_reference, foreach=False)
    if with_scheduler:
        references["reference, lr scheduled"] = make_reference
    try:
        for variant, make in references.items():
            tensors = [torch.nn.Parameter(p.clone()) for p in params.values()]
            for t, g in zip(tensors, grads.values()):
                t.grad = g.clone()
            ref = make(tensors)
            if hasattr(ref, "train"):
                ref.train()
            out[variant] = scheduled(ref) if variant.endswith("scheduled") else ref.step
    except ImportError as missing:
        print(f"# {name}: reference not installed ({missing.name}); ours only", file=sys.stderr)
    forms = ("fb.Optimizer", "fb.Optimizer factory", "fb.Optimizer, lr scheduled")
    for form in forms if with_scheduler else forms[:2]:
        ours = [torch.nn.Parameter(p.clone()) for p in params.values()]
        for t, g in zip(ours, grads.values()):
            t.grad = g.clone()
        opt = fb.Optimizer(ours, alias, **kwargs) if form == "fb.Optimizer factory" else fb.Optimizer(ours, make_tx())
        out[form] = scheduled(opt) if form.endswith("scheduled") else opt.step
    layout = fb.FlatLayout.of(params)
    for kernel in ("eager", "compiled"):
        flat, flat_grads = layout.flatten({k: v.clone() for k, v in params.items()}), layout.flatten(grads)
        step_ = fb.fuse_inplace(make_tx(), layout, kernel=kernel)
        state = step_.init(flat)
        out[f"fuse_inplace {kernel}"] = (lambda s_, st, fl, fg: lambda: s_(fg, st, fl))(step_, state, flat, flat_grads)
    if name.startswith("schedule_free"):
        out["out-of-place minimum"] = out_of_place_minimum(name, params, grads)
    if name == "adopt":
        out["grouped minimum"] = grouped_minimum(params, grads)
    return out


def top_operators(step: Callable[[], object], device: str, rows: int = 15) -> str:
    """torch.profiler's table of the operators of 5 calls of ``step``, by their own time on the
    device (CUDA) or the CPU: where a step's time goes, and how many kernels it launches."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows)


def ratio_of_rounds(ours: list[float], reference: list[float]) -> str:
    """The median of the rounds' ratios ``ours[r] / reference[r]``, with their range where there
    are several rounds."""
    ratios = sorted(a / b for a, b in zip(ours, reference))
    median = statistics.median(ratios)
    return f"{median:.2f}" if len(ratios) == 1 else f"{median:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default="mlp", help="mlp, many or tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--rounds", type=int, default=1, help="the variants in turn, this many rounds (module docstring)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--skip", default="", help="comma-separated variants not to run, e.g. 'fuse_inplace compiled'")
    parser.add_argument("--scheduled", action="store_true", help="also time the steps with an lr scheduler")
    parser.add_argument("--json", default="")
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    parser.add_argument(
        "--profile",
        default="",
        help="comma-separated variants (e.g. 'fb.Optimizer') whose step is also profiled: its top operators by self time",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False  # the first call compiles from scratch
    torch._functorch.config.enable_autograd_cache = False
    allocator = steady_malloc() if args.device == "cpu" else ""
    params, grads = problem(args.config, args.device)
    skipped = {s.strip() for s in args.skip.split(",") if s.strip()}
    rows = []
    for name in args.optimizers.split(","):
        steps = {k: v for k, v in variants(name, params, grads, args.scheduled).items() if k not in skipped}
        firsts = {v: first_call_s(step, args.device) for v, step in steps.items() if "compiled" in v}
        times: dict[str, list[float]] = {variant: [] for variant in steps}
        per_round: dict[str, list[float]] = {variant: [] for variant in steps}
        for r in range(args.rounds):  # the variants in turn, each round on fresh optimizers
            if r > 0:
                steps = {k: v for k, v in variants(name, params, grads, args.scheduled).items() if k not in skipped}
            for variant, step in steps.items():
                round_times = step_times_ms(step, args.device, args.steps)
                times[variant] += round_times
                per_round[variant].append(statistics.median(round_times))
        medians = {}
        for variant, step in steps.items():
            medians[variant] = statistics.median(times[variant])
            if variant in args.profile.split(","):
                print(f"## {name}, {variant}: the operators of 5 steps\n{top_operators(step, args.device)}", flush=True)
            row = {
                "optimizer": name,
                "variant": variant,
                "ms (range)": f"{medians[variant]:.3g} ({spread(times[variant])})",
                "ms": medians[variant],
            }
            if variant in firsts:
                row["first call s"] = round(firsts[variant], 1)
            rows.append(row)
        if "reference" in per_round:
            for row in rows:
                if row["optimizer"] == name:
                    row["x reference"] = ratio_of_rounds(per_round[row["variant"]], per_round["reference"])
        print(
            table(
                [r for r in rows if r["optimizer"] == name],
                ["optimizer", "variant", "ms (range)", "x reference", "first call s"],
            ),
            flush=True,
        )
    print(
        f"\n{machine(args.device)}; config {args.config} ({sum(p.numel() for p in params.values()) / 1e6:.2f}M "
        f"float32 elements in {len(params)} tensors); {args.steps} steps x {args.rounds} rounds; {allocator}"
    )
    print(table(rows, ["optimizer", "variant", "ms (range)", "x reference", "first call s"]))
    write_json(args.json, {"machine": machine(args.device), "config": args.config, "rows": rows})
    if args.record:
        elements = sum(p.numel() for p in params.values()) / 1e6
        title = (
            f"config {args.config}: {elements:.2f}M float32 elements in {len(params)} tensors, "
            f"{args.steps} steps x {args.rounds} rounds"
        )
        columns = ["optimizer", "variant", "ms (range)", "x reference", "first call s"]
        chart = dict(value="ms", label=["optimizer", "variant"], log=True)
        record(f"first_order-{args.config}", args.device, [dict(title=title, columns=columns, rows=rows, chart=chart)])


if __name__ == "__main__":
    main()
