"""Adafactor (Shazeer & Stern, 2018), with torch.optim.Adafactor's numerics.

``scale_by_factored_rms(beta2_decay, eps1, d)`` — the normalised, clipped direction. With
``b_t = t^beta2_decay`` (the weight of the new square), per tensor::

    matrices (and stacks of them, last two dims):
        R_t = lerp(R_{t-1}, mean_cols(g_t^2), b_t)      C_t = lerp(C_{t-1}, mean_rows(g_t^2), b_t)
        V_t = R_t C_t / max(mean(R_t), eps1)
    vectors and scalars:
        V_t = lerp(V_{t-1}, g_t^2, b_t)
    U_t = g_t / max(sqrt(V_t), eps1)
    u_t = U_t / max(1, RMS(U_t) / d)

``scale_by_relative_step_size(lr, eps2)`` — Adafactor's parameter-relative step::

    u_t = max(eps2, RMS(p_{t-1})) * min(lr, 1 / sqrt(t)) * g_t

``eps1=None`` means the machine epsilon of the parameter's dtype, as in torch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import SCALAR_DTYPE, as_scalar, lerp, zero_count
from functional_bagua.transforms.leafwise import leafwise


class ScaleByFactoredRmsState(NamedTuple):
    """Per tensor: ``count``; ``row_var``/``col_var`` (``R``, ``C``) for tensors of 2 or more
    dims, else ``variance`` (``V``). The unused fields hold empty tensors (not ``None``: a state
    field must hold at least one tensor for torch.compile to trace it)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    row_var: torch.Tensor
    col_var: torch.Tensor
    variance: torch.Tensor


def _mean_square(g: torch.Tensor, dim: int) -> torch.Tensor:
    """``mean(g^2)`` along ``dim`` (kept), via the norm to avoid materialising ``g^2``."""
    return torch.norm(g, dim=dim, keepdim=True).square().div(g.size(dim))


def scale_by_factored_rms(
    beta2_decay: float = -0.8, eps1: Optional[float] = None, d: float = 1.0
) -> GradientTransformation:
    """Adafactor's factored second-moment direction with update clipping (module docstring).

    Args:
        beta2_decay: the exponent of ``b_t = t^beta2_decay``, the weight of the new squared
            gradient in ``R``, ``C`` and ``V`` (negative: the average lengthens with ``t``).
        eps1: the floor of ``mean(R_t)`` and of ``sqrt(V_t)``; ``None`` means the machine epsilon
            of the gradient's dtype.
        d: the clipping threshold: the update is scaled down to an RMS of at most ``d``.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByFactoredRmsState`; tensors of
        2 or more dims are factored over their last two dims.

    Example::

        tx = fb.chain(fb.scale_by_factored_rms(), fb.scale_by_relative_step_size(1e-2), fb.scale(-1.0))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByFactoredRmsState:
        if p.dim() > 1:
            row_shape, col_shape = list(p.shape), list(p.shape)
            row_shape[-1], col_shape[-2] = 1, 1
            return ScaleByFactoredRmsState(
                zero_count(p), p.new_zeros(row_shape), p.new_zeros(col_shape), p.new_zeros(0)
            )
        return ScaleByFactoredRmsState(zero_count(p), p.new_zeros(0), p.new_zeros(0), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByFactoredRmsState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByFactoredRmsState]:
        eps = torch.finfo(g.dtype).eps if eps1 is None else eps1
        count = s.count + 1
        weight = as_scalar(count) ** beta2_decay
        row_var, col_var, variance = s.row_var, s.col_var, s.variance
        if g.dim() > 1:
            row_var = lerp(s.row_var, _mean_square(g, -1), weight)
            col_var = lerp(s.col_var, _mean_square(g, -2), weight)
            var_estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps))
        else:
            variance = lerp(s.variance, g * g, weight)
            var_estimate = variance
        u = var_estimate.clamp(min=eps * eps).rsqrt().mul(g)
        clip = (u.norm(2).to(SCALAR_DTYPE) / (u.numel() ** 0.5 * d)).clamp(min=1.0)
        return u / clip, ScaleByFactoredRmsState(count, row_var, col_var, variance)

    return leafwise(ScaleByFactoredRmsState, init_leaf, update_leaf, name="scale_by_factored_rms", per_tensor=True)


class ScaleByRelativeStepSizeState(NamedTuple):
    """Per tensor: ``count``."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax


def scale_by_relative_step_size(lr: float = 1e-2, eps2: float = 1e-3) -> GradientTransformation:
    """``u = max(eps2, RMS(p)) * min(lr, 1/sqrt(t)) * g`` (module docstring).

    Args:
        lr: the cap of the relative step size ``min(lr, 1 / sqrt(t))``.
        eps2: the floor of the parameter's RMS, so that parameters at (or near) zero still move.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByRelativeStepSizeState`; its
        ``update`` needs the parameters.

    Example::

        tx = fb.chain(fb.scale_by_factored_rms(), fb.scale_by_relative_step_size(1e-2), fb.scale(-1.0))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByRelativeStepSizeState:
        return ScaleByRelativeStepSizeState(zero_count(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByRelativeStepSizeState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByRelativeStepSizeState]:
        count = s.count + 1
        rho = as_scalar(count).rsqrt().clamp(max=lr)
        assert p is not None  # needs_params: update gets the parameters
        param_rms = p.norm(2).to(SCALAR_DTYPE) / p.numel() ** 0.5
        return g * (param_rms.clamp(min=eps2) * rho), ScaleByRelativeStepSizeState(count)

    return leafwise(
        ScaleByRelativeStepSizeState,
        init_leaf,
        update_leaf,
        name="scale_by_relative_step_size",
        needs_params=True,
        per_tensor=True,
    )
