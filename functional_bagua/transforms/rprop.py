"""Resilient backpropagation (Riedmiller & Braun, 1993), as torch.optim.Rprop.

Per element, with ``s = sign(g_t * g_{t-1})``::

    eta_t  = eta_plus if s > 0,  eta_minus if s < 0,  1 if s = 0
    h_t    = clamp(h_{t-1} * eta_t, step_min, step_max),     h_0 = lr
    g'_t   = 0 if s < 0 else g_t                             (remembered as g_{t})
    u_t    = sign(g'_t) * h_t                                 (ascent direction)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import filled_like
from functional_bagua.transforms.leafwise import leafwise


class ScaleByRpropState(NamedTuple):
    """Per tensor: ``prev`` (last gradient kept) and ``step_size`` (``h``)."""

    prev: torch.Tensor
    step_size: torch.Tensor


def scale_by_rprop(
    learning_rate: float = 1e-2,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50),
) -> GradientTransformation:
    """Rprop's step (module docstring); the initial step size is ``learning_rate``.

    Args:
        learning_rate: ``h_0``, every element's initial step size (for a complex tensor, of its
            real and imaginary parts alike).
        etas: ``(eta_minus, eta_plus)``, the factors of the step size where the gradient's sign
            flipped and where it stayed the same.
        step_sizes: ``(step_min, step_max)``, the bounds of the step size ``h_t``.

    Returns:
        A GradientTransformation giving the ascent direction ``sign(g'_t) * h_t``, whose state is a
        :class:`ScaleByRpropState`.

    Example::

        tx = fb.chain(fb.scale_by_rprop(1e-2), fb.scale(-1.0))
    """
    eta_minus, eta_plus = etas
    step_min, step_max = step_sizes

    def init_leaf(p: torch.Tensor) -> ScaleByRpropState:
        # a complex parameter steps its real and imaginary parts alike: both start at the lr (as torch)
        initial = learning_rate * (1 + 1j) if p.is_complex() else learning_rate
        return ScaleByRpropState(torch.zeros_like(p), filled_like(p, initial))

    def update_leaf(
        g: torch.Tensor, s: ScaleByRpropState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByRpropState]:
        agreement = (g * s.prev).sign()
        same, flipped = agreement > 0, agreement < 0
        eta = torch.ones_like(g).masked_fill(same, eta_plus).masked_fill(flipped, eta_minus)
        step_size = s.step_size.mul(eta).clamp(min=step_min).clamp(max=step_max)
        g = g.masked_fill(flipped, 0)
        return g.sign() * step_size, ScaleByRpropState(g, step_size)

    return leafwise(ScaleByRpropState, init_leaf, update_leaf, name="scale_by_rprop", fresh_updates=True)
