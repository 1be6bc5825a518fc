"""Train a small MLP on synthetic regression data with a pure functional loop.

    python examples/quickstart.py

No module state is mutated during training: parameters, optimizer state and gradients are plain
pytrees (dicts of tensors); torch.func computes the gradients and fb.adamw the updates.
"""

from __future__ import annotations

import argparse
import time

import torch

import functional_bagua as fb


def make_data(n: int, generator: torch.Generator):
    """y = sin(x . w) + noise: a smooth target a small MLP can fit."""
    w_true = torch.randn(8, 1, generator=generator) / 8**0.5
    x = torch.randn(n, 8, generator=generator)
    y = torch.sin(2 * x @ w_true) + 0.05 * torch.randn(n, 1, generator=generator)
    return x, y


def main(steps: int = 300, batch_size: int = 64, lr: float = 1e-2) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = make_data(2048, gen)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    params = fb.params_of(model)  # {"0.weight": ..., "0.bias": ..., ...}
    tx = fb.adamw(lr=lr, weight_decay=1e-4)
    state = tx.init(params)

    def loss_of(params, xb, yb):
        prediction = torch.func.functional_call(model, params, (xb,))
        return torch.nn.functional.mse_loss(prediction, yb)

    grad_and_loss = torch.func.grad_and_value(loss_of)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (batch_size,), generator=gen)
        grads, loss = grad_and_loss(params, x[idx], y[idx])
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    full_loss = loss_of(params, x, y).item()
    print(f"full-data loss {full_loss:.4f} after {steps} steps in {time.perf_counter() - start:.1f}s")
    fb.load_params(model, params)  # write the trained values back
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    main(args.steps)
