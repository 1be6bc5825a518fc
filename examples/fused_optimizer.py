"""Bagua's fused optimizer on torch 2.x: any torch.optim optimizer, ``fuse_step`` instead of ``step``.

    python examples/fused_optimizer.py                 # Adadelta, as in Bagua's docs
    python examples/fused_optimizer.py --optimizer adamw --amp

A 100-layer residual MLP (200 parameter tensors) learns a random linear map, twice: one copy
stepped with ``step()``, one with ``fuse_step()``. ``fuse_optimizer`` moves each param group's
parameters, gradients and state into one buffer per (device, dtype); ``fuse_step`` then steps
them as a few large tensors: the same numbers as ``step()``, bit for bit (the script compares
them), and several times fewer kernel launches. ``--amp`` runs the forward under bf16 autocast
with the GradScaler pattern (``fused_steps``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from functional_bagua.compat import fuse_optimizer, fused_steps

OPTIMIZERS = {
    "adadelta": lambda params: torch.optim.Adadelta(params, lr=1.0),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


class ResidualMLP(torch.nn.Module):
    """``x <- x + tanh(W_i x + b_i)`` for ``depth`` layers: 2 x depth parameter tensors."""

    def __init__(self, width=32, depth=100):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        for layer in self.layers:
            torch.nn.init.normal_(layer.weight, std=0.02)

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def main(optimizer="adadelta", steps=60, amp=False, seed=0):
    """Train two identical models on the same batches, one stepped with ``step()``, one with
    ``fuse_step()``; print the loss, the median time of each optimizer step, and whether the two
    models' parameters are equal bit for bit (they are compared). Returns the fused model's losses."""
    torch.manual_seed(seed)
    model = ResidualMLP()
    reference = copy.deepcopy(model)
    target = torch.nn.Linear(32, 32)
    runs = [
        ("step", reference, OPTIMIZERS[optimizer](reference.parameters())),
        ("fuse_step", model, fuse_optimizer(OPTIMIZERS[optimizer](model.parameters()))),
    ]
    scalers = {kind: torch.amp.GradScaler("cpu", enabled=amp) for kind, _, _ in runs}
    times = {kind: [] for kind, _, _ in runs}
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32)
        with torch.no_grad():
            y = target(x)
        for kind, net, opt in runs:
            opt.zero_grad()  # set_to_none=True, torch's default: fine
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = torch.nn.functional.mse_loss(net(x), y)
            scaler = scalers[kind]
            scaler.scale(loss).backward()  # without --amp the scaler passes everything through
            start = time.perf_counter()
            if kind == "fuse_step":
                with fused_steps(opt):  # scaler.step calls optimizer.step: make it fuse_step
                    scaler.step(opt)
            else:
                scaler.step(opt)
            times[kind].append(time.perf_counter() - start)
            scaler.update()
        losses.append(loss.item())
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    step_ms, fused_ms = (1e3 * statistics.median(times[kind]) for kind in ("step", "fuse_step"))
    print(
        f"{steps} steps of {optimizer}{' under bf16 autocast with a GradScaler' if amp else ''}: "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    print(f"optimizer step, median: step() {step_ms:.2f} ms, fuse_step() {fused_ms:.2f} ms ({step_ms / fused_ms:.1f}x)")
    print(f"parameters after fuse_step() equal those after step(), bit for bit: {same}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adadelta")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast for the forward, GradScaler around the step")
    args = parser.parse_args()
    main(args.optimizer, args.steps, args.amp)
