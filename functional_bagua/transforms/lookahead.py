"""Lookahead (Zhang, Lucas, Hinton & Ba, 2019): k fast steps forward, one step back.

The parameters are the *fast* weights, moved by ``inner`` every step; the state keeps the *slow*
weights ``phi`` (initially the parameters). Every ``sync_period``-th step ``t``::

    theta_t = theta_{t-1} + inner(g_t)               (the fast step)
    phi     = phi + alpha * (theta_t - phi)          (t % sync_period == 0)
    theta_t = phi                                    (the fast weights restart from phi)

Between syncs the update is ``inner``'s own. The update returned on a sync step is ``phi - theta_{t-1}``, so ``apply_updates`` lands on
``phi`` (up to one rounding); ``state.slow`` holds ``phi`` exactly, the weights to evaluate.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from functional_bagua import tree
from functional_bagua.base import GradientTransformation, apply_updates
from functional_bagua.hyperparams import accepts_schedules, checkable
from functional_bagua.numerics import lerp, zero_count
from functional_bagua.tree import PyTree


class LookaheadState(NamedTuple):
    """``count``: fast steps done; ``slow``: the slow weights; ``inner_state``."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    slow: Any
    inner_state: Any


@accepts_schedules(static_args=("inner",))
def lookahead(inner: GradientTransformation, sync_period: int = 5, alpha: float = 0.5) -> GradientTransformation:
    """Lookahead around ``inner`` (module docstring); ``alpha`` may be a schedule.

    Branch-free (``torch.where`` on the step count), so a compiled step is one graph.

    Example (the paper's setting)::

        tx = fb.lookahead(fb.adam(1e-3), sync_period=5, alpha=0.5)

    Args:
        inner: the transform that moves the fast weights (a TypeError if it is not a
            GradientTransformation).
        sync_period: the number of fast steps between syncs, an int >= 1 (a ValueError otherwise).
        alpha: the slow weights' step towards the fast ones on a sync, in [0, 1]
            (``phi <- phi + alpha * (theta - phi)``); may be a schedule of the step count.

    Returns:
        A GradientTransformation whose state is a :class:`LookaheadState`; its ``update`` needs
        the parameters.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"lookahead: inner is {type(inner).__name__}, not a GradientTransformation")
    if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period < 1:
        raise ValueError(f"Invalid sync_period: {sync_period!r} (an int >= 1)")
    alpha_now = checkable(alpha)
    if alpha_now is not None and not 0.0 <= alpha_now <= 1.0:
        raise ValueError(f"Invalid alpha: {alpha} (in [0, 1])")

    def init(params: PyTree) -> LookaheadState:
        return LookaheadState(zero_count(params), tree.clone(params), inner.init(params))

    def update(grads: PyTree, state: LookaheadState, params: Optional[PyTree] = None) -> tuple[PyTree, LookaheadState]:
        if params is None:
            raise ValueError("lookahead needs the parameters: call update(grads, state, params)")
        fast_updates, inner_state = inner.update(grads, state.inner_state, params)
        fast = apply_updates(params, fast_updates)
        count = state.count + 1
        sync = count % sync_period == 0
        slow = tree.tree_map(
            lambda phi, theta: None if phi is None else torch.where(sync, lerp(phi, theta, alpha), phi),
            state.slow,
            fast,
        )
        updates = tree.tree_map(
            lambda phi, u, p: (
                None if p is None else torch.where(sync, phi - p, torch.zeros_like(p) if u is None else u)
            ),
            slow,
            fast_updates,
            params,
        )
        return updates, LookaheadState(count, slow, inner_state)

    return GradientTransformation(init, update)
