"""Optimizer state in bfloat16 and 8 bits (``fb.low_precision_state``) against float32 state:
the bytes the state takes, the step time, and the loss of the language model after a fixed
number of steps, with torchao's and bitsandbytes' 8-bit AdamW (optional peers) in the same run.

    python benchmarks/low_precision.py                    # CPU: memory and step time, then the LM
    python benchmarks/low_precision.py --device cuda --skip-lm

**Memory**: the bytes a fresh optimizer's first step allocates and keeps (it makes the state;
the parameters are updated in place), measured with the allocator (CUDA:
``torch.cuda.memory_allocated``; CPU: the allocations and frees the CPU allocator reports to
torch's profiler), beside the bytes the state's tensors count, per parameter, and on CUDA the
most the step held at once beyond what was there before it (the decoded state and temporaries).

**Step time**: ``fb.Optimizer.step`` (eager; its codecs by compiled kernels, the default, and
op by op, ``compile_codecs=False``) and the pure update over flat buffers (``fb.fuse``: one
buffer per dtype, 8 bits coded per block of it) under ``torch.compile`` (inductor), each against
float32 state (AdamW) on the same path (the eager ones against ``fb.Optimizer``'s), medians of
``--steps`` calls with their range; the first call's seconds where it compiles (the eager
step's: its codecs' kernels, on an inductor cache that earlier compiles may have filled).

**Training**: the language model of ``second_order_lm.py``
(same data, weights and batches) for ``--lm-steps`` steps with each state; the smoothed final
training loss and the held-out loss, and their ratio to float32 state's.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from typing import Any, Callable, Optional

import optree
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import first_call_s, machine, record, spread, step_times_ms, table  # noqa: E402

import functional_bagua as fb  # noqa: E402

CONFIGS = {  # name: (description, shapes)
    "many": ("200 matrices of 64 x 128, 1.64M values", [(64, 128)] * 200),
    "large": ("8 matrices of 1024 x 1024 and 8 of 1024, 8.40M values", [(1024, 1024)] * 8 + [(1024,)] * 8),
}
STATES = {  # name: the transform (compile_codecs: low_precision_state's option)
    "float32": lambda compile_codecs=True: fb.adamw(1e-3, weight_decay=0.01),
    "bf16": lambda compile_codecs=True: fb.low_precision_state(
        fb.adamw(1e-3, weight_decay=0.01), "bf16", compile_codecs=compile_codecs
    ),
    "8bit": lambda compile_codecs=True: fb.low_precision_state(
        fb.adamw(1e-3, weight_decay=0.01), "8bit", compile_codecs=compile_codecs
    ),
    "bf16+8bit": lambda compile_codecs=True: fb.low_precision_state(
        fb.adamw(1e-3, weight_decay=0.01), "bf16+8bit", compile_codecs=compile_codecs
    ),
}


def torchao_adamw8bit(params: Any) -> Any:
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=1e-3, weight_decay=0.01)


def bitsandbytes_adamw8bit(params: Any) -> Any:
    from bitsandbytes.optim import AdamW8bit

    return AdamW8bit(params, lr=1e-3, weight_decay=0.01)  # tensors under 4096 values in float32, as ours


PEERS = {  # name: (the optimizer's factory, how its step runs)
    "torchao AdamW8bit": (torchao_adamw8bit, "its step (torch.compile per tensor)"),
    "bitsandbytes AdamW8bit": (bitsandbytes_adamw8bit, "its step (its CPU or CUDA kernels)"),
}


def allocated_during(fn: Callable[[], object], device: str) -> tuple[int, Optional[int]]:
    """The bytes the allocator handed out during ``fn()`` and did not get back, and (CUDA only,
    else ``None``) the most it held at once beyond what it held before: CUDA's
    ``memory_allocated`` and ``max_memory_allocated``; on the CPU, the allocations and frees the
    CPU allocator reports to torch's profiler."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.events()), None


def held_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (a tensor subclass, such as torchao's 8-bit state,
    counted by the tensors it holds)."""

    def nbytes(t: torch.Tensor) -> int:
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, name)) for name in names)
        return t.numel() * t.element_size()

    return sum(nbytes(t) for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor))


def problem(config: str, device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in CONFIGS[config][1]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-2
    return params


def memory_row(name: str, make_optimizer: Callable[[list], Any], config: str, device: str) -> dict:
    """The state's bytes per parameter: allocated by a fresh optimizer's first step (which makes
    the state; the parameters are updated in place), and counted from its tensors."""
    params = problem(config, device)
    opt = make_optimizer(params)
    measured, peak = allocated_during(opt.step, device)
    n = sum(p.numel() for p in params)
    groups = getattr(opt, "_groups", None)
    counted = held_bytes([g.state for g in groups]) if groups is not None else held_bytes(list(opt.state.values()))
    return {
        "state": name,
        "bytes/param allocated": f"{measured / n:.3f}",
        "bytes/param counted": f"{counted / n:.3f}",
        "peak during the step": "-" if peak is None else f"{peak / n:.2f}",
    }


def timing_rows(config: str, device: str, steps: int) -> list[dict]:
    """fb.Optimizer's step per state, and the compiled pure update, each with its ratio to
    float32 state's on the same path."""
    rows = []
    base: dict = {}
    for name, make in STATES.items():
        params = problem(config, device)
        opt = fb.Optimizer(params, make())
        eager_first = first_call_s(opt.step, device)  # with the codecs' kernels compiled in it
        times = step_times_ms(opt.step, device, steps)
        paths = [("fb.Optimizer (eager)", times, None if name == "float32" else eager_first)]
        if name != "float32":
            params = problem(config, device)
            opt = fb.Optimizer(params, make(compile_codecs=False))
            paths.append(("fb.Optimizer (eager), codecs op by op", step_times_ms(opt.step, device, steps), None))
        tree = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
        layout = fb.FlatLayout.of(tree)
        flat, flat_grads = layout.flatten(tree), layout.flatten({f"p{i}": p.grad for i, p in enumerate(params)})
        tx = fb.fuse(make(), layout)
        holder = [tx.init(flat)]
        update = torch.compile(tx.update)

        def compiled_step(update=update, holder=holder, grads=flat_grads, flat=flat) -> None:
            _, holder[0] = update(grads, holder[0], flat)

        first = first_call_s(compiled_step, device)
        paths.append(("flat buffers, compiled", step_times_ms(compiled_step, device, steps), first))
        for path, ts, first_s in paths:
            median = statistics.median(ts)
            base.setdefault(path, median)
            rows.append(
                {
                    "state": name,
                    "path": path,
                    "ms (range)": f"{median:.3g} ({spread(ts)})",
                    "ms": median,
                    "x float32": f"{median / base[path.split(', codecs')[0]]:.2f}",
                    "first call s": "" if first_s is None else f"{first_s:.1f}",
                }
            )
    for name, (make, how) in PEERS.items():
        try:
            params = problem(config, device)
            opt = make(params)
        except ImportError:
            print(f"# {name.split()[0]} not installed: its AdamW8bit left out", file=sys.stderr)
            continue
        ts = step_times_ms(opt.step, device, steps)
        median = statistics.median(ts)
        rows.append(
            {
                "state": name,
                "path": how,
                "ms (range)": f"{median:.3g} ({spread(ts)})",
                "ms": median,
                "x float32": f"{median / base['fb.Optimizer (eager)']:.2f}",
                "first call s": "",
            }
        )
    return rows


def lm_rows(args: argparse.Namespace) -> list[dict]:
    from second_order_lm import data_for, train

    lm_args = argparse.Namespace(
        device=args.device, steps=args.lm_steps, vocab=256, width=args.lm_width, layers=2, batch=16, seq=32,
        target=0.0, threads=args.threads,
    )  # fmt: skip
    data, _ = data_for(lm_args, extra_batches=8)
    data, held_out = data[: lm_args.steps], data[lm_args.steps :]
    runs: dict[str, dict] = {name: dict(make_tx=make) for name, make in STATES.items()}
    for name, (make, _) in PEERS.items():
        try:
            make([torch.nn.Parameter(torch.zeros(1, device=args.device))])
        except ImportError:
            print(f"# {name.split()[0]} not installed: its AdamW8bit left out", file=sys.stderr)
            continue
        runs[name] = dict(make_optimizer=make)
    results = [train(name, args=lm_args, data=data, held_out=held_out, **how) for name, how in runs.items()]
    base = results[0]
    return [
        {
            "state": r["optimizer"],
            "final loss": f"{r['final_loss']:.4f}",
            "x float32": f"{r['final_loss'] / base['final_loss']:.4f}",
            "eval loss": f"{r['eval_loss']:.4f}",
            "eval x float32": f"{r['eval_loss'] / base['eval_loss']:.4f}",
            "ms/step": f"{r['ms_per_step']:.1f}",
        }
        for r in results
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", default="many,large")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lm-steps", type=int, default=400)
    parser.add_argument("--lm-width", type=int, default=128)
    parser.add_argument("--skip-lm", action="store_true")
    parser.add_argument("--record", action="store_true", help="keep the tables in benchmarks/results/ for the docs")
    args = parser.parse_args()
    recorded = []
    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False  # the first call compiles from scratch
    torch._functorch.config.enable_autograd_cache = False
    print(machine(args.device))
    for config in args.configs.split(","):
        print(f"\n### {config}: {CONFIGS[config][0]}, AdamW\n")
        # the step times first: the eager steps' first calls compile the codecs' kernels, which
        # the memory rows' first steps then find compiled (their allocations are the state's)
        timing = timing_rows(config, args.device, args.steps)
        timing_columns = ["state", "path", "ms (range)", "x float32", "first call s"]
        memory = [
            memory_row(name, lambda ps, m=make: fb.Optimizer(ps, m()), config, args.device)
            for name, make in STATES.items()
        ]
        for name, (make, _) in PEERS.items():
            try:
                memory.append(memory_row(name, make, config, args.device))
            except ImportError:
                pass
        columns = ["state", "bytes/param allocated", "bytes/param counted", "peak during the step"]
        print(table(memory, columns), flush=True)
        print()
        print(table(timing, timing_columns), flush=True)
        recorded += [
            dict(title=f"{CONFIGS[config][0]}, AdamW: state memory", columns=columns, rows=memory),
            dict(
                title=f"{CONFIGS[config][0]}, AdamW: step time",
                columns=timing_columns,
                rows=timing,
                chart=dict(value="ms", label=["state", "path"], log=True),
            ),
        ]
    if not args.skip_lm:
        print(f"\n### The language model, {args.lm_steps} steps\n")
        lm_columns = ["state", "final loss", "x float32", "eval loss", "eval x float32", "ms/step"]
        lm = lm_rows(args)
        print(table(lm, lm_columns))
        recorded.append(dict(title=f"The language model, {args.lm_steps} steps", columns=lm_columns, rows=lm))
    if args.record:
        record("low_precision", args.device, recorded)


if __name__ == "__main__":
    main()
