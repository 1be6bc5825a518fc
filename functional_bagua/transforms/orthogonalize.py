"""Muon's orthogonalised update (Jordan et al., 2024), as torch.optim.Muon computes it.

``orthogonalize(ns_coefficients, ns_steps, eps)`` replaces each 2-D update ``G`` by an
approximation of ``U V^T`` (``G = U S V^T``) from ``k`` quintic Newton-Schulz iterations, run in
bfloat16 on the wide orientation of ``G``::

    X_0 = G / max(||G||_F, eps)
    A = X X^T;   X <- a X + (b A + c A A) X               (k times)

``scale_by_shape(adjust_lr_fn)`` multiplies each ``A x B`` update by Muon's shape factor::

    "original" (default):   sqrt(max(1, A / B))
    "match_rms_adamw":      0.2 * sqrt(max(A, B))
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from functional_bagua import layout_context
from functional_bagua.base import GradientTransformation
from functional_bagua.transforms.leafwise import stateless

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(
    g: torch.Tensor, coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS
) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of a matrix, in bfloat16 (module docstring).

    Args:
        g: the 2-D matrix to orthogonalise (a ValueError for another number of dims).
        coefficients: ``(a, b, c)``, the coefficients of the iteration ``X <- a X + (b A + c A A) X``.
        steps: the number of iterations ``k``.
        eps: the floor of ``||G||_F`` in the normalisation ``X_0 = G / max(||G||_F, eps)``.

    Returns:
        A bfloat16 tensor of ``g``'s shape.
    """
    if g.dim() != 2:
        raise ValueError(f"Newton-Schulz orthogonalisation needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.bfloat16()
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def orthogonalize(
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS, ns_steps: int = NS_STEPS, eps: float = NS_EPS
) -> GradientTransformation:
    """``u = NewtonSchulz(g)`` per 2-D tensor, cast back to the gradient's dtype.

    Args:
        ns_coefficients: ``(a, b, c)`` of :func:`newton_schulz`, exactly 3 values (a ValueError
            otherwise).
        ns_steps: the number of Newton-Schulz iterations, less than 100 (a ValueError otherwise).
        eps: the floor of the Frobenius norm when the update is normalised.

    Returns:
        A stateless GradientTransformation; an update that is not 2-D raises a ValueError.

    Example::

        tx = fb.chain(fb.ema_momentum(0.95, nesterov=True), fb.orthogonalize(), fb.scale_by_learning_rate(0.02))
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    return stateless(
        lambda u, p: newton_schulz(u, ns_coefficients, ns_steps, eps), name="orthogonalize", per_tensor=True
    )


def shape_factor(shape: Sequence[int], adjust_lr_fn: Optional[str]) -> float:
    """Muon's learning-rate factor for an ``A x B`` matrix (module docstring).

    Args:
        shape: the matrix's shape; its first two entries are ``A`` and ``B``.
        adjust_lr_fn: ``None`` or ``"original"`` for ``sqrt(max(1, A / B))``, ``"match_rms_adamw"``
            for ``0.2 * sqrt(max(A, B))``; another name raises a ValueError.

    Returns:
        The factor, a Python float.
    """
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def scale_by_shape(adjust_lr_fn: Optional[str] = None) -> GradientTransformation:
    """``u = shape_factor(shape(g)) * g`` per tensor (module docstring).

    Args:
        adjust_lr_fn: the name of the factor, as in ``shape_factor`` (checked when the
            transform is built).

    Returns:
        A stateless GradientTransformation.

    Example::

        tx = fb.chain(fb.orthogonalize(), fb.scale_by_shape("match_rms_adamw"), fb.scale_by_learning_rate(0.02))
    """
    shape_factor((1, 1), adjust_lr_fn)  # validates the name

    def per_buffer(u: torch.Tensor, p: Optional[torch.Tensor], lengths: list, key: str) -> torch.Tensor:
        """Each segment times its whole tensor's factor (a DTensor's shard: the whole DTensor's)."""
        factors = [shape_factor(shape, adjust_lr_fn) for shape in layout_context.whole_shapes_of(key)]
        return torch.cat([piece * factor for piece, factor in zip(u.split(lengths), factors)])

    return stateless(
        lambda u, p: u * shape_factor(u.shape, adjust_lr_fn),
        name="scale_by_shape",
        per_tensor=True,
        per_buffer=per_buffer,
    )
