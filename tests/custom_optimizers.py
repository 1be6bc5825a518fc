"""Optimizers written outside torch, the way users write them, for the fused-optimizer tests.

- :class:`BertAdam`: pytorch-pretrained-bert's Adam (linear warmup then linear decay, python-int
  ``step``, bias correction skipped) with **per-parameter** gradient-norm clipping: not
  elementwise, so a fused step must not change it.
- :class:`SignMomentum`: a Lion-style elementwise update with its own state layout.
"""

from __future__ import annotations

import torch


def evaluate(closure):
    """The closure's loss, computed with gradients on (as torch.optim does), or ``None``."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def warmup_linear(progress: float, warmup: float) -> float:
    """``progress / warmup`` during warmup, then ``1 - progress``."""
    return progress / warmup if progress < warmup else 1.0 - progress


class BertAdam(torch.optim.Optimizer):
    """For each parameter with a gradient, with ``t`` its step count::

    g   <- g * min(1, max_grad_norm / ||g||)          (per parameter)
    m   <- b1 m + (1 - b1) g
    v   <- b2 v + (1 - b2) g^2
    u   <- m / (sqrt(v) + e) + weight_decay * p
    p   <- p - lr * warmup_linear(t / t_total, warmup) * u
    """

    def __init__(
        self, params, lr=1e-3, warmup=0.1, t_total=1000, b1=0.9, b2=0.999, e=1e-6, weight_decay=0.01, max_grad_norm=1.0
    ):
        defaults = dict(
            lr=lr,
            warmup=warmup,
            t_total=t_total,
            b1=b1,
            b2=b2,
            e=e,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["next_m"] = torch.zeros_like(p)
                    state["next_v"] = torch.zeros_like(p)
                grad = p.grad
                if group["max_grad_norm"] > 0:
                    torch.nn.utils.clip_grad_norm_(p, group["max_grad_norm"])
                b1, b2 = group["b1"], group["b2"]
                state["next_m"].mul_(b1).add_(grad, alpha=1 - b1)
                state["next_v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                update = state["next_m"] / (state["next_v"].sqrt() + group["e"])
                if group["weight_decay"] > 0:
                    update += group["weight_decay"] * p
                lr = group["lr"] * warmup_linear(state["step"] / group["t_total"], group["warmup"])
                p.add_(update, alpha=-lr)
                state["step"] += 1
        return loss


class SignMomentum(torch.optim.Optimizer):
    """Lion-style, elementwise::

    p <- p - lr * (sign(b1 m + (1 - b1) g) + weight_decay * p)
    m <- b2 m + (1 - b2) g
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                m = state["momentum"]
                direction = (m * b1 + p.grad * (1 - b1)).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(direction, alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss
