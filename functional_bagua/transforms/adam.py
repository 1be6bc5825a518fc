"""Adam and its relatives: first and second moment estimates with bias correction.

All four return the *ascent direction* (no learning rate, no sign flip); aliases finish them
with ``scale_by_learning_rate``. Counts are per tensor, ``t = 1, 2, ...``; scalar factors are
float64, like torch.optim's Python floats.

``scale_by_adam`` (Kingma & Ba, 2015; AMSGrad: Reddi et al., 2018)::

    m_t = lerp(m_{t-1}, g_t, 1 - b1)             v_t = b2 v_{t-1} + (1 - b2) g_t^2
    v^max_t = max(v^max_{t-1}, v_t)              (amsgrad; used in place of v_t below)
    u_t = (m_t / (1 - b1^t)) / (sqrt(v_t) / sqrt(1 - b2^t) + eps)

``scale_by_bias_corrected_rms`` (Adam without its first moment, schedule-free AdamW's direction)::

    v_t = b2 v_{t-1} + (1 - b2) g_t^2            u_t = g_t / (sqrt(v_t / (1 - b2^t)) + eps)

``scale_by_adamax``::

    m_t = lerp(m_{t-1}, g_t, 1 - b1)             n_t = max(b2 n_{t-1}, |g_t| + eps)
    u_t = m_t / n_t / (1 - b1^t)

``scale_by_nadam`` (Dozat, 2016, with torch's momentum decay psi)::

    mu_t = b1 (1 - 0.5 * 0.96^(t psi))           P_t = prod_{i<=t} mu_i
    m_t, v_t as Adam                             d_t = sqrt(v_t / (1 - b2^t)) + eps
    u_t = (1 - mu_t) / (1 - P_t) * g_t / d_t + mu_{t+1} / (1 - P_t mu_{t+1}) * m_t / d_t

``scale_by_radam`` (Liu et al., 2020)::

    rho_inf = 2 / (1 - b2) - 1                   rho_t = rho_inf - 2 t b2^t / (1 - b2^t)
    r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
    u_t = m_hat_t * r_t * sqrt(1 - b2^t) / (sqrt(v_t) + eps)   if rho_t > 5   else   m_hat_t
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union, cast

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.foreach import updated
from functional_bagua.numerics import (
    as_scalar,
    eager_number,
    eager_numbers,
    holds_scalar_tensors,
    is_number,
    lerp_weight,
    zero_count,
)
from functional_bagua.transforms.leafwise import leafwise


def bias_correction(beta: Union[float, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """``1 - beta^t`` as a float64 scalar tensor (``t`` a float64 step count).

    Args:
        beta: the decay rate of a moment (``b1`` or ``b2``), a number or a 0-dim tensor.
        t: the step count ``t = 1, 2, ...`` as a 0-dim float64 tensor (see :func:`as_scalar`).

    Returns:
        The 0-dim tensor ``1 - beta**t``, the divisor that removes the bias of a moment started at zero.
    """
    return 1 - beta**t


def first_moment(mu: torch.Tensor, g: torch.Tensor, b1: Union[float, torch.Tensor]) -> torch.Tensor:
    """``lerp(mu, g, 1 - b1) = b1 mu + (1 - b1) g``, the new first moment (``b1`` a number or a
    0-dim tensor).

    Args:
        mu: the previous first-moment estimate (left unmodified, unless it is state its caller
            gave up: then the new one is computed in it, :func:`~functional_bagua.foreach.updated`).
        g: the gradient, of ``mu``'s shape.
        b1: the decay rate, the weight of ``mu``.

    Returns:
        The new first-moment estimate.
    """
    return updated(mu, "lerp", g, lerp_weight(1 - b1, mu))


def second_moment(v: torch.Tensor, g: torch.Tensor, b2: Union[float, torch.Tensor]) -> torch.Tensor:
    """``b2 v + (1 - b2) g^2`` (``b2`` a number or a 0-dim tensor).

    Args:
        v: the previous second-moment estimate (left unmodified, unless it is state its caller
            gave up: then the new one is computed in it, :func:`~functional_bagua.foreach.updated`).
        g: the gradient, of ``v``'s shape, whose square is averaged in.
        b2: the decay rate, the weight of ``v``; a number uses one fused ``addcmul``.

    Returns:
        The new second-moment estimate.
    """
    if not is_number(b2):
        weight, value = eager_number(b2, v), eager_number(1 - b2, v)
        if weight is None or value is None:  # traced, or on a device: the tensor as it is
            return updated(v, "mul", b2).add_((1 - b2) * g * g)  # v * b2 + (1 - b2) * g * g
        # eagerly on the CPU, the numbers the tensors round to, in the same roundings as the
        # compiled step's (so not addcmul's), each a multi-tensor op for grouped leaves
        return updated(v, "mul", weight).add_(g.mul(value).mul_(g))
    if torch.compiler.is_compiling():  # traced, torch decomposes addcmul_ into other roundings than addcmul's
        return v.mul(b2).addcmul(g, g, value=1 - b2)
    return updated(v, "mul", b2).addcmul_(g, g, value=1 - b2)  # in place on v.mul(b2): the same bits


def divided_root(v: torch.Tensor, divisor: Union[float, torch.Tensor]) -> torch.Tensor:
    """``sqrt(v) / divisor``, a new tensor; the root is divided in place where that gives the
    same numbers and autograd allows it.

    Args:
        v: the tensor whose square root is taken (left unmodified).
        divisor: a number or a 0-dim tensor.

    Returns:
        A new tensor of ``v``'s shape (float64 for a 0-dim ``v`` and a 0-dim float64 ``divisor``:
        0-dim by 0-dim arithmetic promotes, in place it could not).
    """
    root = v.sqrt()
    if torch.is_grad_enabled() and v.requires_grad or holds_scalar_tensors(root):  # autograd keeps sqrt's output
        return root / divisor
    return root.div_(divisor)


class ScaleByAdamState(NamedTuple):
    """Per tensor: ``count`` (steps taken), ``mu`` and ``nu`` (first and second moments)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor


class ScaleByAmsgradState(NamedTuple):
    """:class:`ScaleByAdamState` plus ``nu_max``, the running maximum of ``nu``."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor
    nu_max: torch.Tensor


_AdamState = Union[ScaleByAdamState, ScaleByAmsgradState]


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, amsgrad: bool = False
) -> GradientTransformation:
    """Adam's preconditioned direction (module docstring). Example::

        adam = chain(scale_by_adam(), scale_by_learning_rate(1e-3))

    Args:
        b1: the decay rate of the first moment ``m`` (the new gradient has weight ``1 - b1``);
            ``m`` is bias-corrected by ``1 - b1^t``.
        b2: the decay rate of the second moment ``v`` (the new squared gradient has weight
            ``1 - b2``); ``sqrt(v)`` is bias-corrected by ``sqrt(1 - b2^t)``.
        eps: added to the bias-corrected ``sqrt(v_t)`` in the denominator (outside the square root).
        amsgrad: with ``True``, the denominator uses ``v^max_t``, the running maximum of ``v``, kept
            in the state's ``nu_max`` field.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByAdamState`
        (a :class:`ScaleByAmsgradState` with ``amsgrad``).
    """
    state_type = ScaleByAmsgradState if amsgrad else ScaleByAdamState

    def init_leaf(p: torch.Tensor) -> _AdamState:
        moments = (zero_count(p), torch.zeros_like(p), torch.zeros_like(p))
        return ScaleByAmsgradState(*moments, torch.zeros_like(p)) if amsgrad else ScaleByAdamState(*moments)

    def update_leaf(g: torch.Tensor, s: _AdamState, p: Optional[torch.Tensor]) -> tuple[torch.Tensor, _AdamState]:
        count = s.count + 1
        t = as_scalar(count)
        mu = first_moment(s.mu, g, b1)
        nu = second_moment(s.nu, g, b2)
        new_state: _AdamState
        if amsgrad:
            nu_max = torch.maximum(cast(ScaleByAmsgradState, s).nu_max, nu)
            new_state = ScaleByAmsgradState(count, mu, nu, nu_max)
        else:
            nu_max, new_state = nu, ScaleByAdamState(count, mu, nu)
        denom = divided_root(nu_max, bias_correction(b2, t).sqrt()).add_(eps)
        return (mu / bias_correction(b1, t)).div_(denom), new_state

    return leafwise(state_type, init_leaf, update_leaf, name="scale_by_adam", fresh_updates=True)


class ScaleByBiasCorrectedRmsState(NamedTuple):
    """Per tensor: ``count`` (steps taken) and ``nu`` (the second moment)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    nu: torch.Tensor


def scale_by_bias_corrected_rms(b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """The gradient over the root of its bias-corrected second moment (module docstring): Adam's
    denominator without its first moment, as schedule-free AdamW normalizes its gradients.

    Args:
        b2: the decay rate of the second moment ``v``; ``v_t`` is divided by ``1 - b2^t``
            inside the root.
        eps: added to the root in the denominator.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByBiasCorrectedRmsState`.

    Example::

        tx = fb.schedule_free(fb.scale_by_bias_corrected_rms(0.999), lr=2.5e-3)
    """

    def init_leaf(p: torch.Tensor) -> ScaleByBiasCorrectedRmsState:
        return ScaleByBiasCorrectedRmsState(zero_count(p), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByBiasCorrectedRmsState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByBiasCorrectedRmsState]:
        count = s.count + 1
        correction = bias_correction(b2, as_scalar(count))
        numbers = eager_numbers((correction, eps), g)  # before nu is overwritten
        nu = second_moment(s.nu, g, b2)
        if numbers is None:  # traced, or on a device: the factors as tensors
            denom = nu.div(correction).sqrt().add(eps)
        else:  # the same numbers, in one new tensor (the reference's three passes)
            denom = nu.div(numbers[0]).sqrt_().add_(numbers[1])
        return g / denom, ScaleByBiasCorrectedRmsState(count, nu)

    return leafwise(
        ScaleByBiasCorrectedRmsState,
        init_leaf,
        update_leaf,
        name="scale_by_bias_corrected_rms",
        fresh_updates=True,
        in_cache_chunks=True,
    )


class ScaleByAdamaxState(NamedTuple):
    """Per tensor: ``count``, ``mu`` (first moment), ``nu`` (exponentially weighted infinity norm)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax's direction (module docstring).

    Args:
        b1: the decay rate of the first moment ``m``; the direction is divided by ``1 - b1^t``.
        b2: the decay rate of the infinity norm: ``n_t = max(b2 n_{t-1}, |g_t| + eps)``.
        eps: added to ``|g_t|`` inside the maximum, which keeps ``n_t`` positive.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByAdamaxState`.

    Example::

        tx = fb.chain(fb.scale_by_adamax(), fb.scale_by_learning_rate(2e-3))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByAdamaxState:
        return ScaleByAdamaxState(zero_count(p), torch.zeros_like(p), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByAdamaxState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByAdamaxState]:
        count = s.count + 1
        mu = first_moment(s.mu, g, b1)
        nu = torch.maximum(s.nu.mul(b2), g.abs().add(eps))
        u = mu / nu / bias_correction(b1, as_scalar(count))
        return u, ScaleByAdamaxState(count, mu, nu)

    return leafwise(ScaleByAdamaxState, init_leaf, update_leaf, name="scale_by_adamax", fresh_updates=True)


class ScaleByNadamState(NamedTuple):
    """Per tensor: ``count``, ``mu_product`` (``P_t``, float64), ``mu``, ``nu`` (moments)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu_product: torch.Tensor
    mu: torch.Tensor
    nu: torch.Tensor


def scale_by_nadam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, momentum_decay: float = 4e-3
) -> GradientTransformation:
    """NAdam's direction with torch.optim.NAdam's momentum schedule (module docstring).

    Args:
        b1: the decay rate of the first moment ``m``, and the base of the momentum schedule
            ``mu_t = b1 (1 - 0.5 * 0.96^(t psi))``.
        b2: the decay rate of the second moment ``v``.
        eps: added to ``sqrt(v_t / (1 - b2^t))`` in the denominator ``d_t``.
        momentum_decay: ``psi`` in the momentum schedule: larger values bring ``mu_t`` to ``b1``
            in fewer steps.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByNadamState`.

    Example::

        tx = fb.chain(fb.scale_by_nadam(), fb.scale_by_learning_rate(2e-3))
    """

    def momentum_at(t: torch.Tensor) -> torch.Tensor:
        return b1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))

    def init_leaf(p: torch.Tensor) -> ScaleByNadamState:
        one = torch.ones((), dtype=torch.float64, device=p.device)
        return ScaleByNadamState(zero_count(p), one, torch.zeros_like(p), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByNadamState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByNadamState]:
        count = s.count + 1
        t = as_scalar(count)
        mu_t, mu_next = momentum_at(t), momentum_at(t + 1)
        mu_product = s.mu_product * mu_t
        mu = first_moment(s.mu, g, b1)
        nu = second_moment(s.nu, g, b2)
        denom = nu.div(bias_correction(b2, t)).sqrt().add(eps)
        u = (g / denom) * ((1 - mu_t) / (1 - mu_product)) + (mu / denom) * (mu_next / (1 - mu_product * mu_next))
        return u, ScaleByNadamState(count, mu_product, mu, nu)

    return leafwise(ScaleByNadamState, init_leaf, update_leaf, name="scale_by_nadam", fresh_updates=True)


class ScaleByRadamState(NamedTuple):
    """Per tensor: ``count``, ``mu``, ``nu`` (moments)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor


def scale_by_radam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, threshold: float = 5.0
) -> GradientTransformation:
    """RAdam's rectified direction (module docstring); ``threshold`` is torch's 5 on ``rho_t``.

    Args:
        b1: the decay rate of the first moment ``m``; ``m_hat_t = m_t / (1 - b1^t)``.
        b2: the decay rate of the second moment ``v``; it also sets ``rho_inf = 2 / (1 - b2) - 1``.
        eps: added to ``sqrt(v_t)`` in the adaptive (rectified) step.
        threshold: the rectified adaptive step is taken where ``rho_t > threshold``; at or below
            it the direction is the plain ``m_hat_t``.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByRadamState`.

    Example::

        tx = fb.chain(fb.scale_by_radam(), fb.scale_by_learning_rate(1e-3))
    """
    rho_inf = 2 / (1 - b2) - 1

    def init_leaf(p: torch.Tensor) -> ScaleByRadamState:
        return ScaleByRadamState(zero_count(p), torch.zeros_like(p), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByRadamState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByRadamState]:
        count = s.count + 1
        t = as_scalar(count)
        mu = first_moment(s.mu, g, b1)
        nu = second_moment(s.nu, g, b2)
        bc2 = bias_correction(b2, t)
        mu_hat = mu / bias_correction(b1, t)
        rho_t = rho_inf - 2 * t * b2**t / bc2
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).clamp(min=0).sqrt()
        adaptive = bc2.sqrt() / nu.sqrt().add(eps)
        u = torch.where(rho_t > threshold, mu_hat * adaptive * rect, mu_hat)
        return u, ScaleByRadamState(count, mu, nu)

    return leafwise(ScaleByRadamState, init_leaf, update_leaf, name="scale_by_radam", fresh_updates=True)
