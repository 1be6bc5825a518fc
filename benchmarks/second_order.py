"""Second-order optimizers: one step of SOAP and of Shampoo, ours against the references
(pytorch-optimizer) and heavyball's SOAP (optional peers), with torch's AdamW for scale, in one run.

    python benchmarks/second_order.py                          # CPU, configs a and g
    python benchmarks/second_order.py --device cuda --configs a,d --steps 30
    python benchmarks/second_order.py --optimizers shampoo
    python benchmarks/second_order.py --device cuda --skip heavyball   # not the peer (its compile autotunes)

Shampoo: inverse roots every 10 steps, blocks of 1024, Adam grafting, ours in float32 (its
``matrix_dtype``) and in float64 (its default); pytorch-optimizer's ``Shampoo`` (no blocking, no
grafting, roots every 10 steps from an SVD) for scale; heavyball has no plain Shampoo. Ours also
with ``root_method="newton"`` (the coupled Newton iteration, ``eigh`` where it does not converge).
PSGD-Kron (``--optimizers kron``): ours, kron-torch's ``Kron`` (the reference) and heavyball's
``PSGDKron``, each with its defaults and lr 3e-4 (the preconditioner updates every step for the
first 500 steps in all three).

Configs: (a) 200 matrices of 50 x 100 (5k elements each), (g) a GPT-2 of hidden 256, 4 layers,
a vocabulary of 2048 and 256 positions (GPT-2 small's shapes scaled down for the CPU: with the
reference's bound of 10000 the embedding's 2048 x 2048 statistic is decomposed too), (d) GPT-2
small's shapes (a GPU's). The
same hyperparameters everywhere (the reference's defaults: eigenbases refreshed every 10 steps,
no dimension above 10000 preconditioned, nothing merged, vectors not preconditioned); heavyball
with its own compiled step (its default), its preconditioner schedule off and float32 storage.

Every variant cycles through the same three gradient draws (statistics of full rank after a
few steps, as in training: with one gradient repeated, a 100 x 100 statistic of a 50 x 100
matrix would keep rank 50). Per variant: the first step (initialisation and, where compiled, compilation: inductor's cache
is a fresh directory per run) in seconds, then
the median of ``--steps`` steps with its range and the mean (which counts the eigenbasis refresh
every 10th step), and the ratios of the median to torch's AdamW (foreach) and to heavyball's SOAP.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))  # first compiles cold

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, record, spread, steady_malloc, sync, table  # noqa: E402
from optimizer_step import gpt2_small_shapes  # noqa: E402

import functional_bagua as fb  # noqa: E402

HYPER = dict(lr=3e-3, betas=(0.95, 0.95), eps=1e-8, weight_decay=0.01, precondition_frequency=10)
CONFIGS = {
    "a": ("(a) 200 x (50, 100)", lambda: [(50, 100)] * 200),
    "g": (
        "(g) GPT-2 shapes, hidden 256, 4 layers, vocabulary 2048, 256 positions",
        lambda: gpt2_small_shapes(hidden=256, layers=4, vocab=2048, positions=256),
    ),
    "d": ("(d) GPT-2 small shapes", gpt2_small_shapes),
}


DRAWS = 3  # the gradients each variant cycles through: statistics reach full rank, as in training


def gradient_draws(params: list, once: bool = False) -> Any:
    """``DRAWS`` random gradients for ``params`` (lists of tensors), cycled endlessly (``once``: the list)."""
    draws = [[torch.randn_like(p) for p in params] for _ in range(DRAWS)]
    return draws if once else itertools.cycle(draws)


def make_params(shapes: list, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).div_(10).to(device) for s in shapes]


def stepper_torch(params: list, device: str) -> Callable[[], None]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    draws = gradient_draws(ps)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True)

    def step() -> None:
        for p, g in zip(ps, next(draws)):
            p.grad = g
        opt.step()

    return step


def stepper_pure(make_tx: Callable[[], fb.GradientTransformation]) -> Callable:
    """The pure tree update (``tx.update`` and ``apply_updates``) of the transform ``make_tx()``."""

    def make(params: list, device: str) -> Callable[[], None]:
        tx = make_tx()
        holder = {"p": [p.clone() for p in params]}
        holder["s"] = tx.init(holder["p"])
        draws = gradient_draws(params)

        def step() -> None:
            u, holder["s"] = tx.update(next(draws), holder["s"], holder["p"])
            holder["p"] = fb.apply_updates(holder["p"], u)

        return step

    return make


def stepper_compiled_fused(make_tx: Callable[[], fb.GradientTransformation]) -> Callable:
    """``fb.fuse(make_tx(), layout)``'s update and ``apply_updates`` on flat buffers, in one
    ``torch.compile(fullgraph=True)`` (the first step compiles)."""

    def make(params: list, device: str) -> Callable[[], None]:
        named = {f"p{i}": p.clone() for i, p in enumerate(params)}
        layout = fb.FlatLayout.of(named)
        tx = fb.fuse(make_tx(), layout)
        holder = {"p": layout.flatten(named)}
        holder["s"] = tx.init(holder["p"])
        draws = itertools.cycle(
            [layout.flatten(dict(zip(named, g))) for g in gradient_draws(list(named.values()), once=True)]
        )

        def update(p: dict, s: object, g: dict) -> tuple:
            u, s = tx.update(g, s, p)
            return fb.apply_updates(p, u), s

        compiled = torch.compile(update, fullgraph=True)

        def step() -> None:
            holder["p"], holder["s"] = compiled(holder["p"], holder["s"], next(draws))

        return step

    return make


def stepper_fb_optimizer(params: list, device: str) -> Callable[[], None]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    draws = gradient_draws(ps)
    opt = fb.Optimizer(ps, fb.soap(**HYPER))

    def step() -> None:
        for p, g in zip(ps, next(draws)):
            p.grad = g
        opt.step()

    return step


def stepper_reference(params: list, device: str) -> Optional[Callable[[], None]]:
    try:
        from pytorch_optimizer import SOAP
    except ImportError:
        return None
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    draws = gradient_draws(ps)
    opt = SOAP(ps, **HYPER)

    def step() -> None:
        for p, g in zip(ps, next(draws)):
            p.grad = g
        opt.step()

    return step


def stepper_heavyball(params: list, device: str) -> Optional[Callable[[], None]]:
    try:
        import heavyball
    except ImportError:
        return None
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    draws = gradient_draws(ps)
    opt = heavyball.SOAP(
        ps,
        lr=HYPER["lr"],
        betas=HYPER["betas"],
        shampoo_beta=HYPER["betas"][1],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        precondition_frequency=HYPER["precondition_frequency"],
        max_precond_dim=10000,
        merge_dims=False,
        precondition_1d=False,
        use_precond_schedule=False,
    )

    def step() -> None:
        for p, g in zip(ps, next(draws)):
            p.grad = g
        opt.step()

    return step


SHAMPOO = dict(lr=1e-3, betas=(0.9, 0.999), precondition_frequency=10, grafting="adam")


def stepper_reference_shampoo(params: list, device: str) -> Optional[Callable[[], None]]:
    try:
        from pytorch_optimizer import Shampoo
    except ImportError:
        return None
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    draws = gradient_draws(ps)
    opt = Shampoo(ps, lr=1e-3, preconditioning_compute_steps=10)

    def step() -> None:
        for p, g in zip(ps, next(draws)):
            p.grad = g.clone()  # its step transposes the gradient in place
        opt.step()

    return step


SHAMPOO_VARIANTS = {
    "torch AdamW foreach": stepper_torch,
    "fb.shampoo (float32 roots)": stepper_pure(lambda: fb.shampoo(**SHAMPOO, matrix_dtype=torch.float32)),
    "fb.shampoo (float64 roots)": stepper_pure(lambda: fb.shampoo(**SHAMPOO, matrix_dtype=torch.float64)),
    "fb.shampoo compiled, fused (float32 roots)": stepper_compiled_fused(
        lambda: fb.shampoo(**SHAMPOO, matrix_dtype=torch.float32)
    ),
    "fb.shampoo (float32 Newton roots)": stepper_pure(
        lambda: fb.shampoo(**SHAMPOO, matrix_dtype=torch.float32, root_method="newton")
    ),
    "fb.shampoo compiled, fused (float32 Newton roots)": stepper_compiled_fused(
        lambda: fb.shampoo(**SHAMPOO, matrix_dtype=torch.float32, root_method="newton")
    ),
    "pytorch-optimizer Shampoo (reference)": stepper_reference_shampoo,
}


def stepper_torch_optimizer(make_optimizer: Callable) -> Callable:
    def make(params: list, device: str) -> Optional[Callable[[], None]]:
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        draws = gradient_draws(ps)
        try:
            opt = make_optimizer(ps)
        except ImportError:
            return None

        def step() -> None:
            for p, g in zip(ps, next(draws)):
                p.grad = g
            with contextlib.redirect_stdout(io.StringIO()):  # kron-torch prints its memory use
                opt.step()

        return step

    return make


def _kron_torch(ps: list) -> torch.optim.Optimizer:
    import kron_torch

    return kron_torch.Kron(ps, lr=3e-4)


def _heavyball_kron(ps: list) -> torch.optim.Optimizer:
    import heavyball

    return heavyball.PSGDKron(ps, lr=3e-4)


KRON_VARIANTS = {
    "torch AdamW foreach": stepper_torch,
    "fb.psgd_kron (pure update)": stepper_pure(lambda: fb.psgd_kron(lr=3e-4)),
    "fb.psgd_kron compiled, fused": stepper_compiled_fused(lambda: fb.psgd_kron(lr=3e-4)),
    "kron-torch Kron (reference, compiled)": stepper_torch_optimizer(_kron_torch),
    "heavyball PSGDKron (compiled)": stepper_torch_optimizer(_heavyball_kron),
}

VARIANTS = {
    "torch AdamW foreach": stepper_torch,
    "fb.soap (pure update)": stepper_pure(lambda: fb.soap(**HYPER)),
    "fb.Optimizer(fb.soap)": stepper_fb_optimizer,
    "fb.soap compiled, fused": stepper_compiled_fused(lambda: fb.soap(**HYPER)),
    "pytorch-optimizer SOAP (reference)": stepper_reference,
    "heavyball SOAP (compiled)": stepper_heavyball,
}


def measure(make: Callable, params: list, device: str, steps: int) -> Optional[dict]:
    step = make(params, device)
    if step is None:
        return None
    start = time.perf_counter()
    step()
    sync(device)
    first_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return dict(first_s=first_s, ms=statistics.median(times), range=spread(times), mean_ms=statistics.mean(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", default="a,g")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizers", default="soap", help="soap, shampoo, kron, or several: soap,shampoo")
    parser.add_argument("--skip", default="", help="comma-separated parts of variant names not to run, e.g. heavyball")
    parser.add_argument("--record", action="store_true", help="keep the tables in benchmarks/results/ for the docs")
    args = parser.parse_args()
    recorded = []
    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False  # first steps compile from scratch, ours and heavyball's
    torch._functorch.config.enable_autograd_cache = False
    print(f"{machine(args.device)}; {steady_malloc()}")
    for key, optimizer in [(c, o) for o in args.optimizers.split(",") for c in args.configs.split(",")]:
        title, shapes = CONFIGS[key]
        params = make_params(shapes(), args.device)
        rows = []
        families = {"soap": VARIANTS, "shampoo": SHAMPOO_VARIANTS, "kron": KRON_VARIANTS}
        for name, make in families[optimizer].items():
            if any(part and part in name for part in args.skip.split(",")):
                continue
            result = measure(make, params, args.device, args.steps)
            if result is not None:
                rows.append(dict(variant=name, **result))
                # each row as it ends: a run stopped at a time limit keeps what it measured
                print(f"  {name}: first step {result['first_s']:.3g} s, median {result['ms']:.3g} ms", flush=True)
        adamw = next(r["ms"] for r in rows if r["variant"].startswith("torch AdamW"))
        heavy = next((r["ms"] for r in rows if r["variant"].startswith("heavyball")), None)
        heavy_first = next((r["first_s"] for r in rows if r["variant"].startswith("heavyball")), None)
        for r in rows:
            r["x AdamW"] = r["ms"] / adamw
            if heavy is not None and heavy_first is not None:
                r["x heavyball"] = r["ms"] / heavy
                r["first x heavyball"] = r["first_s"] / heavy_first
        elements = sum(p.numel() for p in params)
        print(
            f"\n### {optimizer}, {title}: {len(params)} tensors, {elements / 1e6:.2f}M elements, {args.steps} steps\n"
        )
        columns = ["variant", "first_s", "ms", "range", "mean_ms", "x AdamW", "x heavyball", "first x heavyball"]
        print(table(rows, columns))
        title = f"{optimizer}, {title}: {len(params)} tensors, {elements / 1e6:.2f}M elements, {args.steps} steps"
        recorded.append(
            dict(title=title, columns=columns, rows=rows, chart=dict(value="ms", label=["variant"], log=True))
        )
    if args.record:
        record("second_order", args.device, recorded)


if __name__ == "__main__":
    main()
