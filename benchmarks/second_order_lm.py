"""Steps and seconds to a target loss: a small causal language model trained with AdamW, SOAP,
Shampoo and PSGD-Kron from the same weights on the same batches, with a plot.

    python benchmarks/second_order_lm.py [--steps 400] [--target 1.6]
    python benchmarks/second_order_lm.py --device cuda --width 256 --layers 4

The data is learnable: token sequences from a fixed random Markov chain over ``--vocab`` tokens
in which each token has 4 possible successors, so the best possible loss is the chain's entropy
rate (printed). The model is GPT-2's block (pre-norm causal attention and MLP) at ``--width``
and ``--layers``, its head tied to the embedding. Each optimizer runs in ``fb.Optimizer`` with a
common learning rate for its kind, not tuned here: AdamW 3e-3 (weight decay 0.01), SOAP 3e-3,
Shampoo 3e-3 with Adam grafting and betas (0.9, 0.999), PSGD-Kron 1e-3. The loss is smoothed
with an EMA (0.9); "steps to target" is the first step whose smoothed loss is at or below
``--target``. ``--plot PATH`` draws the smoothed loss against steps and against seconds (with
matplotlib); ``--record`` keeps the table and the curves for the docs, whose figure
``benchmarks/plots.py`` draws.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, record, table  # noqa: E402

import functional_bagua as fb  # noqa: E402

OPTIMIZERS = {
    "AdamW": lambda: fb.adamw(3e-3, weight_decay=0.01),
    "SOAP": lambda: fb.soap(3e-3),
    "Shampoo (Adam grafting)": lambda: fb.shampoo(3e-3, betas=(0.9, 0.999), grafting="adam", precondition_frequency=10),
    "PSGD-Kron": lambda: fb.psgd_kron(1e-3),
}


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.attn(self.ln_1(x)).split(c, 2)
        )
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class LM(torch.nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, positions: int) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(positions, width)
        self.blocks = torch.nn.ModuleList(Block(width, 4) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)  # GPT-2's initialisation

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.linear(self.ln_f(x), self.wte.weight)


def markov_chain(vocab: int, successors: int = 4, seed: int = 0) -> tuple[torch.Tensor, float]:
    """A transition matrix in which each token has ``successors`` possible next tokens, and its
    entropy rate in nats (the best possible loss)."""
    gen = torch.Generator().manual_seed(seed)
    transitions = torch.zeros(vocab, vocab)
    for token in range(vocab):
        nexts = torch.randperm(vocab, generator=gen)[:successors]
        transitions[token, nexts] = torch.rand(successors, generator=gen) + 0.2
    transitions /= transitions.sum(dim=1, keepdim=True)
    stationary = torch.full((vocab,), 1.0 / vocab)
    for _ in range(200):
        stationary = stationary @ transitions
    logs = torch.where(transitions > 0, transitions.log(), torch.zeros(()))
    entropy = -(stationary[:, None] * transitions * logs).sum().item()
    return transitions, entropy


def batches(transitions: torch.Tensor, steps: int, batch: int, seq: int, device: str) -> list:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, transitions.shape[0], (batch,), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=gen).squeeze(1)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(tokens).reshape(-1, vocab), targets.reshape(-1))


def train(
    name: str,
    make_tx=None,  # noqa: ANN001
    data: Optional[list] = None,
    args: Optional[argparse.Namespace] = None,
    held_out: Optional[list] = None,
    make_optimizer=None,  # noqa: ANN001
) -> dict:
    """One optimizer's run from the common weights: the smoothed loss per step and the seconds;
    with ``held_out`` batches, also their mean loss after the last step at the weights the
    optimizer evaluates at (``optimizer.eval()``: schedule-free's average; the others' parameters).
    The optimizer is ``fb.Optimizer`` over ``make_tx()``, or ``make_optimizer(parameters)`` (a
    torch.optim optimizer of another package)."""
    assert data is not None and args is not None
    torch.manual_seed(0)
    model = LM(args.vocab, args.width, args.layers, args.seq).to(args.device)
    opt = (
        make_optimizer(model.parameters())
        if make_optimizer is not None
        else fb.Optimizer(model.parameters(), make_tx())
    )
    smoothed, curve, seconds, elapsed = None, [], [], 0.0
    for tokens, targets in data:
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model, tokens, targets, args.vocab)
        loss.backward()
        opt.step()
        value = loss.item()  # also waits for the step on a GPU
        elapsed += time.perf_counter() - start
        smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
        curve.append(smoothed)
        seconds.append(elapsed)
    reached = next((i for i, v in enumerate(curve) if v <= args.target), None)
    result = dict(
        optimizer=name,
        steps_to_target=reached + 1 if reached is not None else f"> {len(curve)}",
        seconds_to_target=seconds[reached] if reached is not None else "-",
        final_loss=curve[-1],
        ms_per_step=1e3 * seconds[-1] / len(seconds),
        curve=curve,
        seconds=seconds,
    )
    if held_out:
        if hasattr(opt, "eval"):
            opt.eval()
        with torch.no_grad():
            result["eval_loss"] = sum(loss_of(model, x, y, args.vocab).item() for x, y in held_out) / len(held_out)
    return result


def arguments(description: str) -> argparse.ArgumentParser:
    """The options of the language-model runs (this script's and ``first_order_lm.py``'s)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--target", type=float, default=0.0, help="the loss to reach (default: the entropy rate + 0.25)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    parser.add_argument("--plot", default="", help="draw the loss curves into this PNG file (with matplotlib)")
    return parser


def data_for(args: argparse.Namespace, extra_batches: int = 0) -> tuple[list, float]:
    """The batches of ``args.steps`` steps (and ``extra_batches`` more after them) and the
    entropy rate of the chain they come from; sets the threads and the default target, and says
    what runs."""
    torch.set_num_threads(args.threads)
    transitions, entropy = markov_chain(args.vocab)
    args.target = args.target or round(entropy + 0.25, 3)
    data = batches(transitions, args.steps + extra_batches, args.batch, args.seq, args.device)
    params = sum(p.numel() for p in LM(args.vocab, args.width, args.layers, args.seq).parameters())
    print(
        f"{machine(args.device)}; LM of {params / 1e3:.0f}k parameters, {args.steps} steps of {args.batch} x {args.seq} tokens"
    )
    print(
        f"entropy rate of the data {entropy:.3f} nats (the best loss); target {args.target} (at uniform: {math.log(args.vocab):.2f})"
    )
    return data, entropy


def plot(results: list, entropy: float, target: float, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        axes[0].plot(range(1, len(r["curve"]) + 1), r["curve"], label=r["optimizer"])
        axes[1].plot(r["seconds"], r["curve"], label=r["optimizer"])
    for ax, xlabel in zip(axes, ("step", "seconds")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label="target")
        ax.axhline(entropy, color="black", linestyle=":", linewidth=0.8, label="entropy rate")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (EMA 0.9)")
        ax.set_ylim(max(0.0, entropy - 0.2), max(r["curve"][5] for r in results))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args()
    data, entropy = data_for(args)
    results = [train(name, make, data, args) for name, make in OPTIMIZERS.items()]
    columns = ["optimizer", "steps_to_target", "seconds_to_target", "final_loss", "ms_per_step"]
    print(table(results, columns))
    if args.plot and plot(results, entropy, args.target, args.plot):
        print(f"plot: {args.plot}")
    if args.record:
        record("second_order_lm", args.device, [lm_table(results, columns, args)])


def lm_table(results: list[dict], columns: list[str], args: argparse.Namespace) -> dict:
    """The recorded table: each optimizer's row with its smoothed loss curve, drawn as curves."""
    title = f"loss (EMA 0.9) of the language model, {args.steps} steps, target {args.target}"
    rows = [{k: v for k, v in r.items() if k != "seconds"} for r in results]
    return dict(
        title=title,
        columns=columns,
        rows=rows,
        chart=dict(kind="curves", value="curve", label=["optimizer"], ylabel="loss (EMA 0.9)"),
    )


if __name__ == "__main__":
    main()
