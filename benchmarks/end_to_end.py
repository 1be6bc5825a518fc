"""End to end: a language model trained for N steps, every way of running its step.

    python benchmarks/end_to_end.py [--steps 30]                        # CPU: the tiny LM
    python benchmarks/end_to_end.py --size 10m --steps 15
    python benchmarks/end_to_end.py --device cuda --size gpt2 --autocast bf16 --json e2e.json

Models: ``tiny`` and ``10m``, transformer encoders (0.65M and 10.2M parameters); ``gpt2``, a
GPT-2-small-like causal LM (vocabulary 50257, width 768, 12 heads, 12 layers unless ``--layers``,
learned positions, pre-norm blocks, the head tied to the embedding; 124M parameters at 12 layers).
From the same initial weights on the same batches:

- torch eager + fused AdamW (``loss.backward()``, ``torch.optim.AdamW(fused=True)``);
- ``torch.compile(model)`` + the same fused AdamW;
- torch's whole step captured in one CUDA graph (CUDA only): forward, backward and
  ``AdamW(fused=True, capturable=True)`` recorded with ``torch.cuda.graph`` after warm-up, as
  torch's CUDA-graph documentation shows; each step copies the batch in and replays;
- ``make_train_step`` compiled (forward, backward and AdamW in one graph) on a parameter tree and
  on flat buffers (one per dtype, or buffers of at most 16 MiB on the CPU);
- ``make_train_step`` compiled and donated on flat buffers (inductor's kernels write the update
  into the buffers);
- ``make_train_step(cuda_graph=True)`` (CUDA only: the donated step replayed as one CUDA graph,
  parameters and optimizer state as its fixed buffers; a learning-rate schedule is computed from
  the count in the state, so it changes the lr without a new capture): compiled on flat buffers
  and eager on the tree, each with a constant lr and with a warmup-cosine schedule;
- ``make_train_step`` eager on the tree, pure and donated (torch's fused kernel in place).

Prints the median step time with its range, the ratio to eager torch, the first step's time
(compile included), peak memory during the timed steps (CUDA: allocated bytes, parameters,
gradients and state included, and the allocator's reserved bytes, which hold a CUDA graph's
private pool; CPU: resident set above the start) and the final loss.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakMemory, first_call_s, machine, record, spread, step_times_ms, table, write_json  # noqa: E402
from optimizer_step import disable_compile_caches  # noqa: E402

import functional_bagua as fb  # noqa: E402

SEQ, BATCH = 32, 16
SIZES = {  # vocabulary, model width, layers
    "tiny": (1000, 128, 2),  # 0.65M parameters
    "10m": (8192, 320, 4),  # 10.2M parameters
    "gpt2": (50257, 768, 12),  # GPT-2 small, 124M parameters
}
VOCAB, D_MODEL, LAYERS = SIZES["tiny"]
AUTOCAST: dict = {}  # torch.autocast's arguments for the forward (--autocast), empty for none
LR = 1e-3


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        layer = torch.nn.TransformerEncoderLayer(
            D_MODEL, nhead=4, dim_feedforward=4 * D_MODEL, dropout=0.0, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens):
        with torch.autocast(**AUTOCAST) if AUTOCAST else contextlib.nullcontext():
            return self.head(self.encoder(self.embed(tokens))).float()


class Block(torch.nn.Module):
    """A GPT-2 block: causal self-attention and an MLP, each after a LayerNorm, each residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.Linear(width, 3 * width)
        self.attn_proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT2(torch.nn.Module):
    """GPT-2 small's architecture (module docstring); ``LAYERS`` blocks."""

    def __init__(self, positions: int = 1024, heads: int = 12):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, D_MODEL)
        self.wpe = torch.nn.Embedding(positions, D_MODEL)
        self.blocks = torch.nn.ModuleList(Block(D_MODEL, heads) for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(D_MODEL)
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        with torch.autocast(**AUTOCAST) if AUTOCAST else contextlib.nullcontext():
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x)
            return torch.nn.functional.linear(self.ln_f(x), self.wte.weight).float()  # the tied head


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_batches(n, device):
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


MODEL = TinyLM


def new_model(device):
    torch.manual_seed(0)
    return MODEL().to(device)


def torch_loop(device, compiled):
    model = new_model(device)
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(forward(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def torch_graphed_loop(device, warmup_batches):
    """The whole step (forward, backward, fused AdamW with its step counts on the GPU) captured in
    one CUDA graph with ``torch.cuda.graph``; each step copies its batch into the static inputs
    and replays."""
    model = new_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True, capturable=True)
    static_x, static_y = (t.clone() for t in warmup_batches[0])

    def eager_step():
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(static_x), static_y)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (state made, kernels chosen) off the capture
        for x, y in warmup_batches[:3]:
            static_x.copy_(x)
            static_y.copy_(y)
            eager_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = lm_loss(model(static_x), static_y)
        static_loss.backward()
        opt.step()

    def step(batch):
        static_x.copy_(batch[0])
        static_y.copy_(batch[1])
        graph.replay()
        return static_loss.detach().clone()

    return step


def cosine(count):
    """Linear warmup over 10 steps to LR, then a cosine decay to 0 over 1000: a tensor function of
    the step count, evaluated inside the compiled step."""
    count = torch.as_tensor(count, dtype=torch.float32)
    warm = LR * torch.clamp(count / 10, max=1.0)
    decayed = LR * 0.5 * (1 + torch.cos(math.pi * torch.clamp((count - 10) / 1000, 0.0, 1.0)))
    return torch.where(count < 10, warm, decayed)


def fb_loop(device, flat, compile=True, donate=False, max_buffer_mb=None, schedule=False, cuda_graph=False):
    model = new_model(device)
    tx = fb.adamw(lr=cosine if schedule else LR)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params, max_buffer_mb=max_buffer_mb) if flat else None
    if flat:
        params = layout.flatten(params)
    carry = {"params": params, "state": (fb.fuse(tx, layout) if flat else tx).init(params)}
    train_step = fb.make_train_step(
        model, lm_loss, tx, compile=compile, layout=layout, donate=donate, cuda_graph=cuda_graph
    )

    def step(batch):
        carry["params"], carry["state"], loss = train_step(carry["params"], carry["state"], batch)
        return loss

    return step


def variants(device):
    on_cuda = device.startswith("cuda")
    out = {
        "torch eager + fused AdamW": lambda batches: torch_loop(device, compiled=False),
        "torch.compile(model) + fused AdamW": lambda batches: torch_loop(device, compiled=True),
    }
    if on_cuda:
        out["torch whole step in a CUDA graph (fused AdamW, capturable)"] = lambda batches: torch_graphed_loop(
            device, batches
        )
    out["fb compiled step (tree)"] = lambda batches: fb_loop(device, flat=False)
    out["fb compiled step (flat)"] = lambda batches: fb_loop(device, flat=True)
    out["fb compiled step (flat, donated)"] = lambda batches: fb_loop(device, flat=True, donate=True)
    if on_cuda:
        out["fb compiled step (flat, CUDA graph)"] = lambda batches: fb_loop(device, flat=True, cuda_graph=True)
        out["fb compiled step (flat, CUDA graph, cosine lr)"] = lambda batches: fb_loop(
            device, flat=True, cuda_graph=True, schedule=True
        )
        out["fb eager step (tree, CUDA graph)"] = lambda batches: fb_loop(
            device, flat=False, compile=False, cuda_graph=True
        )
        out["fb eager step (tree, CUDA graph, cosine lr)"] = lambda batches: fb_loop(
            device, flat=False, compile=False, cuda_graph=True, schedule=True
        )
    else:
        out["fb compiled step (flat, buffers of 16 MiB)"] = lambda batches: fb_loop(device, flat=True, max_buffer_mb=16)
    out["fb eager step (tree)"] = lambda batches: fb_loop(device, flat=False, compile=False)
    out["fb eager step (tree, donated)"] = lambda batches: fb_loop(device, flat=False, compile=False, donate=True)
    return out


def run(name, make, batches, device, steps):
    """One row: build, first step (compile) timed, ``steps`` timed steps; an error becomes the
    row's ``error`` and the run goes on."""
    torch._dynamo.reset()
    try:
        step = make(batches)
        it = iter(batches)
        first_s = first_call_s(lambda: step(next(it)), device)
        losses: list = []
        with PeakMemory(device) as mem:
            times = step_times_ms(lambda: losses.append(step(next(it))), device, steps, warmup=2)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
        # a CUDA graph's activations live in its private pool: reserved, not allocated, between replays
        reserved = torch.cuda.max_memory_reserved() / 2**30 if device.startswith("cuda") else None
        row = dict(variant=name, ms=statistics.median(times), range=spread(times), first_step_s=first_s)
        row.update(
            final_loss=float(losses[-1]), peak_gib=peak if peak is not None else "", peak_above_start_mib=mem.mib
        )
        row.update(reserved_gib=reserved if reserved is not None else "")
        return row
    except Exception as e:  # reported in the table
        return dict(variant=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    finally:
        if device.startswith("cuda"):
            gc.collect()  # a failed row's tensors (and graphs) before the next row's peak
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the language model's size")
    parser.add_argument("--layers", type=int, default=0, help="blocks of the model (default: its size's)")
    parser.add_argument("--batch", type=int, default=0, help="sequences per batch (default 16; 8 for gpt2)")
    parser.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 32; 1024 for gpt2)")
    parser.add_argument("--autocast", choices=["none", "bf16", "fp16"], default="none", help="the forward's autocast")
    parser.add_argument("--only", default="", help="comma-separated substrings: run the variants whose name has one")
    parser.add_argument("--json", default="", help="also write the table as JSON to this path")
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    args = parser.parse_args(argv)
    global VOCAB, D_MODEL, LAYERS, MODEL, BATCH, SEQ  # the model and loss read them  # noqa: PLW0603
    VOCAB, D_MODEL, LAYERS = SIZES[args.size]
    LAYERS = args.layers or LAYERS
    MODEL = GPT2 if args.size == "gpt2" else TinyLM
    BATCH = args.batch or (8 if args.size == "gpt2" else BATCH)
    SEQ = args.seq or (1024 if args.size == "gpt2" else SEQ)
    if args.autocast != "none":
        AUTOCAST.update(
            device_type=torch.device(args.device).type,
            dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[args.autocast]),
        )
    disable_compile_caches()
    batches = make_batches(args.steps + 6, args.device)
    n_params = sum(p.numel() for p in new_model("cpu").parameters())
    title = (
        f"# end to end: {args.size} LM, {LAYERS} layers ({n_params / 1e6:.1f}M params, batch {BATCH} x {SEQ}, "
        f"autocast {args.autocast}), {machine(args.device)}\n"
    )
    print(title, flush=True)
    rows = []
    for name, make in variants(args.device).items():
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        rows.append(run(name, make, batches, args.device, args.steps))
        print(f"  {name}: {rows[-1].get('ms', rows[-1].get('error'))}", flush=True)
        write_json(args.json, dict(title=title.strip("# \n"), rows=rows))
    base = rows[0].get("ms") if rows else None
    for r in rows:
        if "ms" in r and base:
            r["vs_torch_eager"] = f"{r['ms'] / base:.2f}x"
    write_json(args.json, dict(title=title.strip("# \n"), rows=rows))
    columns = [
        "variant",
        "ms",
        "range",
        "vs_torch_eager",
        "first_step_s",
        "peak_gib",
        "reserved_gib",
        "peak_above_start_mib",
        "final_loss",
        "error",
    ]
    print()
    print(table(rows, columns))
    if args.record:
        chart = dict(value="ms", label=["variant"], log=False)
        tables = [dict(title=title.strip("# \n"), columns=columns, rows=rows, chart=chart)]
        record(f"end_to_end-{args.size}", args.device, tables)


if __name__ == "__main__":
    main()
