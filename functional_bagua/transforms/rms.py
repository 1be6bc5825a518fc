"""Preconditioning by accumulated squared gradients: RMSprop, Adagrad, Adadelta.

Each returns the ascent direction; aliases finish with ``scale_by_learning_rate``.

``scale_by_rms(alpha, eps, centered)`` (Hinton's RMSprop, torch.optim.RMSprop)::

    s_t = alpha s_{t-1} + (1 - alpha) g_t^2
    c_t = lerp(c_{t-1}, g_t, 1 - alpha)                       (centered only)
    u_t = g_t / (sqrt(s_t - c_t^2) + eps)   (centered)    or    g_t / (sqrt(s_t) + eps)

``scale_by_adagrad(lr_decay, initial_accumulator_value, eps)`` (Duchi et al., 2011)::

    S_t = S_{t-1} + g_t^2,   S_0 = initial_accumulator_value
    u_t = g_t / (sqrt(S_t) + eps) / (1 + (t - 1) lr_decay)

``scale_by_adadelta(rho, eps)`` (Zeiler, 2012)::

    s_t = rho s_{t-1} + (1 - rho) g_t^2
    d_t = sqrt(D_{t-1} + eps) / sqrt(s_t + eps) * g_t
    D_t = rho D_{t-1} + (1 - rho) d_t^2
    u_t = d_t
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union, cast

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import (
    as_scalar,
    filled_like,
    is_number,
    lerp,
    zero_count,
)
from functional_bagua.transforms.adam import second_moment
from functional_bagua.transforms.leafwise import leafwise


class ScaleByRmsState(NamedTuple):
    """Per tensor: ``square_avg`` (``s``)."""

    square_avg: torch.Tensor


class ScaleByCenteredRmsState(NamedTuple):
    """Per tensor: ``square_avg`` (``s``) and ``grad_avg`` (``c``)."""

    square_avg: torch.Tensor
    grad_avg: torch.Tensor


_RmsState = Union[ScaleByRmsState, ScaleByCenteredRmsState]


def scale_by_rms(alpha: float = 0.99, eps: float = 1e-8, centered: bool = False) -> GradientTransformation:
    """RMSprop's direction (module docstring). Momentum composes after it::

        rmsprop_momentum = chain(scale_by_rms(), trace(0.9), scale_by_learning_rate(1e-2))

    Args:
        alpha: the decay rate of the average of squares ``s`` (and, when centered, of the
            gradient average ``c``).
        eps: added to the square root in the denominator (outside it).
        centered: with ``True``, the denominator uses the variance estimate ``s_t - c_t^2`` and the
            state keeps ``grad_avg``.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByRmsState`
        (a :class:`ScaleByCenteredRmsState` when centered).
    """
    state_type = ScaleByCenteredRmsState if centered else ScaleByRmsState

    def init_leaf(p: torch.Tensor) -> _RmsState:
        return state_type(*(torch.zeros_like(p) for _ in state_type._fields))

    def update_leaf(g: torch.Tensor, s: _RmsState, p: Optional[torch.Tensor]) -> tuple[torch.Tensor, _RmsState]:
        square_avg = second_moment(s.square_avg, g, alpha)
        new_state: _RmsState
        if centered:
            grad_avg = lerp(cast(ScaleByCenteredRmsState, s).grad_avg, g, 1 - alpha)
            rms = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt()
            new_state = ScaleByCenteredRmsState(square_avg, grad_avg)
        else:
            rms, new_state = square_avg.sqrt(), ScaleByRmsState(square_avg)
        return g / rms.add(eps), new_state

    return leafwise(state_type, init_leaf, update_leaf, name="scale_by_rms", fresh_updates=True)


class ScaleByAdagradState(NamedTuple):
    """Per tensor: ``count`` and ``sum_of_squares`` (``S``)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    sum_of_squares: torch.Tensor


def scale_by_adagrad(
    lr_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10
) -> GradientTransformation:
    """Adagrad's direction with torch's per-tensor learning-rate decay (module docstring).

    Args:
        lr_decay: the step decay: the direction is divided by ``1 + (t - 1) lr_decay``.
        initial_accumulator_value: ``S_0``, the value the sum of squares starts from.
        eps: added to ``sqrt(S_t)`` in the denominator.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByAdagradState`.

    Example::

        tx = fb.chain(fb.scale_by_adagrad(), fb.scale_by_learning_rate(1e-2))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByAdagradState:
        return ScaleByAdagradState(zero_count(p), filled_like(p, initial_accumulator_value))

    def update_leaf(
        g: torch.Tensor, s: ScaleByAdagradState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByAdagradState]:
        count = s.count + 1
        sum_of_squares = s.sum_of_squares.addcmul(g, g)
        u = g / sum_of_squares.sqrt().add(eps)
        if not (is_number(lr_decay) and lr_decay == 0):
            u = u / (1 + (as_scalar(count) - 1) * lr_decay)
        return u, ScaleByAdagradState(count, sum_of_squares)

    return leafwise(ScaleByAdagradState, init_leaf, update_leaf, name="scale_by_adagrad", fresh_updates=True)


class ScaleByAdadeltaState(NamedTuple):
    """Per tensor: ``square_avg`` (``s``) and ``acc_delta`` (``D``)."""

    square_avg: torch.Tensor
    acc_delta: torch.Tensor


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Adadelta's step (module docstring); torch.optim.Adadelta multiplies it by ``lr`` (1.0).

    Args:
        rho: the decay rate of both averages, of squared gradients ``s`` and of squared steps ``D``.
        eps: added inside both square roots, ``sqrt(D_{t-1} + eps)`` and ``sqrt(s_t + eps)``.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByAdadeltaState`.

    Example::

        tx = fb.chain(fb.scale_by_adadelta(), fb.scale_by_learning_rate(1.0))
    """

    def init_leaf(p: torch.Tensor) -> ScaleByAdadeltaState:
        return ScaleByAdadeltaState(torch.zeros_like(p), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByAdadeltaState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByAdadeltaState]:
        square_avg = second_moment(s.square_avg, g, rho)
        delta = s.acc_delta.add(eps).sqrt().div(square_avg.add(eps).sqrt()).mul(g)
        acc_delta = second_moment(s.acc_delta, delta, rho)
        return delta, ScaleByAdadeltaState(square_avg, acc_delta)

    return leafwise(ScaleByAdadeltaState, init_leaf, update_leaf, name="scale_by_adadelta", fresh_updates=True)
