"""Bagua's fused optimizer (functional_bagua.compat.fuse_optimizer): ``fuse_step`` vs ``step``.

    python benchmarks/fused_optimizer.py                      # CPU: all configs and the training loops
    python benchmarks/fused_optimizer.py --configs mlp --no-train --steps 10
    python benchmarks/fused_optimizer.py --device cuda --configs bert --bert-train   # Bagua's headline case

Optimizer step alone, for AdamW, Adam, SGD momentum, SGD, Adadelta and a BertAdam-style optimizer
(tests/custom_optimizers.py; with its per-tensor clip, which fuse_step must leave unfused, and
without it), each with torch's for-loop and foreach implementations, plain ``step()`` against
``fuse_step()``, and torch's ``fused=True`` step where it exists (plus ``torch.compile(step)``
for AdamW foreach on the small model). Configs: ``mlp``, 200 tensors (100 x Linear(64, 64));
``bert``, BERT-base's 199 parameter shapes at full size (hidden 768, vocab 30522, 109M elements).
Two gradient regimes: ``in place`` (gradients stay where the last step left them, as with
``zero_grad(set_to_none=False)``) and ``fresh`` (new gradient tensors before every step, as
after ``zero_grad(set_to_none=True)``; fuse_step then copies them into its flat buffer, inside
the timing).

On the 200-tensor model each row also times ``floor``: the least any fused step can cost, the
optimizer's own ``step`` on one flat parameter with no checks at all, after (fresh gradients) one
``_foreach_copy_`` of the 200 gradients into its flat gradient; ``ceiling`` = ``step / floor`` is
the best speedup fusion could reach there.

Then whole training steps (zero_grad, forward, backward, step) on a 100-layer MLP and a
6-layer transformer encoder with ``zero_grad()``'s default ``set_to_none=True``; with
``--bert-train`` also on a BERT-base-sized encoder (12 layers, width 768, 12 heads, a 30522-word
embedding and head; 8 sequences of 128 tokens), Bagua's headline case for its fused optimizer.
``--device cuda`` runs everything on the GPU (each timed call synchronized).

glibc's malloc is pinned first (``common.steady_malloc``; ``--default-malloc`` to skip): the
for-loop implementations allocate parameter-sized temporaries, and with glibc's moving mmap
threshold whether those page-fault depends on allocation history, which made identical BERT-size
steps differ by up to 2x between rows.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from common import machine, record, steady_malloc, table  # noqa: E402
from custom_optimizers import BertAdam  # noqa: E402
from optimizer_step import bert_base_shapes  # noqa: E402

from functional_bagua.compat import fuse_optimizer  # noqa: E402
from functional_bagua.flat import split_like  # noqa: E402

OPTIMIZERS = {
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw),
    "Adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw),
    "SGD momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw),
    "SGD": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, **kw),
    "Adadelta": lambda ps, **kw: torch.optim.Adadelta(ps, lr=1.0, **kw),
    "BertAdam (per-tensor clip)": lambda ps, **kw: BertAdam(ps, lr=1e-3, max_grad_norm=1.0),
    "BertAdam (no clip)": lambda ps, **kw: BertAdam(ps, lr=1e-3, max_grad_norm=0.0),
}
TORCH_FUSED = {"AdamW", "Adam", "SGD momentum", "SGD"}
IMPLEMENTATIONS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True)}
CONFIGS = {
    "mlp": ("200 tensors: 100 x Linear(64, 64)", lambda: [(64, 64), (64,)] * 100),
    "bert": ("BERT-base shapes: 199 tensors", lambda: bert_base_shapes(hidden=768, vocab=30522)),
}


DEVICE = "cpu"  # --device


def _sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved_ms(fns: dict, setup, steps: int, warmup: int = 3) -> dict:
    """Median milliseconds of each ``fns[k]()``, the calls taken in turns so that the machine's
    drift hits every variant alike; ``setup(k)`` runs untimed before every call of ``fns[k]``."""
    times = {k: [] for k in fns}
    for i in range(warmup + steps):
        for k, fn in fns.items():
            setup(k)
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            if i >= warmup:
                times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def make_tensors(shapes):
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) * 0.02).to(DEVICE) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(DEVICE) for s in shapes]
    return params, grads


def optimizer_on_copies(name, kwargs, params, grads):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps, OPTIMIZERS[name](ps, **kwargs)


def floor_on_copies(name, kwargs, params, grads, fresh):
    """The least a fused step of ``name`` can cost: its own step on one flat parameter, with no
    plan or checks, after (``fresh``) one ``_foreach_copy_`` of the members' gradients into the
    flat gradient, the one pass over fresh gradients that any fused design pays. Returns
    ``(members, step)``; ``members`` carry the gradients that ``time_steps`` renews."""
    flat = torch.nn.Parameter(torch.cat([p.reshape(-1) for p in params]))
    flat.grad = torch.cat([g.reshape(-1) for g in grads])
    views = split_like(flat.grad, params)
    members, optimizer = optimizer_on_copies(name, kwargs, params, grads)
    optimizer.param_groups[0]["params"] = [flat]  # same class and hyperparameters, one flat tensor

    def step():
        if fresh:
            torch._foreach_copy_(views, [p.grad for p in members])
        optimizer.step()

    return members, step


def time_steps(variants: dict, grads, fresh: bool, steps: int) -> dict:
    """``variants``: label -> (parameters, step function). With ``fresh``, each step is given
    new gradient tensors just before it (its own only: refreshing every variant's would evict
    the caches of the one about to run, as no backward pass does)."""

    def new_grads(label):
        if fresh:
            for p, g in zip(variants[label][0], grads):
                p.grad = g.clone()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the expected "stays unfused" of the per-tensor BertAdam
        return interleaved_ms({k: step for k, (_, step) in variants.items()}, new_grads, steps)


def bench_steps(key, names, steps, with_compile):
    label, shapes_fn = CONFIGS[key]
    with_floor = key == "mlp"  # on BERT shapes the large tensors are stepped alone anyway
    params, grads = make_tensors(shapes_fn())
    rows = []
    for name in names:
        for fresh in (False, True):
            regime = "fresh" if fresh else "in place"
            impls = IMPLEMENTATIONS if not name.startswith("BertAdam") else {"for-loop": {}}
            for impl, kwargs in impls.items():
                plain_params, plain = optimizer_on_copies(name, kwargs, params, grads)
                fused_params, fused = optimizer_on_copies(name, kwargs, params, grads)
                variants = {
                    "step": (plain_params, plain.step),
                    "fuse_step": (fused_params, fuse_optimizer(fused).fuse_step),
                }
                if with_floor and name != "BertAdam (per-tensor clip)":  # fusing it would change the math
                    variants["floor"] = floor_on_copies(name, kwargs, params, grads, fresh)
                ms = time_steps(variants, grads, fresh, steps)
                row = dict(
                    optimizer=name,
                    grads=regime,
                    impl=impl,
                    step_ms=ms["step"],
                    fuse_step_ms=ms["fuse_step"],
                    speedup=f"{ms['step'] / ms['fuse_step']:.2f}x",
                )
                if "floor" in ms:
                    row.update(floor_ms=ms["floor"], ceiling=f"{ms['step'] / ms['floor']:.2f}x")
                rows.append(row)
                del plain, fused, plain_params, fused_params, variants
                gc.collect()
            others = {}
            if name in TORCH_FUSED:
                ps, opt = optimizer_on_copies(name, dict(fused=True), params, grads)
                others["torch fused=True"] = (ps, opt.step)
            if with_compile and name == "AdamW" and not fresh:
                ps, opt = optimizer_on_copies(name, dict(foreach=True), params, grads)
                others["torch.compile(step), foreach"] = (ps, torch.compile(opt.step))
            for impl, ms in time_steps(others, grads, fresh, steps).items():
                rows.append(dict(optimizer=name, grads=regime, impl=impl, step_ms=ms))
            torch._dynamo.reset()
    return label, rows


class DeepMLP(torch.nn.Module):
    def __init__(self, width=64, depth=100):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def encoder():
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)


class BertBase(torch.nn.Module):
    """A BERT-base-sized encoder: a 30522-word embedding, 12 post-norm layers of width 768 (12
    heads, feed-forward 3072), a head back to the vocabulary."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30522, 768)
        layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
        self.head = torch.nn.Linear(768, 30522)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


BERT_TRAIN = {
    "BERT-base encoder (12 x d768, 30522 words), batch 8 x 128 tokens": (
        BertBase,
        lambda gen: torch.randint(0, 30522, (8, 128), generator=gen),
    ),
}

TRAIN_MODELS = {
    "100-layer MLP (200 tensors), batch 32": (DeepMLP, lambda gen: torch.randn(32, 64, generator=gen)),
    "transformer encoder, 6 x d256 (74 tensors), batch 4 x 32 tokens": (
        encoder,
        lambda gen: torch.randn(4, 32, 256, generator=gen),
    ),
}


def bench_training(steps, models=TRAIN_MODELS, names=("AdamW", "Adadelta")):
    rows = []
    for label, (make_model, make_input) in models.items():
        x = make_input(torch.Generator().manual_seed(1)).to(DEVICE)
        for name in names:
            variants = [("step", "for-loop"), ("fuse_step", "for-loop"), ("step", "foreach"), ("fuse_step", "foreach")]
            if name in TORCH_FUSED:
                variants.append(("step", "torch fused=True"))
            train_steps = {}
            for how, impl in variants:
                torch.manual_seed(0)
                model = make_model().to(DEVICE)
                opt = OPTIMIZERS[name](list(model.parameters()), **IMPLEMENTATIONS.get(impl, dict(fused=True)))
                step = fuse_optimizer(opt).fuse_step if how == "fuse_step" else opt.step

                def train_step(model=model, opt=opt, step=step, x=x):
                    opt.zero_grad()
                    model(x).float().square().mean().backward()
                    step()

                train_steps[(how, impl)] = train_step
            times = interleaved_ms(train_steps, lambda label: None, steps)
            for (how, impl), ms in times.items():
                row = dict(model=label, optimizer=name, impl=impl, call=how, ms=ms)
                if how == "fuse_step":
                    row["speedup"] = f"{times[('step', impl)] / ms:.2f}x"
                rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="mlp,bert")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=50, help="timed steps on the 200-tensor model")
    parser.add_argument("--bert-steps", type=int, default=5, help="timed steps on BERT-base shapes (slow on CPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(step) (about a minute)")
    parser.add_argument("--train-steps", type=int, default=40, help="timed training steps (forward/backward are noisy)")
    parser.add_argument("--no-train", action="store_true", help="skip the training loops")
    parser.add_argument("--bert-train", action="store_true", help="only the BERT-base training step (AdamW)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (BERT-size for-loop steps then vary up to 2x)",
    )
    parser.add_argument("--record", action="store_true", help="keep the tables in benchmarks/results/ for the docs")
    args = parser.parse_args(argv)
    global DEVICE  # noqa: PLW0603
    DEVICE = args.device
    torch._inductor.config.fx_graph_cache = False
    allocator = steady_malloc() if not args.default_malloc else "default allocator"
    print(f"# fuse_step vs step, {machine(DEVICE)}, {allocator}\n")
    names = args.optimizers.split(",")
    recorded = []
    step_columns = ["optimizer", "grads", "impl", "step_ms", "fuse_step_ms", "speedup", "floor_ms", "ceiling"]
    train_columns = ["model", "optimizer", "impl", "call", "ms", "speedup"]
    for key in args.configs.split(","):
        steps = args.bert_steps if key == "bert" else args.steps
        label, rows = bench_steps(key, names, steps, with_compile=key == "mlp" and not args.no_compile)
        print(f"## optimizer step, {label} (median of {steps})\n")
        print(table(rows, step_columns) + "\n", flush=True)
        recorded.append(dict(title=f"optimizer step, {label} (median of {steps})", columns=step_columns, rows=rows))
    if args.bert_train:
        title = f"training step on BERT-base: zero_grad(), forward, backward, step (median of {args.train_steps})"
        rows = bench_training(args.train_steps, BERT_TRAIN, ("AdamW",))
    elif not args.no_train:
        title = f"training step: zero_grad(), forward, backward, step (median of {args.train_steps})"
        rows = bench_training(args.train_steps)
    if args.bert_train or not args.no_train:
        print(f"## {title}\n")
        print(table(rows, train_columns), flush=True)
        recorded.append(dict(title=title, columns=train_columns, rows=rows))
    if args.record:
        record("fused_optimizer", DEVICE, recorded)


if __name__ == "__main__":
    main()
