"""MARS (Yuan et al., 2024, "MARS: Unleashing the Power of Variance Reduction for Training Large
Models"), as the authors' code computes it: a variance-reduced gradient, clipped per tensor,
given to any optimizer in place of the gradient::

    c_t = g_t + gamma * b1 / (1 - b1) * (g_t - g_{t-1})          (g_0 = 0)
    c_t = c_t max_norm / ||c_t||   where ||c_t|| > max_norm (1: the authors' c_t / ||c_t||)
    u_t = inner(c_t)

``g_{t-1}`` is the previous gradient of the same tensor, kept in the state (the authors'
approximate MARS, which takes it from the previous step rather than recomputing it on the new
batch). MARS-AdamW is ``mars(adam's direction)`` with the same ``b1`` in both.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from functional_bagua.base import GradientTransformation, chain
from functional_bagua.numerics import is_number
from functional_bagua.transforms.leafwise import leafwise

Scalar = Union[float, torch.Tensor]


class ScaleByMarsState(NamedTuple):
    """Per tensor: ``previous_grad`` (``g_{t-1}``, zeros before the first step)."""

    previous_grad: torch.Tensor


def scale_by_mars(gamma: Scalar = 0.025, b1: Scalar = 0.95, max_norm: Optional[float] = 1.0) -> GradientTransformation:
    """The corrected, clipped gradient ``c_t`` of the module docstring.

    Args:
        gamma: the strength of the correction (0 gives the clipped gradient).
        b1: the momentum of the optimizer the corrected gradient goes to; the correction is
            scaled by ``b1 / (1 - b1)``.
        max_norm: ``c_t`` is scaled down to this 2-norm per tensor where it is longer;
            ``None`` for no clipping.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByMarsState`.

    Example::

        tx = fb.chain(fb.scale_by_mars(0.025, 0.95), fb.scale_by_adam(0.95, 0.99), fb.scale_by_learning_rate(3e-3))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByMarsState:
        return ScaleByMarsState(torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByMarsState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByMarsState]:
        c = (g - s.previous_grad).mul(gamma * (b1 / (1.0 - b1))).add(g)
        if max_norm is not None:
            norm = torch.linalg.vector_norm(c)
            c = torch.where(norm > max_norm, c / (norm / max_norm), c)
        return c, ScaleByMarsState(g.clone())  # not the caller's tensor (zero_grad may zero it in place)

    return leafwise(ScaleByMarsState, init_leaf, update_leaf, name="scale_by_mars", per_tensor=max_norm is not None)


def mars(
    inner: GradientTransformation, gamma: Scalar = 0.025, b1: Scalar = 0.95, max_norm: Optional[float] = 1.0
) -> GradientTransformation:
    """``inner`` fed MARS's corrected gradients: ``chain(scale_by_mars(gamma, b1, max_norm), inner)``.

    Args:
        inner: any optimizer or direction (an alias too: the correction acts on its input).
        gamma: the strength of the correction, ``>= 0``.
        b1: the momentum of ``inner`` (the correction is scaled by ``b1 / (1 - b1)``), in ``[0, 1)``.
        max_norm: the per-tensor clipping norm of the corrected gradient; ``None`` for none.

    Returns:
        A GradientTransformation whose state is ``(ScaleByMarsState, inner's state)``.

    Example::

        tx = fb.mars(fb.adamw(3e-3, betas=(0.95, 0.99)), gamma=0.025, b1=0.95)
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"mars: inner must be a GradientTransformation, got {type(inner).__name__}")
    if is_number(gamma) and gamma < 0:
        raise ValueError(f"mars: gamma must be >= 0, got {gamma}: it scales the correction g_t - g_(t-1)")
    if is_number(b1) and not 0 <= b1 < 1:
        raise ValueError(f"mars: b1 must lie in [0, 1), got {b1}: the correction is scaled by b1 / (1 - b1)")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"mars: max_norm must be > 0 or None, got {max_norm}")
    return chain(scale_by_mars(gamma, b1, max_norm), inner)
