"""The newer first-order optimizers as aliases, with their reference packages' names and defaults.

Each is a chain of building blocks (:mod:`functional_bagua.transforms`) and matches its
reference step for step; every float hyperparameter may be a schedule (then the alias is built
through :func:`~functional_bagua.inject_hyperparams`)::

    tx = fb.schedule_free_adamw(lr=2.5e-3, warmup_steps=100)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = fb.apply_updates(params, updates)
    eval_params = fb.schedule_free_eval_params(state, params)
"""

from __future__ import annotations

from functional_bagua.aliases import _check, _check_betas, _check_eps, _check_lr, _check_nonnegative
from functional_bagua.base import GradientTransformation, chain, identity
from functional_bagua.hyperparams import accepts_schedules
from functional_bagua.numerics import is_number
from functional_bagua.transforms.adam import scale_by_bias_corrected_rms
from functional_bagua.transforms.scaling import ScalarOrSchedule
from functional_bagua.transforms.schedule_free import schedule_free
from functional_bagua.transforms.weight_decay import add_decayed_weights


def _with_decay(direction: GradientTransformation, weight_decay: float) -> GradientTransformation:
    """``direction``, then ``+ weight_decay * y`` where a decay is given (schedule-free decays at ``y``)."""
    if is_number(weight_decay) and weight_decay == 0.0:  # a tensor may be written later (fb.Optimizer)
        return direction
    return chain(direction, add_decayed_weights(weight_decay))


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
    _check_lr(lr)
    _check_eps(eps)
    _check_betas(betas)
    _check(
        b1, lambda v: v > 0.0, "schedule_free_adamw: betas[0] must lie in (0, 1) (x = (y - (1 - b1) z) / b1), got {}"
    )
    _check_nonnegative(weight_decay, "weight_decay")
    direction = _with_decay(scale_by_bias_corrected_rms(b2, eps), weight_decay)
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
    return schedule_free(_with_decay(identity(), weight_decay), lr, momentum, warmup_steps, r, weight_lr_power)
