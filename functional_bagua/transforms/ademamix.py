"""AdEMAMix (Pagliardini et al., 2024, "The AdEMAMix Optimizer: Better, Faster, Older"), as
pytorch-optimizer's ``AdEMAMix`` computes it.

Adam's fast momentum plus a slow one (``b3`` close to 1) that remembers old gradients, weighted
by ``alpha``; both may warm up over ``T = t_alpha_beta3`` steps::

    alpha_t = min(t alpha / T, alpha)                                  (alpha without T)
    b3_t    = min(exp(ln b1 ln b3 / ((1 - t/T) ln b3 + (t/T) ln b1)), b3)   (b3 without T)
    m1_t = lerp(m1_{t-1}, g_t, 1 - b1)     v_t = b2 v_{t-1} + (1 - b2) g_t^2
    m2_t = lerp(m2_{t-1}, g_t, 1 - b3_t)
    u_t  = (m1_t / (1 - b1^t) + alpha_t m2_t) / (sqrt(v_t) / sqrt(1 - b2^t) + eps)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Union

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.foreach import updated
from functional_bagua.numerics import as_scalar, eager_numbers, lerp_weight, zero_count
from functional_bagua.transforms.adam import bias_correction, first_moment, second_moment
from functional_bagua.transforms.leafwise import leafwise

Scalar = Union[float, torch.Tensor]


class ScaleByAdemamixState(NamedTuple):
    """Per tensor: ``count``, ``mu`` (fast momentum ``m1``), ``nu`` (second moment), ``mu_slow``
    (slow momentum ``m2``)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor
    mu_slow: torch.Tensor


def alpha_at(t: torch.Tensor, alpha: Scalar, warmup: Optional[float]) -> Scalar:
    """``alpha_t``: linear from 0 to ``alpha`` over ``warmup`` steps (``alpha`` without one)."""
    return alpha if warmup is None else torch.clamp(t * alpha / warmup, max=alpha)


def b3_at(t: torch.Tensor, b1: Scalar, b3: Scalar, warmup: Optional[float]) -> Scalar:
    """``b3_t``: from ``b1`` to ``b3`` over ``warmup`` steps, so that the slow momentum's half
    life grows linearly (``b3`` without a warmup)."""
    if warmup is None:
        return b3
    log_b1, log_b3 = _log(b1), _log(b3)
    fraction = t / warmup
    return torch.clamp(torch.exp(log_b1 * log_b3 / ((1.0 - fraction) * log_b3 + fraction * log_b1)), max=b3)


def _log(x: Scalar) -> Scalar:
    return math.log(x) if not isinstance(x, torch.Tensor) else torch.log(x)


def scale_by_ademamix(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    b3: Scalar = 0.9999,
    alpha: Scalar = 5.0,
    t_alpha_beta3: Optional[float] = None,
    eps: Scalar = 1e-8,
) -> GradientTransformation:
    """AdEMAMix's direction (module docstring).

    Args:
        b1: the decay rate of the fast momentum ``m1`` (bias-corrected).
        b2: the decay rate of the second moment.
        b3: the decay rate of the slow momentum ``m2`` (not bias-corrected).
        alpha: the weight of the slow momentum.
        t_alpha_beta3: the warmup ``T`` of ``alpha`` and ``b3`` in steps; ``None`` for none.
        eps: added to the bias-corrected root of the second moment.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByAdemamixState`.

    Example::

        tx = fb.chain(fb.scale_by_ademamix(t_alpha_beta3=10_000), fb.scale_by_learning_rate(1e-3))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByAdemamixState:
        return ScaleByAdemamixState(zero_count(p), torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p))

    def moments(g: Any, s: ScaleByAdemamixState) -> tuple:
        """The new state and this step's factors: as numbers (read before the state is
        overwritten) where they are numbers now, else ``None`` beside them as tensors."""
        count = s.count + 1
        t = as_scalar(count)
        root_correction, correction = bias_correction(b2, t).sqrt(), bias_correction(b1, t)
        weight = alpha_at(t, alpha, t_alpha_beta3)
        numbers = eager_numbers((root_correction, correction, weight, eps), g)
        mu = first_moment(s.mu, g, b1)
        nu = second_moment(s.nu, g, b2)
        mu_slow = updated(s.mu_slow, "lerp", g, lerp_weight(1 - b3_at(t, b1, b3, t_alpha_beta3), s.mu_slow))
        return ScaleByAdemamixState(count, mu, nu, mu_slow), numbers, (root_correction, correction, weight)

    def update_leaf(
        g: torch.Tensor, s: ScaleByAdemamixState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByAdemamixState]:
        new, numbers, factors = moments(g, s)
        if numbers is None:  # traced, or on a device: the factors as tensors
            return with_tensors(new, factors), new
        numerator, denom = quotient(new, numbers)  # as the reference: in the rule's own temporaries
        return numerator.div_(denom), new

    def write_leaf(g: Any, s: ScaleByAdemamixState, p: Any, step: float) -> ScaleByAdemamixState:
        """``p <- p + step u`` as the reference writes it: ``p.addcdiv_(m1 / c1 + alpha m2,
        denom, value=step)`` (``fb.Optimizer``, eagerly)."""
        new, numbers, factors = moments(g, s)
        if numbers is None:  # factors that are not numbers now: the update, then added
            p.add_(with_tensors(new, factors), alpha=step)
        else:
            p.addcdiv_(*quotient(new, numbers), value=step)
        return new

    def quotient(new: ScaleByAdemamixState, numbers: list) -> tuple:
        """``m1 / c1 + alpha m2`` and ``sqrt(v) / sqrt(c2) + eps``, new tensors, the factors
        numbers (the weight an ``alpha``)."""
        root_now, correction_now, weight_now, eps_now = numbers
        denom = new.nu.sqrt().div_(root_now).add_(eps_now)
        return (new.mu / correction_now).add_(new.mu_slow, alpha=weight_now), denom

    def with_tensors(new: ScaleByAdemamixState, factors: tuple) -> Any:
        root_correction, correction, weight = factors
        denom = new.nu.sqrt().div(root_correction).add(eps)
        return (new.mu / correction).add(new.mu_slow * weight).div(denom)

    return leafwise(
        ScaleByAdemamixState,
        init_leaf,
        update_leaf,
        name="scale_by_ademamix",
        fresh_updates=True,
        write_leaf=write_leaf,
        in_cache_chunks=True,
    )
