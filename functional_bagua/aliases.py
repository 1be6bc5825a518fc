"""Optimizers as chains of transforms, with torch.optim's argument names and defaults.

Each alias matches its torch.optim namesake step for step (same state per parameter, same
update, same ``maximize``/``weight_decay`` handling) and raises the ValueError torch.optim raises
for an invalid hyperparameter. ``lamb``, ``lars``, ``lion`` and ``adabelief`` follow their papers.

Every float hyperparameter may also be a schedule (a function of the step count); the alias is
then built through :func:`~functional_bagua.inject_hyperparams`.

Everything returns a :class:`~functional_bagua.GradientTransformation`::

    tx = fb.adamw(lr=1e-3, weight_decay=0.01)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = fb.apply_updates(params, updates)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union, cast

import optree
import torch

from functional_bagua import kernels, tree
from functional_bagua.base import GradientTransformation, OptState, chain, check_params
from functional_bagua.hyperparams import accepts_schedules, check_hyperparameter, checkable
from functional_bagua.layout_context import tensor_shapes
from functional_bagua.numerics import eager_number, is_number, read_counts
from functional_bagua.transforms.adam import (
    scale_by_adam,
    scale_by_adamax,
    scale_by_nadam,
    scale_by_radam,
)
from functional_bagua.transforms.asgd import scale_by_asgd
from functional_bagua.transforms.belief import scale_by_belief
from functional_bagua.transforms.factored import (
    scale_by_factored_rms,
    scale_by_relative_step_size,
)
from functional_bagua.transforms.leafwise import stateless
from functional_bagua.transforms.lion import scale_by_lion
from functional_bagua.transforms.momentum import ema_momentum, trace
from functional_bagua.transforms.orthogonalize import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    orthogonalize,
    scale_by_shape,
)
from functional_bagua.transforms.psgd_kron import scale_by_psgd_kron
from functional_bagua.transforms.rms import (
    scale_by_adadelta,
    scale_by_adagrad,
    scale_by_rms,
)
from functional_bagua.transforms.rprop import scale_by_rprop
from functional_bagua.transforms.scaling import (
    ScalarOrSchedule,
    negate_if,
    scale,
    scale_by_learning_rate,
)
from functional_bagua.transforms.shampoo import scale_by_shampoo
from functional_bagua.transforms.soap import scale_by_soap
from functional_bagua.transforms.sparse_adam import scale_by_sparse_adam
from functional_bagua.transforms.trust_ratio import scale_by_trust_ratio
from functional_bagua.transforms.weight_decay import add_decayed_weights
from functional_bagua.transforms.wrappers import masked
from functional_bagua.tree import PyTree

# --- validation, with torch.optim's messages -------------------------------------------------


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _known(*values: object) -> bool:
    """All Python numbers (fixed when the alias is built, as torch's fused kernels need them)."""
    return all(is_number(v) for v in values)


_check = check_hyperparameter  # the aliases' messages are torch.optim's


def _check_lr(lr: ScalarOrSchedule) -> None:
    _check(lr, lambda v: 0.0 <= v, "Invalid learning rate: {}")


def _check_nonnegative(value: ScalarOrSchedule, name: str) -> None:
    _check(value, lambda v: 0.0 <= v, f"Invalid {name} value: " + "{}")


def _check_eps(eps: ScalarOrSchedule) -> None:
    _check(eps, lambda v: 0.0 <= v, "Invalid epsilon value: {}")


def _check_betas(betas: Sequence[ScalarOrSchedule]) -> None:
    for i, beta in enumerate(betas):
        _check(beta, lambda v: 0.0 <= v < 1.0, f"Invalid beta parameter at index {i}: " + "{}")


def _check_adam_like(
    lr: ScalarOrSchedule, betas: Sequence[ScalarOrSchedule], eps: ScalarOrSchedule, weight_decay: ScalarOrSchedule
) -> None:
    _check_lr(lr)
    _check_eps(eps)
    _check_betas(betas)
    _check_nonnegative(weight_decay, "weight_decay")


def _decayed(
    preconditioner: GradientTransformation,
    weight_decay: Union[float, torch.Tensor],
    decoupled: bool,
    lr: ScalarOrSchedule,
    maximize: bool,
) -> GradientTransformation:
    """``maximize``, L2 (``decoupled=False``) or decoupled weight decay, around a preconditioner."""
    if decoupled:
        return chain(negate_if(maximize), preconditioner, add_decayed_weights(weight_decay), scale_by_learning_rate(lr))
    return chain(negate_if(maximize), add_decayed_weights(weight_decay), preconditioner, scale_by_learning_rate(lr))


# --- torch.optim --------------------------------------------------------------------------------


@accepts_schedules
def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with momentum, as ``torch.optim.SGD``::

        g <- -g (maximize);   g <- g + weight_decay * p
        b_1 = g;   b_t = momentum * b_{t-1} + (1 - dampening) * g;   d = g + momentum * b (nesterov) or b
        p <- p - lr * d

    Every float hyperparameter may also be a schedule, a function of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        momentum: momentum factor; 0 (the default) keeps no momentum buffer.
        dampening: dampening for momentum: the gradient enters the buffer scaled by ``1 - dampening``
            (except on the first step, where the buffer is the gradient itself).
        weight_decay: L2 penalty: ``weight_decay * p`` is added to the gradient.
        nesterov: use Nesterov momentum (``d = g + momentum * b``); needs ``momentum > 0`` and ``dampening == 0``.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.sgd(lr=0.1, momentum=0.9, nesterov=True)
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
    """
    _check_lr(lr)
    _check_nonnegative(momentum, "momentum")
    _check_nonnegative(weight_decay, "weight_decay")
    if nesterov:
        momentum_now, dampening_now = checkable(momentum), checkable(dampening)
        if momentum_now is not None and dampening_now is not None:
            _require(
                momentum_now > 0 and dampening_now == 0,
                "Nesterov momentum requires a momentum and zero dampening",
            )
    tx = chain(
        negate_if(maximize),
        add_decayed_weights(weight_decay),
        trace(momentum, dampening, nesterov),
        scale_by_learning_rate(lr),
    )
    if not _known(lr, momentum, dampening, weight_decay):
        return tx
    return kernels.tag(
        tx,
        "sgd",
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
    )


@accepts_schedules
def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam``: ``p <- p - lr * m_hat / (sqrt(v_hat) + eps)`` (see
    :func:`~functional_bagua.scale_by_adam`), with L2 weight decay added to the gradient, or
    decoupled (``p <- p - lr * weight_decay * p``) when ``decoupled_weight_decay``.

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: coefficients of the running averages of the gradient and of its square ``(b1, b2)``.
        eps: term added to the denominator ``sqrt(v_hat)`` for numerical stability.
        weight_decay: weight decay: an L2 penalty ``weight_decay * p`` added to the gradient, or decoupled
            weight decay when ``decoupled_weight_decay``.
        amsgrad: use the AMSGrad variant: the running maximum of the second moment in place of ``v``.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).
        decoupled_weight_decay: apply ``weight_decay`` as decoupled weight decay (``p <- p - lr * weight_decay * p``,
            as :func:`adamw`) instead of adding it to the gradient.

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adam(lr=1e-3, betas=(0.9, 0.99), amsgrad=True)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    tx = _decayed(scale_by_adam(*betas, eps, amsgrad), weight_decay, decoupled_weight_decay, lr, maximize)
    if not _known(lr, *betas, eps, weight_decay):
        return tx
    return kernels.tag(
        tx,
        "adamw" if decoupled_weight_decay else "adam",
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=amsgrad,
        maximize=maximize,
    )


@accepts_schedules
def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter), as ``torch.optim.AdamW``: Adam with decoupled weight decay::

        p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: coefficients of the running averages of the gradient and of its square ``(b1, b2)``.
        eps: term added to the denominator ``sqrt(v_hat)`` for numerical stability.
        weight_decay: decoupled weight decay coefficient: ``p <- p - lr * weight_decay * p``, not added to the
            gradient (default 1e-2, as torch.optim.AdamW).
        amsgrad: use the AMSGrad variant: the running maximum of the second moment in place of ``v``.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adamw(lr=fb.schedules.warmup_cosine_decay(0.0, 1e-3, 100, 1000), weight_decay=0.01)
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
    """
    return adam(lr, betas, eps, weight_decay, amsgrad, maximize=maximize, decoupled_weight_decay=True)


@accepts_schedules
def sparse_adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """SparseAdam, as ``torch.optim.SparseAdam``: Adam on the elements a sparse COO gradient holds
    (``nn.Embedding(sparse=True)``), the other elements and their moments untouched (see
    :func:`~functional_bagua.scale_by_sparse_adam`)::

        m_I <- m_I + (1 - b1)(g_I - m_I);   v_I <- v_I + (1 - b2)(g_I^2 - v_I)
        p_I <- p_I - lr sqrt(1 - b2^t) / (1 - b1^t) * m_I / (sqrt(v_I) + eps)

    Dense gradients raise a TypeError (use :func:`adam`); the updates are sparse COO tensors,
    which ``apply_updates`` adds to the dense parameters. Every float hyperparameter may also be a
    schedule.

    Args:
        lr: learning rate.
        betas: decays of the first and second moments.
        eps: added to ``sqrt(v)`` in the denominator.
        maximize: ascend the gradient instead.

    Returns:
        A GradientTransformation.

    Example::

        embedding = torch.nn.Embedding(1000, 16, sparse=True)
        tx = fb.sparse_adam(lr=1e-3)
        state = tx.init(fb.params_of(embedding))
    """
    _check_lr(lr)
    _check_eps(eps)
    _check_betas(betas)
    learning_rate = cast(Union[float, torch.Tensor], lr)  # a schedule arrives here as a tensor (accepts_schedules)
    return scale_by_sparse_adam(learning_rate, *betas, eps, maximize=maximize)


@accepts_schedules
def adamax(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adamax, as ``torch.optim.Adamax``: ``p <- p - lr * m / (1 - b1^t) / n`` with the infinity
    norm ``n_t = max(b2 n_{t-1}, |g| + eps)``.

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: coefficients ``(b1, b2)`` of the running average of the gradient and of the decay of the
            infinity norm ``n``.
        eps: term added to ``|g|`` in the infinity norm, for numerical stability.
        weight_decay: L2 penalty: ``weight_decay * p`` is added to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adamax(lr=2e-3)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    return _decayed(scale_by_adamax(*betas, eps), weight_decay, False, lr, maximize)


@accepts_schedules
def nadam(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum_decay: float = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """NAdam, as ``torch.optim.NAdam`` (see :func:`~functional_bagua.scale_by_nadam`).

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: coefficients of the running averages of the gradient and of its square ``(b1, b2)``.
        eps: term added to the denominator ``sqrt(v_hat)`` for numerical stability.
        weight_decay: weight decay: an L2 penalty ``weight_decay * p`` added to the gradient, or decoupled
            weight decay when ``decoupled_weight_decay``.
        momentum_decay: momentum decay ``psi`` of the momentum schedule ``mu_t = b1 (1 - 0.5 * 0.96^(t psi))``.
        decoupled_weight_decay: apply ``weight_decay`` as decoupled weight decay (``p <- p - lr * weight_decay * p``,
            as in AdamW; torch's NAdamW) instead of adding it to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.nadam(lr=2e-3, momentum_decay=4e-3)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    _check_nonnegative(momentum_decay, "momentum_decay")
    return _decayed(scale_by_nadam(*betas, eps, momentum_decay), weight_decay, decoupled_weight_decay, lr, maximize)


@accepts_schedules
def radam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """RAdam, as ``torch.optim.RAdam`` (see :func:`~functional_bagua.scale_by_radam`).

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: coefficients of the running averages of the gradient and of its square ``(b1, b2)``.
        eps: term added to the denominator ``sqrt(v)`` of the adaptive step for numerical stability.
        weight_decay: weight decay: an L2 penalty ``weight_decay * p`` added to the gradient, or decoupled
            weight decay when ``decoupled_weight_decay``.
        decoupled_weight_decay: apply ``weight_decay`` as decoupled weight decay (``p <- p - lr * weight_decay * p``,
            as in AdamW) instead of adding it to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.radam(lr=1e-3, weight_decay=1e-4, decoupled_weight_decay=True)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    return _decayed(scale_by_radam(*betas, eps), weight_decay, decoupled_weight_decay, lr, maximize)


@accepts_schedules
def adagrad(
    lr: ScalarOrSchedule = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adagrad, as ``torch.optim.Adagrad``::

        S_t = S_{t-1} + g^2;   p <- p - lr / (1 + (t - 1) lr_decay) * g / (sqrt(S_t) + eps)

    Every float hyperparameter may also be a schedule, a function of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        lr_decay: learning rate decay: step ``t`` (counted per tensor from 1) is divided by ``1 + (t - 1) lr_decay``.
        weight_decay: L2 penalty: ``weight_decay * p`` is added to the gradient.
        initial_accumulator_value: starting value ``S_0`` of the sum of squared gradients.
        eps: term added to the denominator ``sqrt(S_t)`` for numerical stability.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adagrad(lr=1e-2, initial_accumulator_value=0.1)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check_nonnegative(lr_decay, "lr_decay")
    _check_nonnegative(weight_decay, "weight_decay")
    _check_nonnegative(initial_accumulator_value, "initial_accumulator_value")
    _check_eps(eps)
    return _decayed(scale_by_adagrad(lr_decay, initial_accumulator_value, eps), weight_decay, False, lr, maximize)


@accepts_schedules
def adadelta(
    lr: ScalarOrSchedule = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adadelta, as ``torch.optim.Adadelta``: ``p <- p - lr * d_t`` (see
    :func:`~functional_bagua.scale_by_adadelta`).

    Every float hyperparameter may also be a schedule, a function of the step count, like ``lr``.

    Args:
        lr: coefficient that scales the step ``d_t`` (a number, a 0-dim tensor, or a schedule: a function of the
            step count).
        rho: coefficient of the running averages of the squared gradient and of the squared step.
        eps: term added inside both square roots of ``d_t`` for numerical stability.
        weight_decay: L2 penalty: ``weight_decay * p`` is added to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adadelta(lr=1.0, rho=0.9)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check(rho, lambda v: 0.0 <= v <= 1.0, "Invalid rho value: {}")
    _check_eps(eps)
    _check_nonnegative(weight_decay, "weight_decay")
    return _decayed(scale_by_adadelta(rho, eps), weight_decay, False, lr, maximize)


@accepts_schedules
def rmsprop(
    lr: ScalarOrSchedule = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """RMSprop, as ``torch.optim.RMSprop``::

        s_t = alpha s + (1 - alpha) g^2;   d = g / (sqrt(s_t [- c_t^2 if centered]) + eps)
        b_t = momentum b_{t-1} + d (if momentum > 0, else b_t = d);   p <- p - lr * b_t

    Every float hyperparameter may also be a schedule, a function of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        alpha: smoothing constant of the running average ``s`` of the squared gradient.
        eps: term added to the denominator for numerical stability.
        weight_decay: L2 penalty: ``weight_decay * p`` is added to the gradient.
        momentum: momentum factor applied to the normalized gradient ``d``; 0 (the default) keeps no buffer.
        centered: centered RMSprop: subtract the square of the running average ``c`` of the gradient from
            ``s``, normalizing by an estimate of the gradient's variance.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.rmsprop(lr=1e-2, alpha=0.99, momentum=0.9, centered=True)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check_eps(eps)
    _check_nonnegative(momentum, "momentum")
    _check_nonnegative(weight_decay, "weight_decay")
    _check_nonnegative(alpha, "alpha")
    return chain(
        negate_if(maximize),
        add_decayed_weights(weight_decay),
        scale_by_rms(alpha, eps, centered),
        trace(momentum),
        scale_by_learning_rate(lr),
    )


@accepts_schedules
def rprop(
    lr: float = 1e-2,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50),
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Rprop, as ``torch.optim.Rprop``: ``p <- p - sign(g') * h_t`` with per-element step sizes
    ``h`` starting at ``lr`` (see :func:`~functional_bagua.scale_by_rprop`).

    Every float hyperparameter (each element of ``etas`` and ``step_sizes`` included) may also be a
    schedule, a function of the step count.

    Args:
        lr: initial per-element step size ``h_0`` (a number, a 0-dim tensor, or a schedule: a function of the
            step count); the step sizes then adapt on their own, so only its value when the state is built counts.
        etas: ``(eta_minus, eta_plus)``: the factors that shrink the step size where the gradient's sign flips
            and grow it where it stays; ``0 < eta_minus < 1 < eta_plus``.
        step_sizes: ``(step_min, step_max)``: the bounds of the per-element step size.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.rprop(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50))
        state = tx.init(params)
    """
    _check_lr(lr)
    eta_minus, eta_plus = map(checkable, etas)
    if eta_minus is not None and eta_plus is not None:
        _require(0.0 < eta_minus < 1.0 < eta_plus, f"Invalid eta values: {etas[0]}, {etas[1]}")
    return chain(negate_if(maximize), scale_by_rprop(lr, etas, step_sizes), scale(-1.0))


@accepts_schedules
def asgd(
    lr: float = 1e-2,
    lambd: float = 1e-4,
    alpha: float = 0.75,
    t0: float = 1e6,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Averaged SGD, as ``torch.optim.ASGD`` (see :func:`~functional_bagua.scale_by_asgd`); the
    averaged parameters are in the state's ``ax`` field.

    Every float hyperparameter may also be a schedule, a function of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count): the step
            size ``eta`` starts at ``lr`` and decays as ``lr / (1 + lambd * lr * t)^alpha``.
        lambd: decay term: it sets the decay of ``eta`` and adds ``lambd * p`` to the gradient.
        alpha: power of the decay of ``eta``.
        t0: step at which averaging starts: the averaging weight is ``1 / max(1, t - t0)``.
        weight_decay: L2 penalty: ``weight_decay * p`` is added to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.asgd(lr=1e-2, t0=100.0)
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)   # averaged parameters: state[-1].ax
    """
    _check_lr(lr)
    _check_nonnegative(weight_decay, "weight_decay")
    return chain(negate_if(maximize), add_decayed_weights(weight_decay), scale_by_asgd(lr, lambd, alpha, t0))


@accepts_schedules
def adafactor(
    lr: float = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[Optional[float], float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adafactor, as ``torch.optim.Adafactor``::

        p <- p - max(eps2, RMS(p)) * min(lr, 1/sqrt(t)) * u_t - lr * weight_decay * p

    with ``u_t`` the factored, clipped direction of :func:`~functional_bagua.scale_by_factored_rms`.

    Every float hyperparameter (``eps2`` included) may also be a schedule, a function of the step count.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count): the upper
            bound of the relative step size ``min(lr, 1/sqrt(t))``; it also scales the weight decay.
        beta2_decay: exponent (at most 0) of the step: ``t^beta2_decay`` is the weight of the new squared
            gradient in the running averages of the second moment.
        eps: ``(eps1, eps2)``: ``eps1`` bounds the square root of the second-moment estimate from below
            (``None``: the machine epsilon of the parameter's dtype); ``eps2`` bounds from below the RMS of the
            parameter that scales the step.
        d: clipping threshold (at least 1): the direction is divided by ``max(1, RMS(u) / d)``.
        weight_decay: decoupled weight decay: ``p <- p - lr * weight_decay * p``, not added to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adafactor(lr=1e-2, weight_decay=0.01)
        state = tx.init(params)
    """
    eps1, eps2 = eps
    _check_lr(lr)
    _check(beta2_decay, lambda v: v <= 0.0, "beta2_decay should be <= 0 but is: {}")
    _check(eps1, lambda v: 0.0 <= v, "epsilon1 should be >= 0 but is: {}")
    _check(eps2, lambda v: 0.0 <= v, "epsilon2 should be >= 0 but is: {}")
    _check(d, lambda v: 1.0 <= v, "Clipping threshold d should be >= 1 but is: {}")
    _check(weight_decay, lambda v: 0.0 <= v, "weight_decay should be >= 0 but is: {}")
    return chain(
        negate_if(maximize),
        scale_by_factored_rms(beta2_decay, eps1, d),
        scale_by_relative_step_size(lr, eps2),
        add_decayed_weights(lr * weight_decay),
        scale(-1.0),
    )


@accepts_schedules
def muon(
    lr: ScalarOrSchedule = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: Optional[str] = None,
) -> GradientTransformation:
    """Muon, as ``torch.optim.Muon``, for 2-D parameters only::

        b_t = lerp(b_{t-1}, g, 1 - momentum);   B = lerp(g, b_t, momentum) (nesterov) or b_t
        p <- p - lr * (shape_factor(p) * NewtonSchulz(B) + weight_decay * p)

    Give the other parameters (biases, norms, embeddings) to another optimizer with
    :func:`functional_bagua.partition` or a second transform.

    Every float hyperparameter (each element of ``ns_coefficients`` included) may also be a schedule,
    a function of the step count. There is no ``maximize``, as in torch.optim.Muon.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        weight_decay: decoupled weight decay: ``p <- p - lr * weight_decay * p``, not added to the gradient.
        momentum: decay of the momentum buffer ``b_t = lerp(b_{t-1}, g, 1 - momentum)`` (from ``b_0 = 0``).
        nesterov: use Nesterov momentum: orthogonalize ``lerp(g, b_t, momentum)`` instead of ``b_t``.
        ns_coefficients: the coefficients ``(a, b, c)`` of the quintic Newton-Schulz iteration
            ``X <- a X + (b A + c A A) X`` with ``A = X X^T``.
        eps: lower bound of the Frobenius norm by which the update is divided before the iterations.
        ns_steps: number of Newton-Schulz iterations (less than 100).
        adjust_lr_fn: the shape factor for an ``A x B`` parameter: ``None`` or ``"original"``:
            ``sqrt(max(1, A / B))``; ``"match_rms_adamw"``: ``0.2 * sqrt(max(A, B))``.

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.muon(lr=0.02, weight_decay=0.1)
        state = tx.init(matrices)   # 2-D parameters only: init raises a ValueError otherwise
    """
    _check_lr(lr)
    _check(momentum, lambda v: 0.0 <= v, "momentum should be >= 0 but is: {}")
    _check(weight_decay, lambda v: 0.0 <= v, "weight decay should be >= 0 but is: {}")
    # torch.optim.Muon takes eps <= 0; a zero gradient's update (an unused layer's, gradients zeroed
    # in place) would then be 0 / 0
    _check(eps, lambda v: 0.0 < v, "Invalid epsilon value: {} (eps bounds the norm the update is divided by: > 0)")
    _require(
        adjust_lr_fn in (None, "original", "match_rms_adamw"),
        f"Adjust learning rate function {adjust_lr_fn} is not supported",
    )
    inner = chain(
        ema_momentum(momentum, nesterov),
        orthogonalize(ns_coefficients, ns_steps, eps),
        scale_by_shape(adjust_lr_fn),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )

    def init(params: PyTree) -> OptState:
        check_params(params, "muon")
        for key, shape in tensor_shapes(params):
            if len(shape) != 2:
                raise ValueError(
                    f"Muon only supports 2D parameters whereas we found a parameter with size: "
                    f"{torch.Size(shape)} ({key!r})"
                )
        return inner.init(params)

    return GradientTransformation(init, inner.update)


# --- beyond torch.optim ---------------------------------------------------------------------


@accepts_schedules
def lamb(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """LAMB (You et al., 2020), per tensor::

        r = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
        p <- p - lr * (||p|| / ||r||) * r          (ratio 1 if either norm is 0)

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: coefficients of the running averages of the gradient and of its square ``(b1, b2)``.
        eps: term added to the denominator ``sqrt(v_hat)`` for numerical stability.
        weight_decay: decoupled weight decay: ``weight_decay * p`` is added to the Adam direction (not to the
            gradient), before the trust ratio.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.lamb(lr=1e-3, weight_decay=0.01)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    return chain(
        negate_if(maximize),
        scale_by_adam(*betas, eps),
        add_decayed_weights(weight_decay),
        scale_by_trust_ratio(),
        scale_by_learning_rate(lr),
    )


@accepts_schedules
def lars(
    lr: ScalarOrSchedule = 1e-1,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    trust_coefficient: float = 1e-3,
    eps: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """LARS (You et al., 2017), per tensor, with optax's placement of momentum::

        r = g + weight_decay * p
        d = lr * trust_coefficient * ||p|| / (||r|| + eps) * r        (ratio 1 if a norm is 0)
        b_t = momentum * b_{t-1} + d   (b_1 = d);   p <- p - (d + momentum * b_t if nesterov else b_t)

    Every float hyperparameter may also be a schedule, a function of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        momentum: momentum factor, applied after the learning rate; 0 keeps no buffer.
        weight_decay: L2 penalty: ``weight_decay * p`` is added to the gradient, before the trust ratio.
        trust_coefficient: factor of the trust ratio ``||p|| / (||r|| + eps)``.
        eps: term added to ``||r||`` in the trust ratio's denominator.
        nesterov: use Nesterov momentum (``d + momentum * b_t``); needs ``momentum > 0``.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.lars(lr=0.1, momentum=0.9, weight_decay=1e-4)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check_nonnegative(momentum, "momentum")
    _check_nonnegative(weight_decay, "weight_decay")
    _check_eps(eps)
    if nesterov and (momentum_now := checkable(momentum)) is not None:
        _require(momentum_now > 0, "Nesterov momentum requires a momentum")
    return chain(
        negate_if(maximize),
        add_decayed_weights(weight_decay),
        scale_by_trust_ratio(trust_coefficient, eps),
        scale_by_learning_rate(lr),
        trace(momentum, nesterov=nesterov),
    )


@accepts_schedules
def lion(
    lr: ScalarOrSchedule = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Lion (Chen et al., 2023)::

        p <- p - lr * (sign(lerp(m, g, 1 - b1)) + weight_decay * p);   m <- lerp(m, g, 1 - b2)

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: ``(b1, b2)``: ``b1`` interpolates the momentum and the gradient for the sign of the update;
            ``b2`` is the decay of the momentum ``m``.
        weight_decay: decoupled weight decay: ``p <- p - lr * weight_decay * p``, not added to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.lion(lr=1e-4, weight_decay=0.1)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check_betas(betas)
    _check_nonnegative(weight_decay, "weight_decay")
    return _decayed(scale_by_lion(*betas), weight_decay, True, lr, maximize)


@accepts_schedules
def adabelief(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-16,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """AdaBelief (Zhuang et al., 2020): ``p <- p - lr * m_hat / (sqrt(s_hat) + eps)`` with the
    belief ``s`` of :func:`~functional_bagua.scale_by_belief`; weight decay as in :func:`adam`.

    Every float hyperparameter (each element of ``betas`` included) may also be a schedule, a function
    of the step count, like ``lr``.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: coefficients of the running averages of the gradient and of the belief ``(g - m)^2``.
        eps: term added to the belief ``s`` at each step and to the denominator ``sqrt(s_hat)``.
        weight_decay: weight decay: an L2 penalty ``weight_decay * p`` added to the gradient, or decoupled
            weight decay when ``decoupled_weight_decay``.
        decoupled_weight_decay: apply ``weight_decay`` as decoupled weight decay (``p <- p - lr * weight_decay * p``)
            instead of adding it to the gradient.
        maximize: maximize the objective instead of minimizing it (ascend the gradient).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.adabelief(lr=1e-3, weight_decay=1e-4, decoupled_weight_decay=True)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    return _decayed(scale_by_belief(*betas, eps), weight_decay, decoupled_weight_decay, lr, maximize)


# --- second order ---------------------------------------------------------------------------------


@accepts_schedules
def soap(
    lr: ScalarOrSchedule = 3e-3,
    betas: tuple[float, float] = (0.95, 0.95),
    shampoo_beta: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precondition_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_gradient: bool = False,
    correct_bias: bool = True,
    matrix_dtype: Optional[torch.dtype] = None,
    group: Optional[torch.distributed.ProcessGroup] = None,
) -> GradientTransformation:
    """SOAP (Vyas et al., 2024), as the authors' algorithm and pytorch-optimizer's ``SOAP``, with
    their defaults: Adam in the eigenbasis of Shampoo's preconditioner
    (:func:`~functional_bagua.scale_by_soap`), then decoupled weight decay applied after the step::

        p <- p - lr * u;   p <- p * (1 - lr * weight_decay)

    A tensor's first gradient only initializes its preconditioner: that step changes nothing (no
    decay either), as in the reference's first step. (The reference counts steps per group: a
    tensor whose first gradient comes later steps at once there, bias-corrected with the group's
    count; here each tensor counts its own.) Every float hyperparameter may also be a schedule.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: the decays ``(b1, b2)`` of the first and second moments.
        shampoo_beta: the decay of Shampoo's statistics (``None``: ``b2``).
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: decoupled weight decay, applied after the step (above).
        precondition_frequency: refresh the eigenbases every this many steps.
        max_precondition_dim: dimensions above it get no preconditioner.
        merge_dims: precondition a view with small neighbouring dimensions merged (conv kernels).
        precondition_1d: give vectors (biases, norms) a preconditioner too.
        normalize_gradient: divide the direction by its RMS.
        correct_bias: Adam's bias correction.
        matrix_dtype: the precision of ``eigh`` and QR (``None``: the reference's; see
            :func:`~functional_bagua.scale_by_soap`).
        group: share the eigendecompositions among the ranks of this process group, each
            computed by one (after ``allreduce_gradients``; see :func:`~functional_bagua.scale_by_soap`).

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.soap(lr=3e-3, weight_decay=0.01)
        state = tx.init(params)
    """
    _check_adam_like(lr, betas, eps, weight_decay)
    direction = scale_by_soap(
        betas[0],
        betas[1],
        shampoo_beta,
        eps,
        precondition_frequency,
        max_precondition_dim,
        merge_dims,
        precondition_1d,
        normalize_gradient,
        correct_bias,
        matrix_dtype,
        group,
    )
    learning_rate = cast(Union[float, torch.Tensor], lr)  # a schedule arrives here as a tensor (accepts_schedules)
    inner = chain(direction, _step_then_decay(learning_rate, weight_decay))

    def update(updates: PyTree, state: OptState, params: Optional[PyTree] = None) -> tuple[PyTree, OptState]:
        updates, new_state = inner.update(updates, state, params)
        stepped = new_state[0].count  # 1 after a tensor's first gradient, which only initializes
        return _zero_where_first(updates, stepped), new_state

    return GradientTransformation(inner.init, update)


def _step_then_decay(
    lr: Union[float, torch.Tensor], weight_decay: Union[float, torch.Tensor]
) -> GradientTransformation:
    """The step ``p - lr * u``, then its decay ``* (1 - lr * weight_decay)``, as one update::

    u <- -lr (1 - lr weight_decay) u - lr weight_decay p
    """

    def stepped(u: torch.Tensor, p: Optional[torch.Tensor]) -> torch.Tensor:
        assert p is not None  # needs_params: update gets the parameters
        decay = lr * weight_decay
        if is_number(decay):
            return torch.add(u * (-lr * (1 - decay)), p, alpha=-decay)
        if eager_number(decay, u) == 0:  # held at 0 (the factory form): no term, as the number 0 adds none
            return u * (-lr * (1 - decay))
        return u * (-lr * (1 - decay)) - decay * p

    if is_number(weight_decay) and weight_decay == 0:
        return scale_by_learning_rate(lr)
    return stateless(stepped, name="soap", needs_params=True)


def _zero_where_first(updates: PyTree, counts: PyTree) -> PyTree:
    """Each update, zero where its tensor has had only one gradient. ``counts`` holds one count
    per tensor, or inside :func:`fuse` one tuple of counts per flat buffer (all equal: a flat
    buffer's tensors step together). Eager, the counts are read at once (one device sync) and
    nothing more is done when every tensor is past its first; traced, the choice is made by
    ``torch.where``."""
    leaves, spec = tree.flatten(updates)
    per_update = tree.leaves_up_to(spec, counts, "the state's counts", "the updates")
    firsts = [None if u is None else _smallest(c) for u, c in zip(leaves, per_update)]
    known = [c for c in firsts if c is not None]
    if not torch.compiler.is_compiling() and all(count > 1 for count in read_counts(known)):
        return updates
    return spec.unflatten(
        [u if u is None or c is None else torch.where(c > 1, u, torch.zeros_like(u)) for u, c in zip(leaves, firsts)]
    )


def _smallest(counts: Any) -> Optional[torch.Tensor]:
    """The smallest of a tensor's count (0-dim) or a flat buffer's counts (a nest of tuples of
    1-D tensors), as a 0-dim tensor; ``None`` where there is none."""
    found = [c.reshape(-1) for c in optree.tree_leaves(counts)]
    if not found:
        return None
    return found[0].min() if len(found) == 1 else torch.cat(found).min()


@accepts_schedules
def shampoo(
    lr: ScalarOrSchedule = 1e-2,
    betas: tuple[float, float] = (0.9, 1.0),
    epsilon: float = 1e-12,
    weight_decay: float = 0.0,
    max_preconditioner_dim: int = 1024,
    precondition_frequency: int = 1,
    start_preconditioning_step: Optional[int] = None,
    merge_dims: bool = False,
    grafting: Optional[str] = None,
    grafting_beta2: float = 0.999,
    grafting_epsilon: float = 1e-10,
    use_bias_correction: bool = True,
    matrix_dtype: torch.dtype = torch.float64,
    group: Optional[torch.distributed.ProcessGroup] = None,
    root_method: str = "eigh",
    newton_iterations: int = 20,
    newton_tolerance: float = 1e-6,
) -> GradientTransformation:
    """Shampoo, with the defaults of the distributed-Shampoo reference (Meta's
    ``DistributedShampoo``): the direction of :func:`~functional_bagua.scale_by_shampoo`, then
    decoupled weight decay and the learning rate::

        p <- p - lr * (P + weight_decay * p)

    Every float hyperparameter may also be a schedule.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        betas: ``(b1, b2)``: the decay of the filtered gradient and of the statistics (1: their sum).
        epsilon: added to the statistics' eigenvalues before the inverse root.
        weight_decay: decoupled weight decay.
        max_preconditioner_dim: the block size.
        precondition_frequency: recompute the inverse roots every this many steps.
        start_preconditioning_step: the first step that uses them (``None``: ``precondition_frequency``).
        merge_dims: view tensors with small neighbouring dimensions merged.
        grafting: ``None``, ``"sgd"``, ``"adagrad"``, ``"rmsprop"`` or ``"adam"``: the method whose
            step size each block takes.
        grafting_beta2: the decay of the grafting method's second moments.
        grafting_epsilon: added to their square root.
        use_bias_correction: bias-correct the filtered gradient and the statistics.
        matrix_dtype: the precision of the eigendecompositions and roots.
        group: share the inverse roots among the ranks of this process group, each computed by
            one (after ``allreduce_gradients``; see :func:`~functional_bagua.scale_by_shampoo`).
        root_method: ``"eigh"`` or ``"newton"`` (the coupled Newton iteration, batched matmuls
            only, meant for GPUs and not yet measured there; ``eigh`` where it does not converge).
        newton_iterations: the most steps of the Newton iteration.
        newton_tolerance: where it stops.

    Returns:
        A GradientTransformation.

    Example::

        tx = fb.shampoo(lr=1e-3, betas=(0.9, 0.999), grafting="adam", weight_decay=0.01)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check_nonnegative(weight_decay, "weight_decay")
    direction = scale_by_shampoo(
        betas[0],
        betas[1],
        epsilon,
        max_preconditioner_dim,
        precondition_frequency,
        start_preconditioning_step,
        merge_dims,
        grafting,
        grafting_beta2,
        grafting_epsilon,
        use_bias_correction,
        matrix_dtype,
        group,
        root_method=root_method,
        newton_iterations=newton_iterations,
        newton_tolerance=newton_tolerance,
    )
    return chain(direction, add_decayed_weights(weight_decay), scale_by_learning_rate(lr))


@accepts_schedules
def psgd_kron(
    lr: ScalarOrSchedule = 3e-4,
    b1: float = 0.9,
    weight_decay: float = 0.0,
    precond_lr: float = 0.1,
    precond_init_scale: float = 1.0,
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: Optional[str] = None,
    momentum_into_precond_update: bool = True,
    merge_dims: bool = True,
    precond_dtype: torch.dtype = torch.float32,
    max_prob: float = 1.0,
    min_prob: float = 0.03,
    decay: float = 0.001,
    flat_start: int = 500,
    balance_every: int = 100,
    group: Optional[torch.distributed.ProcessGroup] = None,
) -> GradientTransformation:
    """PSGD-Kron, as ``kron-torch``'s ``Kron`` with its defaults: the direction of
    :func:`~functional_bagua.scale_by_psgd_kron`, then weight decay on the tensors of two or
    more dimensions and the learning rate::

        p <- p - lr * (u + weight_decay * p)        (weight_decay only where p.dim() >= 2)

    Every float hyperparameter may also be a schedule.

    Args:
        lr: learning rate (a number, a 0-dim tensor, or a schedule: a function of the step count).
        b1: the momentum.
        weight_decay: decoupled weight decay, on tensors of two or more dimensions.
        precond_lr: the preconditioner's step size.
        precond_init_scale: the preconditioner's initial scale.
        max_size_triangular: dimensions above it get a diagonal factor.
        min_ndim_triangular: tensors with fewer dimensions get diagonal factors only.
        memory_save_mode: ``None``, ``"smart_one_diag"``, ``"one_diag"`` or ``"all_diag"``.
        momentum_into_precond_update: fit the preconditioner to the momentum (else the gradient).
        merge_dims: view tensors of more than two dimensions as matrices.
        precond_dtype: the dtype of the factors.
        max_prob: the preconditioner's update probability at the start (its schedule:
            ``update_probability``).
        min_prob: its floor.
        decay: its anneal rate after ``flat_start`` steps.
        flat_start: the steps at ``max_prob``.
        balance_every: rebalance the factors every this many preconditioner updates.
        group: share the factors' fit among the ranks of this process group, each tensor's fitted
            by one (after ``allreduce_gradients``; see :func:`~functional_bagua.scale_by_psgd_kron`).

    Returns:
        A GradientTransformation (without weight decay, one that :func:`~functional_bagua.fuse`
        can run on flat buffers; the weight decay's mask by dimension needs the tensors).

    Example::

        tx = fb.psgd_kron(lr=3e-4, weight_decay=0.01)
        state = tx.init(params)
    """
    _check_lr(lr)
    _check_nonnegative(weight_decay, "weight_decay")
    direction = scale_by_psgd_kron(
        b1,
        precond_lr,
        precond_init_scale,
        max_size_triangular,
        min_ndim_triangular,
        memory_save_mode,
        momentum_into_precond_update,
        merge_dims,
        precond_dtype,
        max_prob,
        min_prob,
        decay,
        flat_start,
        balance_every,
        group,
    )
    if isinstance(weight_decay, (int, float)) and weight_decay == 0:
        return chain(direction, scale_by_learning_rate(lr))
    matrices_only = masked(add_decayed_weights(weight_decay), _at_least_two_dims)
    return chain(direction, matrices_only, scale_by_learning_rate(lr))


def _at_least_two_dims(params: PyTree) -> PyTree:
    return optree.tree_map(lambda p: p is not None and p.dim() >= 2, params, none_is_leaf=True)
