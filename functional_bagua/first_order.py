"""The newer first-order optimizers as aliases, with their reference packages' names and defaults.

Each is a chain of building blocks (:mod:`functional_bagua.transforms`) and matches its
reference step for step (where they differ, with missing gradients or several param groups,
the alias's docstring says how); every float hyperparameter may be a schedule (then the alias is built
through :func:`~functional_bagua.inject_hyperparams`)::

    tx = fb.schedule_free_adamw(lr=2.5e-3, warmup_steps=100)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = fb.apply_updates(params, updates)
    eval_params = fb.schedule_free_eval_params(state, params)
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union, cast

import optree
import torch

from functional_bagua.aliases import _check, _check_adam_like, _check_betas, _check_lr, _check_nonnegative, _decayed
from functional_bagua.base import GradientTransformation, chain
from functional_bagua.hyperparams import accepts_schedules
from functional_bagua.numerics import eager_number, is_number
from functional_bagua.transforms.adam import scale_by_adam, scale_by_bias_corrected_rms
from functional_bagua.transforms.ademamix import scale_by_ademamix
from functional_bagua.transforms.adopt import fourth_root, scale_by_adopt
from functional_bagua.transforms.laprop import scale_by_laprop
from functional_bagua.transforms.leafwise import stateless
from functional_bagua.transforms.learning_rate_free import scale_by_dadapt_adam, scale_by_prodigy
from functional_bagua.transforms.mars import scale_by_mars
from functional_bagua.transforms.scaling import ScalarOrSchedule, factor_of, negate_if, scale, scale_by_learning_rate
from functional_bagua.transforms.schedule_free import schedule_free
from functional_bagua.transforms.weight_decay import add_decayed_weights
from functional_bagua.transforms.wrappers import partition
from functional_bagua.tree import PyTree


@accepts_schedules(static_args=("warmup_steps",))
def schedule_free_adamw(
    lr: ScalarOrSchedule = 0.0025,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
) -> GradientTransformation:
    """Schedule-free AdamW (Defazio et al., 2024), as ``schedulefree.AdamWScheduleFree``: the
    averaging of :func:`~functional_bagua.schedule_free` on Adam's normalized gradient at ``y``::

        v_t = b2 v_{t-1} + (1 - b2) g_t^2
        d_t = g_t / (sqrt(v_t / (1 - b2^t)) + eps) + weight_decay * y_t
        z_{t+1} = z_t - lr_t d_t,   x and y as in schedule_free (b1 = betas[0])

    No learning-rate schedule is needed (``warmup_steps`` gives the linear warmup); evaluate at
    :func:`~functional_bagua.schedule_free_eval_params` (``fb.Optimizer``: ``optimizer.eval()``).

    Args:
        lr: the learning rate (the reference's default 0.0025).
        betas: ``(b1, b2)``: ``b1`` interpolates ``y`` between ``z`` and ``x``, ``b2`` is the decay
            rate of the second moment.
        eps: added to the root of the bias-corrected second moment.
        weight_decay: ``weight_decay * y`` added to the normalized gradient (as the reference).
        warmup_steps: linear warmup of the learning rate over this many steps.
        r: the power of the step number in the averaging weights.
        weight_lr_power: the power of the largest learning rate so far in the averaging weights.

    Returns:
        A GradientTransformation that needs ``params``.

    Example::

        tx = fb.schedule_free_adamw(lr=2.5e-3, warmup_steps=100, weight_decay=0.01)
        state = tx.init(params)
    """
    b1, b2 = betas
    _check_adam_like(lr, betas, eps, weight_decay)
    _check(
        b1, lambda v: v > 0.0, "schedule_free_adamw: betas[0] must lie in (0, 1) (x = (y - (1 - b1) z) / b1), got {}"
    )
    # weight decay at y, in the direction (add_decayed_weights is the identity at the number 0)
    direction = chain(scale_by_bias_corrected_rms(b2, eps), add_decayed_weights(weight_decay))
    return schedule_free(direction, lr, b1, warmup_steps, r, weight_lr_power)


@accepts_schedules(static_args=("warmup_steps",))
def schedule_free_sgd(
    lr: ScalarOrSchedule = 1.0,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
) -> GradientTransformation:
    """Schedule-free SGD (Defazio et al., 2024), as ``schedulefree.SGDScheduleFree``: the
    averaging of :func:`~functional_bagua.schedule_free` on the gradient at ``y``::

        d_t = g_t + weight_decay * y_t,   z_{t+1} = z_t - lr_t d_t,   x and y as in schedule_free

    Args:
        lr: the learning rate (the reference's default 1.0).
        momentum: ``b1``, the interpolation of ``y`` between ``z`` and ``x``, in ``(0, 1)``.
        weight_decay: ``weight_decay * y`` added to the gradient.
        warmup_steps: linear warmup of the learning rate over this many steps.
        r: the power of the step number in the averaging weights.
        weight_lr_power: the power of the largest learning rate so far in the averaging weights.

    Returns:
        A GradientTransformation that needs ``params``.

    Example::

        tx = fb.schedule_free_sgd(lr=1.0, momentum=0.9, warmup_steps=50)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check(momentum, lambda v: 0.0 < v < 1.0, "schedule_free_sgd: momentum must lie in (0, 1), got {}")
    _check_nonnegative(weight_decay, "weight_decay")
    return schedule_free(add_decayed_weights(weight_decay), lr, momentum, warmup_steps, r, weight_lr_power)


@accepts_schedules(static_args=("clip_lambda",))
def adopt(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.9999),
    eps: float = 1e-6,
    clip_lambda: Optional[Callable[[torch.Tensor], Union[float, torch.Tensor]]] = fourth_root,
    weight_decay: float = 0.0,
    decouple: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """ADOPT (Taniguchi et al., 2024), as the authors' ``torch-adopt`` package (``adopt.ADOPT``):
    the direction of :func:`~functional_bagua.scale_by_adopt`, ``p <- p - lr * u``. The first step
    only initializes the second moment (the parameters do not move).

    Args:
        lr: the learning rate.
        betas: ``(b1, b2)``: the decay rates of the momentum and of the second moment.
        eps: the smallest root of the second moment a gradient is divided by (> 0).
        clip_lambda: the clipping bound of the normalized gradient, a function of the steps taken
            before (a float64 0-dim tensor; default ``s ** 0.25``); ``None`` for none.
        weight_decay: with ``decouple``, decoupled decay ``p <- p - lr * weight_decay * p`` from the
            second step on; else an L2 penalty ``weight_decay * p`` added to the gradient.
        decouple: decoupled (AdamW-like) weight decay instead of the L2 penalty.
        maximize: ascend the objective.

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adopt(lr=1e-3, weight_decay=0.01, decouple=True)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    b1, b2 = betas
    if decouple:
        return chain(
            negate_if(maximize), scale_by_adopt(b1, b2, eps, clip_lambda, weight_decay), scale_by_learning_rate(lr)
        )
    return chain(
        negate_if(maximize),
        add_decayed_weights(weight_decay),
        scale_by_adopt(b1, b2, eps, clip_lambda),
        scale_by_learning_rate(lr),
    )


@accepts_schedules(static_args=("t_alpha_beta3",))
def ademamix(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
    alpha: float = 5.0,
    t_alpha_beta3: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decouple: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """AdEMAMix (Pagliardini et al., 2024), as pytorch-optimizer's ``AdEMAMix`` (its names and
    defaults): the direction of :func:`~functional_bagua.scale_by_ademamix`, ``p <- p - lr * u``.

    Args:
        lr: the learning rate.
        betas: ``(b1, b2, b3)``: the fast momentum's, the second moment's and the slow momentum's
            decay rates.
        alpha: the weight of the slow momentum.
        t_alpha_beta3: the warmup of ``alpha`` and ``b3`` in steps (``None``: none).
        eps: added to the bias-corrected root of the second moment.
        weight_decay: with ``weight_decouple``, ``p <- p - lr * weight_decay * p``; else an L2
            penalty added to the gradient (the reference's default).
        weight_decouple: decoupled weight decay instead of the L2 penalty.
        maximize: ascend the objective.

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.ademamix(lr=1e-3, t_alpha_beta3=10_000, weight_decay=0.1, weight_decouple=True)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    _check_nonnegative(alpha, "alpha")
    if t_alpha_beta3 is not None and not t_alpha_beta3 > 0:
        raise ValueError(f"ademamix: t_alpha_beta3 must be > 0 (a warmup in steps) or None, got {t_alpha_beta3}")
    b1, b2, b3 = betas
    return _decayed(
        scale_by_ademamix(b1, b2, b3, alpha, t_alpha_beta3, eps), weight_decay, weight_decouple, lr, maximize
    )


@accepts_schedules(static_args=("steps_before_using_centered",))
def laprop(
    lr: ScalarOrSchedule = 4e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-15,
    weight_decay: float = 0.0,
    centered: bool = False,
    steps_before_using_centered: int = 10,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """LaProp (Ziyin et al., 2020), as pytorch-optimizer's ``LaProp`` (its names and defaults):
    the step of :func:`~functional_bagua.scale_by_laprop`, then decoupled weight decay of the
    stepped parameters::

        p <- (p - u) (1 - lr weight_decay)

    (The reference's coupled weight decay, ``weight_decouple=False``, changes nothing: it adds to
    the gradient after the step; it is not offered.)

    Args:
        lr: the learning rate (inside the momentum: a changed rate reaches the step gradually).
        betas: ``(b1, b2)``: the decay rates of the momentum and of the second moment.
        eps: added to the root of the second moment.
        weight_decay: decoupled weight decay, applied after the step.
        centered: centered second moment (after ``steps_before_using_centered`` steps).
        steps_before_using_centered: the steps before a centered LaProp centers.
        maximize: ascend the objective.

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.laprop(lr=4e-4, weight_decay=0.01)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    b1, b2 = betas
    rate = cast(Union[float, torch.Tensor], lr)  # a schedule arrives here as a tensor (accepts_schedules)
    direction = scale_by_laprop(rate, b1, b2, eps, 1e-15, centered, steps_before_using_centered)
    return chain(negate_if(maximize), direction, _stepped_then_decayed(rate, weight_decay))


def _stepped_then_decayed(
    lr: Union[float, torch.Tensor], weight_decay: Union[float, torch.Tensor]
) -> GradientTransformation:
    """``p <- (p - u) (1 - lr wd)`` as one update: ``-(1 - lr wd) u - lr wd p``."""
    if is_number(weight_decay) and weight_decay == 0:
        return factor_of(stateless(lambda u, p: -u, name="laprop", in_place=lambda u, p: u.neg_()), lambda: -1.0)

    def stepped(u: torch.Tensor, p: Optional[torch.Tensor]) -> torch.Tensor:
        assert p is not None  # needs_params
        if eager_number(weight_decay, u) == 0:  # a held 0 (fb.Optimizer's factory form): no decay term
            return -u
        decay = lr * weight_decay
        return u * -(1 - decay) - p * decay

    tx = stateless(stepped, name="laprop", needs_params=True)
    # p <- (p - u) (1 - wd lr): fb.Optimizer writes the direction's step, then multiplies, as the reference
    tx.update.scaled_after = lambda: (-1.0, 1.0 - weight_decay * lr)  # type: ignore[attr-defined]
    return tx


@accepts_schedules(static_args=("optimize_1d",))
def mars_adamw(
    lr: ScalarOrSchedule = 3e-3,
    betas: tuple[float, float] = (0.95, 0.99),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    gamma: float = 0.025,
    optimize_1d: bool = False,
    lr_1d: float = 3e-3,
    betas_1d: tuple[float, float] = (0.9, 0.95),
    weight_decay_1d: float = 0.1,
) -> GradientTransformation:
    """MARS-AdamW (Yuan et al., 2024), as the authors' ``MARS`` (``mars_type="mars-adamw"``, the
    approximate MARS): AdamW on the corrected, clipped gradients of
    :func:`~functional_bagua.scale_by_mars` (``gamma``, ``b1``), for the 2-D tensors; the others
    (biases, norms, and, as the authors' code decides by ``ndim == 2``, convolution kernels) get
    plain AdamW with ``lr_1d``, ``betas_1d``, ``weight_decay_1d``, unless ``optimize_1d``::

        p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)     (moments of c_t)

    With ``optimize_1d=False`` the choice is by shape (a :func:`~functional_bagua.partition`),
    which a fused update over flat buffers cannot make: fuse with ``optimize_1d=True``, or
    partition first.

    Args:
        lr: the learning rate of the MARS tensors.
        betas: ``(b1, b2)`` of the MARS tensors; ``b1`` also scales the correction.
        eps: added to the bias-corrected root of the second moment.
        weight_decay: decoupled weight decay of the MARS tensors.
        gamma: the strength of the gradient correction.
        optimize_1d: MARS for every tensor, with ``lr``, ``betas`` and ``weight_decay``.
        lr_1d: the learning rate of the other tensors (the authors' code scales it with ``lr``'s
            schedule, ``lr_t * lr_1d / lr_0``: with a schedule, give ``lr_1d`` one too).
        betas_1d: their AdamW betas.
        weight_decay_1d: their decoupled weight decay.

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.mars_adamw(lr=3e-3, weight_decay=0.1)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    _check_nonnegative(gamma, "gamma")
    b1, b2 = betas
    corrected = chain(
        scale_by_mars(gamma, b1),
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )
    if optimize_1d:
        return corrected
    _check_lr(lr_1d)
    _check_betas(betas_1d)
    _check_nonnegative(weight_decay_1d, "weight_decay_1d")
    plain = _decayed(scale_by_adam(*betas_1d, eps), weight_decay_1d, True, lr_1d, False)
    return partition({"mars": corrected, "adamw": plain}, _mars_or_adamw)


def _mars_or_adamw(params: PyTree) -> PyTree:
    return optree.tree_map(lambda p: "mars" if p is not None and p.dim() == 2 else "adamw", params, none_is_leaf=True)


def _check_estimated(
    who: str,
    lr: ScalarOrSchedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    d0: float,
    growth_rate: float,
) -> None:
    """The checks the learning-rate-free references make (``lr`` 0 allowed: a step at lr 0 moves
    nothing, as the references skip a group at lr 0)."""
    _check_lr(lr)
    _check(eps, lambda v: v > 0.0, "Invalid epsilon value: {}")
    _check_betas(betas)
    _check_nonnegative(weight_decay, "weight_decay")
    _check(d0, lambda v: v > 0.0, "Invalid d0 value: {}")
    _check(growth_rate, lambda v: v >= 1.0, f"{who}: growth_rate must be >= 1 (d never shrinks), got " + "{}")


@accepts_schedules(static_args=("decouple", "use_bias_correction", "safeguard_warmup"))
def prodigy(
    lr: ScalarOrSchedule = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    beta3: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decouple: bool = True,
    use_bias_correction: bool = False,
    safeguard_warmup: bool = False,
    d0: float = 1e-6,
    d_coef: float = 1.0,
    growth_rate: float = math.inf,
) -> GradientTransformation:
    """Prodigy (Mishchenko & Defazio, 2024), as the authors' ``prodigyopt.Prodigy`` (its names and
    defaults; every tensor stepped, ``slice_p=1``): Adam whose step size ``d`` is estimated from
    the distance travelled (:func:`~functional_bagua.scale_by_prodigy`); leave ``lr`` at 1.

    Args:
        lr: a multiplier of the estimated step size (a schedule scales it, as in the reference).
        betas: ``(b1, b2)``, Adam's decay rates.
        beta3: the decay rate of the estimate's sums (``None``: ``sqrt(b2)``).
        eps: added to the root of the second moment (times ``d``).
        weight_decay: decoupled (``decouple``) decay ``d lr weight_decay p``, or an L2 penalty
            added to the gradient.
        decouple: decoupled weight decay (the reference's default) instead of the L2 penalty.
        use_bias_correction: Adam's bias correction in the step size.
        safeguard_warmup: leave ``lr`` out of the estimate's denominator (for a warmup of ``lr``).
        d0: the initial estimate of ``d`` (> 0).
        d_coef: a multiplier of every estimate (> 0).
        growth_rate: the largest factor ``d`` may grow by in a step.

    Returns:
        A GradientTransformation that needs ``params``. In ``fb.Optimizer`` each param group
        estimates its own ``d`` (the reference shares one among its groups): for one estimate
        over parameters of several weight decays, give a :func:`~functional_bagua.partition` of
        building blocks to one group rather than several groups.

    Example::

        tx = fb.prodigy(weight_decay=0.01, safeguard_warmup=True, use_bias_correction=True)
        state = tx.init(params)
    """
    _check_estimated("prodigy", lr, betas, eps, weight_decay, d0, growth_rate)
    _check(d_coef, lambda v: v > 0.0, "prodigy: d_coef must be > 0 (it multiplies every estimate of d), got {}")
    b1, b2 = betas
    rate = cast(Union[float, torch.Tensor], lr)  # a schedule arrives here as a tensor (accepts_schedules)
    decoupled = weight_decay if decouple else 0.0
    step = scale_by_prodigy(
        rate, b1, b2, beta3, eps, decoupled, use_bias_correction, safeguard_warmup, d0, d_coef, growth_rate
    )
    return chain(add_decayed_weights(0.0 if decouple else weight_decay), step, scale(-1.0))


@accepts_schedules(static_args=("decouple", "use_bias_correction"))
def dadapt_adam(
    lr: ScalarOrSchedule = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decouple: bool = False,
    use_bias_correction: bool = False,
    d0: float = 1e-6,
    growth_rate: float = math.inf,
) -> GradientTransformation:
    """D-Adaptation Adam (Defazio & Mishchenko, 2023), as the authors' ``dadaptation.DAdaptAdam``
    (its names and defaults, ``layer_scale=1``): Adam whose step size ``d`` is estimated in the
    state (:func:`~functional_bagua.scale_by_dadapt_adam`); leave ``lr`` at 1.

    Args:
        lr: a multiplier of the estimated step size.
        betas: ``(b1, b2)``, Adam's decay rates.
        eps: added to the root of the second moment.
        weight_decay: an L2 penalty added to the gradient (the reference's default), or decoupled
            decay ``d lr weight_decay p`` with ``decouple``.
        decouple: decoupled weight decay instead of the L2 penalty.
        use_bias_correction: Adam's bias correction in the step size.
        d0: the initial estimate of ``d`` (> 0).
        growth_rate: the largest factor ``d`` may grow by in a step.

    Returns:
        A GradientTransformation that needs ``params``; in ``fb.Optimizer`` each param group
        estimates its own ``d`` (the reference shares one among its groups).

    Example::

        tx = fb.dadapt_adam(weight_decay=0.01, decouple=True)
        state = tx.init(params)
    """
    _check_estimated("dadapt_adam", lr, betas, eps, weight_decay, d0, growth_rate)
    b1, b2 = betas
    rate = cast(Union[float, torch.Tensor], lr)
    decoupled = weight_decay if decouple else 0.0
    step = scale_by_dadapt_adam(rate, b1, b2, eps, decoupled, use_bias_correction, d0, growth_rate)
    return chain(add_decayed_weights(0.0 if decouple else weight_decay), step, scale(-1.0))
