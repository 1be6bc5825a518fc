"""Steps and seconds to a target loss: the small causal language model of
``second_order_lm.py`` (same data, model and target) trained with AdamW and the newer first-order
optimizers from the same weights on the same batches, with a plot.

    python benchmarks/first_order_lm.py [--steps 400] [--target 1.6]

Each optimizer runs in ``fb.Optimizer`` with its reference's advice or a common rate, not tuned
here: AdamW 3e-3 (weight decay 0.01), schedule-free AdamW 3e-3 (20 warmup steps, its
replacement of a schedule), Prodigy and D-Adaptation Adam at lr 1 (they estimate the step),
ADOPT, AdEMAMix, LaProp, MARS-AdamW and cautious AdamW at 3e-3. "steps to target" is the first
step whose smoothed training loss (EMA 0.9) is at or below ``--target``; "eval loss" is the mean
loss on 8 held-out batches after the last step, at the weights the optimizer evaluates at
(``optimizer.eval()``: schedule-free's averaged ``x``; the others' parameters). The plot
(``benchmarks/first_order_lm.png``, with matplotlib) shows the smoothed loss against steps and
against seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, table  # noqa: E402
from second_order_lm import LM, batches, markov_chain, plot  # noqa: E402

import functional_bagua as fb  # noqa: E402

OPTIMIZERS = {
    "AdamW": lambda: fb.adamw(3e-3, weight_decay=0.01),
    "schedule-free AdamW": lambda: fb.schedule_free_adamw(3e-3, warmup_steps=20, weight_decay=0.01),
    "Prodigy": lambda: fb.prodigy(1.0, weight_decay=0.01),
    "D-Adaptation Adam": lambda: fb.dadapt_adam(1.0, weight_decay=0.01, decouple=True),
    "ADOPT": lambda: fb.adopt(3e-3, weight_decay=0.01, decouple=True),
    "AdEMAMix": lambda: fb.ademamix(3e-3, weight_decay=0.01, weight_decouple=True),
    "LaProp": lambda: fb.laprop(3e-3, weight_decay=0.01),
    "MARS-AdamW": lambda: fb.mars_adamw(3e-3, weight_decay=0.01),
    "cautious AdamW": lambda: fb.chain(
        fb.cautious(fb.scale_by_adam()), fb.add_decayed_weights(0.01), fb.scale_by_learning_rate(3e-3)
    ),
}


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(tokens).reshape(-1, vocab), targets.reshape(-1))


def train(name: str, make_tx, data: list, held_out: list, args: argparse.Namespace) -> dict:  # noqa: ANN001
    torch.manual_seed(0)
    model = LM(args.vocab, args.width, args.layers, args.seq).to(args.device)
    opt = fb.Optimizer(model.parameters(), make_tx())
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
    opt.eval()  # schedule-free: the averaged weights x; the others: nothing changes
    with torch.no_grad():
        eval_loss = sum(loss_of(model, x, y, args.vocab).item() for x, y in held_out) / len(held_out)
    reached = next((i for i, v in enumerate(curve) if v <= args.target), None)
    return dict(
        optimizer=name,
        steps_to_target=reached + 1 if reached is not None else f"> {len(curve)}",
        seconds_to_target=seconds[reached] if reached is not None else "-",
        final_loss=curve[-1],
        eval_loss=eval_loss,
        ms_per_step=1e3 * seconds[-1] / len(seconds),
        curve=curve,
        seconds=seconds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated names of OPTIMIZERS")
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "first_order_lm.png"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transitions, entropy = markov_chain(args.vocab)
    args.target = args.target or round(entropy + 0.25, 3)
    data = batches(transitions, args.steps + 8, args.batch, args.seq, args.device)
    data, held_out = data[: args.steps], data[args.steps :]
    params = sum(p.numel() for p in LM(args.vocab, args.width, args.layers, args.seq).parameters())
    print(
        f"{machine(args.device)}; LM of {params / 1e3:.0f}k parameters, {args.steps} steps of {args.batch} x {args.seq} tokens"
    )
    print(
        f"entropy rate of the data {entropy:.3f} nats (the best loss); target {args.target} (at uniform: {math.log(args.vocab):.2f})"
    )
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    results = []
    for name in names:
        results.append(train(name, OPTIMIZERS[name], data, held_out, args))
        print(
            table(results[-1:], ["optimizer", "steps_to_target", "final_loss", "eval_loss", "ms_per_step"]), flush=True
        )
    print(
        table(results, ["optimizer", "steps_to_target", "seconds_to_target", "final_loss", "eval_loss", "ms_per_step"])
    )
    if plot(results, entropy, args.target, args.plot):
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
