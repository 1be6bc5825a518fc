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
from typing import Optional

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.transforms.leafwise import stateless

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of a matrix, in bfloat16 (module docstring)."""
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


def orthogonalize(ns_coefficients=NS_COEFFICIENTS, ns_steps: int = NS_STEPS, eps: float = NS_EPS) -> GradientTransformation:
    """``u = NewtonSchulz(g)`` per 2-D tensor, cast back to the gradient's dtype."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    return stateless(lambda u, p: newton_schulz(u, ns_coefficients, ns_steps, eps), name="orthogonalize", per_tensor=True)


def shape_factor(shape, adjust_lr_fn: Optional[str]) -> float:
    """Muon's learning-rate factor for an ``A x B`` matrix (module docstring)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def scale_by_shape(adjust_lr_fn: Optional[str] = None) -> GradientTransformation:
    """``u = shape_factor(shape(g)) * g`` per tensor (module docstring)."""
    shape_factor((1, 1), adjust_lr_fn)  # validates the name
    return stateless(lambda u, p: u * shape_factor(u.shape, adjust_lr_fn), name="scale_by_shape", per_tensor=True)
