"""Bagua's fused optimizer on torch 2.x: any torch.optim optimizer, ``fuse_step`` instead of ``step``.

    python examples/fused_optimizer.py                 # Adadelta, as in Bagua's docs
    python examples/fused_optimizer.py --optimizer adamw --amp

A 100-layer residual MLP (200 parameter tensors) learns a random linear map. ``fuse_optimizer`` moves each
param group's parameters, gradients and state into one buffer per (device, dtype); ``fuse_step``
then steps them as a few large tensors: the same numbers as ``step()``, bit for bit, and several
times fewer kernel launches. ``--amp`` shows the GradScaler pattern (``fused_steps``).
"""

from __future__ import annotations

import argparse
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
    torch.manual_seed(seed)
    model = ResidualMLP()
    target = torch.nn.Linear(32, 32)
    optimizer = fuse_optimizer(OPTIMIZERS[optimizer](model.parameters()))
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        x = torch.randn(64, 32)
        with torch.no_grad():
            y = target(x)
        optimizer.zero_grad()                       # set_to_none=True, torch's default: fine
        loss = torch.nn.functional.mse_loss(model(x), y)
        if amp:
            scaler.scale(loss).backward()
            with fused_steps(optimizer):            # scaler.step calls optimizer.step: make it fuse_step
                scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.fuse_step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    print(f"{steps} fused steps in {seconds:.2f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"fused param groups stepped: {optimizer._bagua_fused_count}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adadelta")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    main(args.optimizer, args.steps, args.amp)
