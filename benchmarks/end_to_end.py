"""End to end: a small transformer language model trained for N steps.

    python benchmarks/end_to_end.py [--device cuda] [--steps 30]

Compares, from the same initial weights on the same batches: eager torch.optim AdamW
(fused=True) with ``loss.backward()``; torch.compile'd model with the same fused AdamW; and
functional_bagua's whole step (``make_train_step``): compiled (forward, backward and AdamW in
one graph) on a parameter tree and on flat buffers (one per dtype, or buffers of at most 16 MiB),
and eager on the tree, pure and donated (torch's fused kernel in place). Prints median step time, ratio to the
eager torch baseline, compile time and the final loss.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import first_call_s, machine, median_ms, table  # noqa: E402
from optimizer_step import disable_compile_caches  # noqa: E402

import functional_bagua as fb  # noqa: E402

SEQ, BATCH = 32, 16
SIZES = {  # vocabulary, model width, layers
    "tiny": (1000, 128, 2),  # 0.65M parameters
    "10m": (8192, 320, 4),  # 10.2M parameters
}
VOCAB, D_MODEL, LAYERS = SIZES["tiny"]


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
        return self.head(self.encoder(self.embed(tokens)))


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_batches(n, device):
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def new_model(device):
    torch.manual_seed(0)
    return TinyLM().to(device)


def torch_loop(device, compiled):
    model = new_model(device)
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(forward(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def fb_loop(device, flat, compile=True, donate=False, max_buffer_mb=None):
    model = new_model(device)
    tx = fb.adamw(lr=1e-3)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params, max_buffer_mb=max_buffer_mb) if flat else None
    if flat:
        params = layout.flatten(params)
    carry = {"params": params, "state": (fb.fuse(tx, layout) if flat else tx).init(params)}
    train_step = fb.make_train_step(model, lm_loss, tx, compile=compile, layout=layout, donate=donate)

    def step(batch):
        carry["params"], carry["state"], loss = train_step(carry["params"], carry["state"], batch)
        return loss

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the language model's size")
    args = parser.parse_args(argv)
    global VOCAB, D_MODEL, LAYERS  # the model and loss read them  # noqa: PLW0603
    VOCAB, D_MODEL, LAYERS = SIZES[args.size]
    disable_compile_caches()
    batches = make_batches(args.steps + 4, args.device)
    variants = {
        "torch eager + fused AdamW": lambda: torch_loop(args.device, compiled=False),
        "torch.compile(model) + fused AdamW": lambda: torch_loop(args.device, compiled=True),
        "fb compiled step (tree)": lambda: fb_loop(args.device, flat=False),
        "fb compiled step (flat)": lambda: fb_loop(args.device, flat=True),
        "fb compiled step (flat, buffers of 16 MiB)": lambda: fb_loop(args.device, flat=True, max_buffer_mb=16),
        "fb eager step (tree)": lambda: fb_loop(args.device, flat=False, compile=False),
        "fb eager step (tree, donated)": lambda: fb_loop(args.device, flat=False, compile=False, donate=True),
    }
    rows = []
    for name, make in variants.items():
        torch._dynamo.reset()
        step = make()
        it = iter(batches)
        compile_s = first_call_s(lambda step=step, it=it: step(next(it)), args.device)
        losses: list = []
        ms = median_ms(
            lambda step=step, it=it, losses=losses: losses.append(step(next(it))), args.device, args.steps, warmup=2
        )
        rows.append(dict(variant=name, ms=ms, first_step_s=compile_s, final_loss=float(losses[-1])))
    base = rows[0]["ms"]
    for r in rows:
        r["vs_torch_eager"] = f"{r['ms'] / base:.2f}x"
    n_params = sum(p.numel() for p in new_model("cpu").parameters())
    print(f"# end to end: {args.size} LM ({n_params / 1e6:.2f}M params, batch {BATCH} x {SEQ}), {machine()}\n")
    print(table(rows, ["variant", "ms", "vs_torch_eager", "first_step_s", "final_loss"]))


if __name__ == "__main__":
    main()
