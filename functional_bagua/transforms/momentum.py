"""Momentum (heavy ball and Nesterov), as torch.optim.SGD computes it.

``trace(momentum, dampening, nesterov)``::

    b_1 = g_1                                      (first step: the gradient itself)
    b_t = momentum * b_{t-1} + (1 - dampening) * g_t
    u_t = g_t + momentum * b_t   if nesterov   else   b_t

``ema_momentum(decay)`` is the other common form, an exponential moving average ``b_t = lerp(b_{t-1}, g_t,
1 - decay)`` from zero (torch.optim.Muon's buffer), optionally Nesterov: ``u_t = lerp(g_t, b_t, decay)``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_bagua.base import GradientTransformation, identity
from functional_bagua.numerics import add_scaled, is_number, lerp, zero_count
from functional_bagua.transforms.leafwise import leafwise


class TraceState(NamedTuple):
    """``count``: steps taken per tensor; ``trace``: the momentum buffer ``b``."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    trace: torch.Tensor


def trace(momentum: float = 0.9, dampening: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """SGD momentum (see module docstring); the identity when ``momentum == 0``.

    Example::

        sgd_nesterov = chain(trace(0.9, nesterov=True), scale_by_learning_rate(0.1))

    Args:
        momentum: the weight of the previous buffer ``b_{t-1}``; the number 0 gives the identity.
        dampening: the new gradient enters the buffer with weight ``1 - dampening`` (except on
            the first step, where ``b_1 = g_1``).
        nesterov: with ``True``, the update is ``g_t + momentum * b_t``; else it is ``b_t``.

    Returns:
        A GradientTransformation whose state is a :class:`TraceState` (the identity when
        ``momentum`` is the number 0).
    """
    if is_number(momentum) and momentum == 0:
        return identity()

    def init_leaf(p: torch.Tensor) -> TraceState:
        return TraceState(count=zero_count(p), trace=torch.zeros_like(p))

    def update_leaf(g: torch.Tensor, s: TraceState, p: Optional[torch.Tensor]) -> tuple[torch.Tensor, TraceState]:
        if is_number(dampening) and dampening == 0:
            b = s.trace.mul(momentum).add_(g)  # from b_0 = 0 this gives b_1 = g exactly (add_: on our temporary)
        else:
            b = torch.where(s.count == 0, g, add_scaled(s.trace.mul(momentum), g, 1 - dampening))
        u = add_scaled(g, b, momentum) if nesterov else b
        return u, TraceState(count=s.count + 1, trace=b)

    return leafwise(TraceState, init_leaf, update_leaf, name="trace")


class EmaMomentumState(NamedTuple):
    """``ema``: the moving average of the updates."""

    ema: torch.Tensor


def ema_momentum(decay: float, nesterov: bool = False) -> GradientTransformation:
    """``b_t = lerp(b_{t-1}, g_t, 1 - decay)`` from ``b_0 = 0``; ``u_t = b_t``, or
    ``lerp(g_t, b_t, decay)`` with ``nesterov`` (torch.optim.Muon's momentum). No bias correction.

    Args:
        decay: the weight of the previous average ``b_{t-1}`` (the new gradient has weight ``1 - decay``).
        nesterov: with ``True``, the update is ``lerp(g_t, b_t, decay)``; else it is ``b_t``.

    Returns:
        A GradientTransformation whose state is an :class:`EmaMomentumState`.

    Example::

        tx = fb.chain(fb.ema_momentum(0.95, nesterov=True), fb.orthogonalize(), fb.scale_by_learning_rate(0.02))
    """

    def init_leaf(p: torch.Tensor) -> EmaMomentumState:
        return EmaMomentumState(ema=torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: EmaMomentumState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, EmaMomentumState]:
        b = lerp(s.ema, g, 1 - decay)
        u = lerp(g, b, decay) if nesterov else b
        return u, EmaMomentumState(ema=b)

    return leafwise(EmaMomentumState, init_leaf, update_leaf, name="ema_momentum")
