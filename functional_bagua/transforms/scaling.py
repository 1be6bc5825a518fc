"""Scaling the updates by constants, learning rates and schedules.

- ``scale(c)``:                    ``u = c * g``
- ``scale_by_learning_rate(lr)``:  ``u = -lr * g``   (descent; ``lr`` may be a schedule)
- ``scale_by_schedule(f)``:        ``u = f(t) * g``  with ``t`` the number of updates so far
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Union

import torch

from functional_bagua.base import EmptyState, GradientTransformation, identity
from functional_bagua.numerics import zero_count
from functional_bagua.schedules import (
    describe,
    reads_count_as_number,
    refuse_untraceable,
    step_count,
)
from functional_bagua.transforms.leafwise import stateless
from functional_bagua.tree import PyTree

Schedule = Callable[[torch.Tensor], Union[float, torch.Tensor]]
ScalarOrSchedule = Union[float, torch.Tensor, Schedule]


def scale(step_size: Union[float, torch.Tensor]) -> GradientTransformation:
    """``u = step_size * g``.

    Example::

        tx = fb.chain(fb.scale_by_adam(), fb.scale(-1e-3))

    Args:
        step_size: the factor every update is multiplied by, a number or a tensor.

    Returns:
        A stateless GradientTransformation.
    """
    tx = stateless(lambda u, p: u * step_size, name="scale", in_place=lambda u, p: u.mul_(step_size))
    return factor_of(tx, lambda: step_size)


def factor_of(tx: GradientTransformation, factor: Callable[[], Union[float, torch.Tensor]]) -> GradientTransformation:
    """Record on ``tx`` (a stateless transform computing ``u = c * g``) the function giving its
    factor ``c`` now (a tensor is read at every update), so that a caller adding the updates to
    the parameters may take ``c`` into that pass (``p.add_(u, alpha=c)``, as torch.optim adds
    ``-lr``) instead of running ``tx``: :class:`~functional_bagua.Optimizer` does, where ``tx``
    ends a chain.

    Args:
        tx: the transform.
        factor: ``c``, as a function of nothing.

    Returns:
        ``tx``.
    """
    tx.update.factor = factor  # type: ignore[attr-defined]
    return tx


def negate_if(flag: bool) -> GradientTransformation:
    """``u = -g`` when ``flag`` (torch.optim's ``maximize=True``), else the identity.

    Args:
        flag: whether to negate the updates (to maximise the objective).

    Returns:
        ``scale(-1.0)`` when ``flag``, else ``identity()``.

    Example::

        tx = fb.chain(fb.negate_if(True), fb.scale_by_adam(), fb.scale_by_learning_rate(1e-3))
    """
    return scale(-1.0) if flag else identity()


class ScaleByScheduleState(NamedTuple):
    """``count``: number of updates done so far (0-dim int64 tensor)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax


def scale_by_schedule(schedule: Schedule) -> GradientTransformation:
    """``u_t = schedule(t) * g_t`` with ``t = 0, 1, 2, ...`` the number of previous updates.

    ``t`` is a 0-dim float64 tensor (:func:`~functional_bagua.schedules.step_count`), so a
    schedule written with tensor ops is traced by torch.compile once and never recompiles as
    ``t`` grows. One that uses ``t`` as a Python number (``if t < 3``, ``math.cos(t)``) works
    eagerly; under torch.compile it raises a TypeError naming it.

    Args:
        schedule: a function of the step count ``t`` returning the factor, a number or a 0-dim
            tensor.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByScheduleState`.

    Example::

        tx = fb.chain(fb.scale_by_adam(), fb.scale_by_schedule(lambda t: -1e-3 * 0.99**t))
    """

    eager_only = describe(schedule) if reads_count_as_number(schedule) else None

    def init(params: PyTree) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=zero_count(params))

    def update(
        updates: PyTree, state: ScaleByScheduleState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, ScaleByScheduleState]:
        if eager_only is not None and torch.compiler.is_compiling():
            refuse_untraceable(eager_only, "scale_by_schedule")
        updates, _ = scale(schedule(step_count(state.count))).update(updates, EmptyState(), params)
        return updates, ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """``u = -lr * g`` (or ``+lr * g`` with ``flip_sign=False``); ``lr`` may be a schedule of the step.

    Example::

        tx = fb.chain(fb.scale_by_adam(), fb.scale_by_learning_rate(1e-3))

    Args:
        learning_rate: the step size, a number, a tensor, or a schedule (a function of the step
            count, as in :func:`scale_by_schedule`).
        flip_sign: with ``True`` (default) the update is ``-lr * g``, a descent step; with ``False``
            it is ``+lr * g``.

    Returns:
        A GradientTransformation, a stateless one for a fixed ``learning_rate`` (a tensor is read
        at every update, so a value written into it in place takes effect), a
        :func:`scale_by_schedule` one for a schedule. In :class:`~functional_bagua.Optimizer`,
        a fixed ``learning_rate`` is its param group's ``"lr"``, for torch's schedulers.
    """
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):

        @functools.wraps(learning_rate)  # keeps the schedule's name for messages
        def signed(count: torch.Tensor) -> Union[float, torch.Tensor]:
            return sign * learning_rate(count)

        return scale_by_schedule(signed)
    if isinstance(learning_rate, torch.Tensor):  # read at every update: a scheduler's fill_ reaches it
        tx = stateless(
            lambda u, p: u * (sign * learning_rate),
            name="scale_by_learning_rate",
            in_place=lambda u, p: u.mul_(sign * learning_rate),
        )
        factor_of(tx, lambda: sign * learning_rate)
    else:
        tx = scale(sign * learning_rate)
    # how it was built: fb.Optimizer shows the number as its group's "lr" (functional_bagua.adjustable)
    tx.update.built_from = (scale_by_learning_rate, {"learning_rate": learning_rate, "flip_sign": flip_sign})  # type: ignore[attr-defined]
    return tx


scale_by_learning_rate.shown_as = {"learning_rate": "lr"}  # type: ignore[attr-defined]  # its number in a param group
