"""ADOPT (Taniguchi et al., 2024, "ADOPT: Modified Adam Can Converge with Any beta2"), as the
authors' ``torch-adopt`` package computes it.

The second moment of the *previous* gradients normalizes the new one, before the momentum
averages it (Adam normalizes after), and the first gradient only initializes it::

    t = 1:   v_1 = g_1^2,   m_1 = 0,   u_1 = 0
    t > 1:   n_t = clip(g_t / max(sqrt(v_{t-1}), eps),  c(t - 1))     (c(s) = s^0.25; clip to [-c, c])
             m_t = lerp(m_{t-1}, n_t, 1 - b1)
             v_t = b2 v_{t-1} + (1 - b2) g_t^2
             u_t = m_t (+ weight_decay * p_t, decoupled)

The decoupled decay is part of the rule because the reference starts it at the second step,
with the update: a plain :func:`~functional_bagua.add_decayed_weights` after it would decay the
parameters at the first step too.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union, cast

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.foreach import updated
from functional_bagua.numerics import (
    as_scalar,
    eager_number,
    eager_numbers,
    is_number,
    lerp_weight,
    number_now,
    zero_count,
)
from functional_bagua.transforms.leafwise import leafwise

Scalar = Union[float, torch.Tensor]


def fourth_root(step: torch.Tensor) -> torch.Tensor:
    """ADOPT's default clipping bound ``c(s) = s^0.25`` (``s`` the steps taken before this one)."""
    return step**0.25


class ScaleByAdoptState(NamedTuple):
    """Per tensor: ``count`` (steps taken), ``mu`` (momentum of normalized gradients), ``nu``
    (second moment of the gradients)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor


def scale_by_adopt(
    b1: Scalar = 0.9,
    b2: Scalar = 0.9999,
    eps: Scalar = 1e-6,
    clip: Optional[Callable[[torch.Tensor], Scalar]] = fourth_root,
    weight_decay: Scalar = 0.0,
) -> GradientTransformation:
    """ADOPT's direction (module docstring).

    Args:
        b1: the decay rate of the momentum of normalized gradients.
        b2: the decay rate of the second moment.
        eps: the smallest root of the second moment the gradient is divided by; must be > 0
            (the second moment is 0 wherever every gradient so far was 0).
        clip: ``c(s)``, the bound on the normalized gradient at the step after ``s`` steps, a
            function of a float64 0-dim tensor (default ``s ** 0.25``, the reference's
            ``clip_lambda``); ``None`` for no clipping.
        weight_decay: decoupled weight decay added to the direction from the second step on
            (``u_t = m_t + weight_decay * p_t``); needs ``params`` when not 0.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByAdoptState`.

    Example::

        tx = fb.chain(fb.scale_by_adopt(), fb.scale_by_learning_rate(1e-3))
    """
    if is_number(eps) and not eps > 0:
        raise ValueError(
            f"scale_by_adopt: eps must be > 0, got {eps}: ADOPT divides by max(sqrt(v), eps), and v is 0 "
            "wherever every gradient so far was 0"
        )
    decays = not (is_number(weight_decay) and weight_decay == 0)

    def init_leaf(p: torch.Tensor) -> ScaleByAdoptState:
        return ScaleByAdoptState(zero_count(p), torch.zeros_like(p), torch.zeros_like(p))

    def moments(g: Any, s: ScaleByAdoptState) -> tuple:
        """The new state, this step's factors ``(later, kept, 1 - kept)`` as numbers where they
        are numbers now (read before the state is overwritten), else ``None``, and ``later``."""
        steps_before = as_scalar(s.count)
        later = (s.count > 0).to(steps_before.dtype)  # 0 at the first step, which only initializes v
        kept = b2 * later  # v_1 = g_1^2: nothing of v_0 kept, the whole square taken
        numbers = eager_numbers((later, kept, 1 - kept), g)  # before any state is overwritten
        normalized = g / s.nu.sqrt().clamp_min_(eps)  # in place on the new tensors: the same bits
        if clip is not None:  # c(0) = 0 at the first step: nothing of g / eps enters the momentum
            bound = clip(steps_before)
            if isinstance(bound, torch.Tensor):  # in the gradient's dtype: a 0-dim one would be promoted
                bound = bound.to(normalized.dtype)
            normalized = normalized.clamp_(-bound, bound)  # a number or a 0-dim tensor
        else:  # g / eps may overflow a low-precision dtype at the first step: never let it in
            normalized = torch.where(s.count > 0, normalized, 0.0)
        mu = updated(s.mu, "lerp", normalized, lerp_weight((1 - b1) * later, s.mu))
        if numbers is None:  # traced, or on a device: s.nu * kept + g g (1 - kept)
            nu = updated(s.nu, "mul", kept).add_(g * g * (1 - kept))
        else:  # eagerly on the CPU, as the reference: two passes, in the state's memory where it is given up
            nu = updated(s.nu, "mul", numbers[1]).addcmul_(g, g, value=numbers[2])  # 1 - b2 rounded once
        return ScaleByAdoptState(s.count + 1, mu, nu), numbers, later

    def direction(new: ScaleByAdoptState, p: Any) -> Any:
        """``u = m`` (``+ weight_decay p``, decoupled)."""
        if not decays or eager_number(weight_decay, new.mu) == 0:
            return new.mu
        return new.mu + cast(torch.Tensor, p) * weight_decay

    def update_leaf(
        g: torch.Tensor, s: ScaleByAdoptState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByAdoptState]:
        new, numbers, later = moments(g, s)
        u = direction(new, p)
        if numbers is not None and numbers[0] == 1:  # a later step, known eagerly: no pass multiplying by 1
            return u, new
        return u * later, new

    def write_leaf(g: Any, s: ScaleByAdoptState, p: Any, step: float) -> ScaleByAdoptState:
        """``p <- p + step u`` as the reference writes it: nothing at the first step, then
        ``p.add_(p, alpha=step wd)`` for a decoupled decay and ``p.add_(m, alpha=step)``
        (``fb.Optimizer``, eagerly)."""
        new, numbers, later = moments(g, s)
        decay = number_now(weight_decay) if decays else 0.0  # unrounded, as the reference's -lr * wd
        if numbers is None or decay is None:  # factors that are not numbers now: the update, then added
            p.add_(direction(new, p) * later, alpha=step)
        elif numbers[0] == 1:  # a later step (the first one only initializes v)
            if decay != 0:
                p.add_(p, alpha=step * decay)
            p.add_(new.mu, alpha=step)
        return new

    return leafwise(
        ScaleByAdoptState,
        init_leaf,
        update_leaf,
        name="scale_by_adopt",
        needs_params=decays,
        write_leaf=write_leaf,
        in_cache_chunks=True,
    )
