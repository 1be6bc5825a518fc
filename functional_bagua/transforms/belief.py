"""AdaBelief (Zhuang et al., 2020): Adam whose second moment tracks the belief ``(g - m)^2``::

m_t = lerp(m_{t-1}, g_t, 1 - b1)
s_t = b2 s_{t-1} + (1 - b2) (g_t - m_t)^2 + eps
u_t = (m_t / (1 - b1^t)) / (sqrt(s_t) / sqrt(1 - b2^t) + eps)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import as_scalar, zero_count
from functional_bagua.transforms.adam import bias_correction, first_moment, second_moment
from functional_bagua.transforms.leafwise import leafwise


class ScaleByBeliefState(NamedTuple):
    """Per tensor: ``count``, ``mu`` (first moment), ``nu`` (belief ``s``)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor


def scale_by_belief(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16) -> GradientTransformation:
    """AdaBelief's direction (module docstring).

    Args:
        b1: the decay rate of the first moment ``m``; ``m`` is bias-corrected by ``1 - b1^t``.
        b2: the decay rate of the belief ``s``, the average of ``(g_t - m_t)^2``; ``sqrt(s)`` is
            bias-corrected by ``sqrt(1 - b2^t)``.
        eps: added twice: to ``s_t`` at every step (inside the square root), and to the
            bias-corrected ``sqrt(s_t)`` in the denominator.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByBeliefState`.

    Example::

        tx = fb.chain(fb.scale_by_belief(), fb.scale_by_learning_rate(1e-3))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByBeliefState:
        return ScaleByBeliefState(zero_count(p), torch.zeros_like(p), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByBeliefState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByBeliefState]:
        count = s.count + 1
        t = as_scalar(count)
        mu = first_moment(s.mu, g, b1)
        nu = second_moment(s.nu, g - mu, b2).add_(eps)  # in s.nu given up, else in a new tensor
        u = mu / bias_correction(b1, t) / (nu.sqrt() / bias_correction(b2, t).sqrt()).add(eps)
        return u, ScaleByBeliefState(count, mu, nu)

    return leafwise(ScaleByBeliefState, init_leaf, update_leaf, name="scale_by_belief", fresh_updates=True)
