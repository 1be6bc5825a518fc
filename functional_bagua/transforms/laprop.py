"""LaProp (Ziyin et al., 2020, "LaProp: Separating Momentum and Adaptivity in Adam"), as
pytorch-optimizer's ``LaProp`` computes it.

RMSprop's normalization first, then momentum over the normalized gradients (Adam does the two
the other way round), with the learning rate inside the momentum and the bias correction of
its running average (``lr_avg``: ``1 - b1^t`` for a constant rate)::

    v_t      = b2 v_{t-1} + (1 - b2) g_t^2
    c_t      = lerp(c_{t-1}, g_t, 1 - b2)                 (centered only)
    s_t      = v_t - c_t^2   (centered, after the first steps)    or    v_t
    d_t      = (sqrt(s_t + eps_root) + eps) / sqrt(1 - b2^t)
    m_t      = b1 m_{t-1} + (1 - b1) lr_t g_t / d_t
    lr_avg_t = b1 lr_avg_{t-1} + (1 - b1) lr_t
    u_t      = m_t / (lr_avg_t / lr_t)                    (m_t where lr_t = 0)

``u_t`` is the step itself (the learning rate is in it): finish with ``scale(-1)``, not a
learning rate.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union, cast

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.foreach import updated
from functional_bagua.numerics import SCALAR_DTYPE, as_scalar, eager_numbers, is_number, lerp, zero_count
from functional_bagua.transforms.adam import bias_correction, second_moment
from functional_bagua.transforms.leafwise import leafwise

Scalar = Union[float, torch.Tensor]


class ScaleByLapropState(NamedTuple):
    """Per tensor: ``count``, ``mu`` (momentum of normalized, lr-scaled gradients), ``nu``
    (second moment), ``lr_avg`` (running average of the learning rate, float64)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor
    lr_avg: torch.Tensor


class ScaleByCenteredLapropState(NamedTuple):
    """:class:`ScaleByLapropState` with ``grad_avg`` (the running mean ``c`` of the gradients)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor
    lr_avg: torch.Tensor
    grad_avg: torch.Tensor


_LapropState = Union[ScaleByLapropState, ScaleByCenteredLapropState]


def scale_by_laprop(
    learning_rate: Scalar = 4e-4,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-15,
    eps_root: Scalar = 1e-15,
    centered: bool = False,
    steps_before_using_centered: int = 10,
) -> GradientTransformation:
    """LaProp's step (module docstring): the learning rate is inside the momentum.

    Args:
        learning_rate: ``lr_t``, a number or a 0-dim tensor (a schedule through
            :func:`~functional_bagua.inject_hyperparams` or the alias).
        b1: the decay rate of the momentum (and of the learning rate's running average).
        b2: the decay rate of the second moment.
        eps: added to the root of the second moment.
        eps_root: added to the second moment inside the root (the reference's 1e-15).
        centered: subtract the square of the gradients' running mean from the second moment
            (after ``steps_before_using_centered`` steps).
        steps_before_using_centered: the steps during which a centered LaProp is not yet centered.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByLapropState`
        (:class:`ScaleByCenteredLapropState` when ``centered``).

    Example::

        tx = fb.chain(fb.scale_by_laprop(4e-4), fb.scale(-1.0))
    """
    state_type = ScaleByCenteredLapropState if centered else ScaleByLapropState

    def init_leaf(p: torch.Tensor) -> _LapropState:
        moments = (zero_count(p), torch.zeros_like(p), torch.zeros_like(p))
        lr_avg = torch.zeros((), dtype=SCALAR_DTYPE, device=p.device)
        if centered:
            return ScaleByCenteredLapropState(*moments, lr_avg, torch.zeros_like(p))
        return ScaleByLapropState(*moments, lr_avg)

    def update_leaf(g: torch.Tensor, s: _LapropState, p: Optional[torch.Tensor]) -> tuple[torch.Tensor, _LapropState]:
        new, step_size = stepped(g, s)
        return new.mu * step_size, new

    def write_leaf(g: Any, s: _LapropState, p: Any, alpha: float) -> _LapropState:
        """``p <- p + alpha u`` with ``u = mu step_size`` in one pass, ``p.add_(mu, alpha=alpha
        step_size)``, as the reference adds its momentum (``fb.Optimizer``, eagerly): one
        rounding fewer than forming ``u`` and adding it (the reference's bits, not the pure
        update's)."""
        new, step_size = stepped(g, s)
        if is_number(step_size):
            p.add_(new.mu, alpha=alpha * step_size)
        else:
            p.add_(new.mu * step_size, alpha=alpha)
        return new

    def stepped(g: Any, s: _LapropState) -> tuple[_LapropState, Scalar]:
        """The new state and the step size ``u = mu step_size`` takes (a number eagerly)."""
        count = s.count + 1
        t = as_scalar(count)
        lr_avg = s.lr_avg * b1 + (1 - b1) * learning_rate
        lr_now = torch.zeros_like(lr_avg) + learning_rate
        lr_bias = torch.where(lr_now != 0, lr_avg / torch.where(lr_now != 0, lr_now, 1.0), 1.0)
        root_correction, weight = bias_correction(b2, t).sqrt(), (1 - b1) * learning_rate
        step_size: Scalar = 1 / lr_bias
        numbers = eager_numbers((eps_root, eps, root_correction, weight, step_size), g)  # before nu is overwritten
        nu = second_moment(s.nu, g, b2)
        second = nu
        if centered:
            grad_avg = lerp(cast(ScaleByCenteredLapropState, s).grad_avg, g, 1 - b2)
            second = torch.where(count > steps_before_using_centered, nu - grad_avg * grad_avg, nu)
        if numbers is None:  # traced, or on a device: the factors as tensors
            denom = (second + eps_root).sqrt().add(eps).div(root_correction)
            mu = updated(s.mu, "mul", b1).add_((g / denom) * weight)  # s.mu b1 + ...
        else:  # as the reference, with numbers: in the rule's own temporaries, one fused addcdiv
            root_eps, eps_now, root_now, weight_now, step_now = numbers
            denom = (second + root_eps).sqrt_().add_(eps_now).div_(root_now)
            mu = updated(s.mu, "mul", b1).addcdiv_(g, denom, value=weight_now)
            step_size = step_now
        if centered:
            return ScaleByCenteredLapropState(count, mu, nu, lr_avg, grad_avg), step_size
        return ScaleByLapropState(count, mu, nu, lr_avg), step_size

    tx = leafwise(
        state_type,
        init_leaf,
        update_leaf,
        name="scale_by_laprop",
        fresh_updates=True,
        write_leaf=write_leaf,
        in_cache_chunks=True,
    )
    tx.update.takes_a_step = "scale_by_laprop"  # type: ignore[attr-defined]  # its updates hold the learning rate (direction.py)
    return tx
