"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")::

c_t = lerp(m_{t-1}, g_t, 1 - b1)          (= b1 m + (1 - b1) g)
u_t = sign(c_t)
m_t = lerp(m_{t-1}, g_t, 1 - b2)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.foreach import updated
from functional_bagua.numerics import lerp, lerp_weight
from functional_bagua.transforms.leafwise import leafwise


class ScaleByLionState(NamedTuple):
    """Per tensor: ``mu`` (the momentum ``m``)."""

    mu: torch.Tensor


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's sign direction (module docstring).

    Args:
        b1: the weight of the momentum in the direction: ``u_t = sign(b1 m_{t-1} + (1 - b1) g_t)``.
        b2: the decay rate of the momentum: ``m_t = b2 m_{t-1} + (1 - b2) g_t``.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByLionState`.

    Example::

        tx = fb.chain(fb.scale_by_lion(), fb.scale_by_learning_rate(1e-4))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByLionState:
        return ScaleByLionState(torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByLionState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByLionState]:
        u = lerp(s.mu, g, 1 - b1).sign()
        return u, ScaleByLionState(updated(s.mu, "lerp", g, lerp_weight(1 - b2, s.mu)))  # s.mu read above

    return leafwise(ScaleByLionState, init_leaf, update_leaf, name="scale_by_lion", fresh_updates=True)
