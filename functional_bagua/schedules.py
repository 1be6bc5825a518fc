"""Schedules: functions of the step count ``t = 0, 1, 2, ...`` returning a hyperparameter value.

A schedule takes ``t`` as a Python int or a 0-dim tensor holding an integer and returns a 0-dim
float64 tensor. The optimizers call schedules with ``t`` as a float64 tensor (:func:`step_count`),
so that a schedule of your own like ``lambda t: 0.1 / (1.0 + t)`` computes in float64, as torch's
schedulers compute in Python floats. Schedules are computed with tensor ops only, so a step compiled by torch.compile traces it once and
never recompiles as ``t`` grows. Each one equals its closed form below; where torch has an LR
scheduler for it, the sequence ``f(0), f(1), ...`` equals the scheduler's ``get_last_lr()``
sequence (``init_value`` = the optimizer's initial ``lr``):

===========================================================  ==================================================
schedule                                                     torch.optim.lr_scheduler
===========================================================  ==================================================
``exponential_decay(lr, step_size, gamma, staircase=True)``  ``StepLR(step_size, gamma)``
``piecewise_constant(lr, {m: gamma for m in ms})``           ``MultiStepLR(ms, gamma)``
``exponential_decay(lr, 1, gamma)``                          ``ExponentialLR(gamma)``
``cosine_decay(lr, T_max, alpha=eta_min / lr)``              ``CosineAnnealingLR(T_max, eta_min)`` (t <= T_max)
``linear(lr * start, lr * end, total_iters)``                ``LinearLR(start, end, total_iters)``
``one_cycle(total_steps, max_lr, ...)``                      ``OneCycleLR(max_lr, total_steps, ...)``
===========================================================  ==================================================
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NoReturn, Optional, Sequence, Union

import torch

from functional_bagua.numerics import SCALAR_DTYPE

Count = Union[int, torch.Tensor]  # a step count: a Python int or a 0-dim tensor holding one
Schedule = Callable[[Count], torch.Tensor]

__all__ = [  # the schedules, and the step count as they read it (the module's helpers stay internal)
    "Schedule",
    "step_count",
    "constant",
    "linear",
    "polynomial",
    "cosine_decay",
    "exponential_decay",
    "piecewise_constant",
    "join_schedules",
    "warmup_cosine_decay",
    "one_cycle",
]


def step_count(count: torch.Tensor) -> torch.Tensor:
    """An optimizer's integer step counter as the float64 tensor its schedules receive.

    Args:
        count: the step counter, an integer tensor (0-dim in the optimizers' states).
    """
    return count.to(SCALAR_DTYPE)


class _NumberRead(Exception):
    """Raised by :class:`_CountProbe` when a schedule reads the count as a Python number."""


class _CountProbe(torch.Tensor):
    """A step count that refuses to become a Python number (``bool``, ``float``, ``int``,
    ``.item()``), and so do the tensors computed from it."""

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise _NumberRead()

    __bool__ = __float__ = __int__ = __index__ = item = tolist = _refuse


def reads_count_as_number(schedule: Callable) -> bool:
    """Whether ``schedule`` uses the step count as a Python number (``if t < 3``, ``float(t)``,
    ``math.cos(t)``, ``t.item()``), as a function written for torch's ``LambdaLR`` does. That
    works eagerly, but torch.compile cannot trace it: the count arrives as a 0-dim tensor, and
    a traceable schedule computes with tensor ops (``torch.where``, ``torch.cos``). Found by
    calling ``schedule`` once on a count that refuses to become a number.

    Args:
        schedule: a function of the step count, called once with a 0-dim float64 tensor holding 0.

    Returns:
        ``True`` also when that call raises any other exception (it would fail compiled as well).
    """
    count = torch.zeros((), dtype=SCALAR_DTYPE).as_subclass(_CountProbe)
    try:
        schedule(count)
    except _NumberRead:
        return True
    except Exception:  # anything else it cannot do with a tensor count fails the same way compiled
        return True
    return False


def describe(schedule: Callable) -> str:
    """A schedule's name for messages (computed eagerly: a traced step cannot read it).

    Args:
        schedule: any callable; its ``__qualname__`` is the name, else its ``repr``.
    """
    return getattr(schedule, "__qualname__", None) or repr(schedule)


def refuse_untraceable(name: str, where: str) -> None:
    """Raise a TypeError naming the schedule ``name`` (used for ``where``): called while
    torch.compile traces a step, for a schedule that :func:`reads_count_as_number`.

    Args:
        name: the schedule's name, as :func:`describe` gives it.
        where: what the schedule is used for, e.g. ``"the hyperparameter 'lr'"``.

    Raises:
        TypeError: always, saying how to write the schedule with tensor ops.
    """
    raise TypeError(
        f"the schedule {name!r} for {where} uses the step count as a Python "
        "number (if/float()/math.*/item()), which torch.compile cannot trace: the count arrives as a 0-dim "
        "float64 tensor. Write it with tensor ops (torch.where(t < 3, a, b), torch.cos(t), ...), or run the "
        "step eagerly"
    )


def _step(count: Count) -> torch.Tensor:
    """The step count as a float64 tensor."""
    return torch.as_tensor(count).to(SCALAR_DTYPE)


def _fraction(t: torch.Tensor, begin: float, steps: float) -> torch.Tensor:
    """``clip((t - begin) / steps, 0, 1)``: how far ``t`` is through a transition."""
    return ((t - begin) / max(steps, 1)).clamp(0.0, 1.0)


def constant(value: float) -> Schedule:
    """``f(t) = value``.

    Args:
        value: the value at every step.

    Returns:
        The schedule ``f``.

    Example::

        f = fb.schedules.constant(0.1)
        f(0), f(1000)                       # tensor(0.1000, dtype=torch.float64) both times
    """
    return lambda count: torch.full_like(_step(count), value)


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """``f(t) = init + (end - init) * clip((t - begin) / steps, 0, 1)``; ``init`` throughout when
    ``steps <= 0`` (no transition), as optax and torch's LinearLR(total_iters=0) hold it.

    Args:
        init_value: ``init``, the value up to step ``transition_begin``.
        end_value: ``end``, the value from step ``transition_begin + transition_steps`` on.
        transition_steps: ``steps``, the number of steps the transition takes.
        transition_begin: ``begin``, the step at which the transition starts.

    Returns:
        The schedule ``f``.

    Example::

        f = fb.schedules.linear(1.0, 0.1, transition_steps=10)
        f(0), f(5), f(20)                   # 1.0, 0.55, 0.1 (0-dim float64 tensors)
    """
    return polynomial(init_value, end_value, 1.0, transition_steps, transition_begin)


def polynomial(
    init_value: float, end_value: float, power: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """``f(t) = end + (init - end) * (1 - clip((t - begin) / steps, 0, 1)) ** power``.

    Matches ``torch.optim.lr_scheduler.PolynomialLR(total_iters=steps, power)`` with
    ``end_value=0`` (and LinearLR for ``power=1``). With ``steps <= 0`` there is no transition
    and ``f(t) = init`` (optax's rule).

    Args:
        init_value: ``init``, the value up to step ``transition_begin``.
        end_value: ``end``, the value from step ``transition_begin + transition_steps`` on.
        power: the exponent of the decay (1 is :func:`linear`).
        transition_steps: ``steps``, the number of steps the transition takes.
        transition_begin: ``begin``, the step at which the transition starts.

    Returns:
        The schedule ``f``.

    Example::

        f = fb.schedules.polynomial(1.0, 0.0, power=2.0, transition_steps=10)
        f(0), f(5), f(20)                   # 1.0, 0.25, 0.0
    """
    if transition_steps <= 0:
        return constant(init_value)

    def schedule(count: Count) -> torch.Tensor:
        t = _step(count)
        if power == 1.0:  # the linear form, exactly as LinearLR interpolates
            return init_value + (end_value - init_value) * _fraction(t, transition_begin, transition_steps)
        return end_value + (init_value - end_value) * (1 - _fraction(t, transition_begin, transition_steps)) ** power

    return schedule


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    """``f(t) = init * ((1 - alpha) * c(t) ** exponent + alpha)`` with
    ``c(t) = (1 + cos(pi * min(t, decay_steps) / decay_steps)) / 2``.

    Args:
        init_value: ``init``, the value at step 0.
        decay_steps: the step at which the decay ends (the value is held after); must be positive
            (a ValueError otherwise).
        alpha: the final value as a fraction of ``init_value`` (``eta_min / lr`` in torch's terms).
        exponent: the power the cosine factor ``c(t)`` is raised to.

    Returns:
        The schedule ``f``.

    Example::

        f = fb.schedules.cosine_decay(0.1, decay_steps=100)
        f(0), f(50), f(100)                 # 0.1, 0.05, 0.0
    """
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay: decay_steps must be positive, got {decay_steps}")

    def schedule(count: Count) -> torch.Tensor:
        t = _step(count).clamp(max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Optional[float] = None,
) -> Schedule:
    """``f(t) = init * decay_rate ** (max(t - begin, 0) / transition_steps)`` (the exponent floored
    with ``staircase``), bounded by ``end_value`` when given.

    Args:
        init_value: ``init``, the value up to step ``transition_begin``.
        transition_steps: the number of steps over which the value is multiplied by ``decay_rate``
            once; must be positive (a ValueError otherwise).
        decay_rate: the factor per ``transition_steps`` steps.
        transition_begin: ``begin``, the step at which the decay starts.
        staircase: floor the exponent, so that the value changes every ``transition_steps`` steps.
        end_value: a lower bound when ``decay_rate < 1``, else an upper bound; ``None`` for none.

    Returns:
        The schedule ``f``.

    Example::

        f = fb.schedules.exponential_decay(0.1, 30, 0.1, staircase=True)   # StepLR(step_size=30, gamma=0.1)
        f(29), f(30), f(60)                 # 0.1, 0.01, 0.001
    """
    if transition_steps <= 0:
        raise ValueError(f"exponential_decay: transition_steps must be positive, got {transition_steps}")

    def schedule(count: Count) -> torch.Tensor:
        exponent = (_step(count) - transition_begin).clamp(min=0) / transition_steps
        if staircase:
            exponent = exponent.floor()
        value = init_value * decay_rate**exponent
        if end_value is not None:
            value = value.clamp(min=end_value) if decay_rate < 1 else value.clamp(max=end_value)
        return value

    return schedule


def piecewise_constant(init_value: float, boundaries_and_scales: Mapping[int, float]) -> Schedule:
    """``f(t) = init * prod(scale_b for each boundary b <= t)``: the value is multiplied by
    ``scale_b`` from step ``b`` on.

    Args:
        init_value: ``init``, the value before the first boundary.
        boundaries_and_scales: ``{b: scale_b}``, each step ``b`` from which the value is multiplied
            by ``scale_b``.

    Returns:
        The schedule ``f``.

    Example::

        f = fb.schedules.piecewise_constant(0.1, {30: 0.1, 80: 0.1})    # MultiStepLR([30, 80], 0.1)
        f(29), f(30), f(80)                 # 0.1, 0.01, 0.001
    """
    items = sorted(boundaries_and_scales.items())

    def schedule(count: Count) -> torch.Tensor:
        t = _step(count)
        value = torch.full_like(t, init_value)
        for boundary, scale in items:
            value = torch.where(t >= boundary, value * scale, value)
        return value

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Schedule ``i`` runs from ``boundaries[i-1]`` on, with its own count restarted at zero:
    ``f(t) = schedules[i](t - boundaries[i-1])``.

    Args:
        schedules: the schedules in the order they run; one more than ``boundaries`` (a ValueError
            otherwise).
        boundaries: the steps at which the next schedule takes over; they must not decrease.

    Returns:
        The schedule ``f``.

    Example::

        f = fb.schedules.join_schedules([fb.schedules.constant(0.1), fb.schedules.linear(0.1, 0.0, 100)], [10])
        f(9), f(10), f(60), f(110)          # 0.1, 0.1, 0.05, 0.0
    """
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} boundaries, got {len(boundaries)}"
        )
    if any(later < earlier for earlier, later in zip(boundaries, boundaries[1:])):
        raise ValueError(f"join_schedules: boundaries must not decrease, got {list(boundaries)}")

    def schedule(count: Count) -> torch.Tensor:
        t = _step(count)
        value = schedules[0](t)
        for start, later in zip(boundaries, schedules[1:]):
            value = torch.where(t >= start, later(t - start), value)
        return value

    return schedule


def warmup_cosine_decay(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at step ``decay_steps`` (counted from 0, warmup included), held after.
    ``decay_steps`` must exceed ``warmup_steps`` (a ValueError otherwise, as in optax).

    Args:
        init_value: the value at step 0.
        peak_value: the value at the end of the warmup.
        warmup_steps: the number of warmup steps (``>= 0``; 0 starts at ``peak_value``).
        decay_steps: the step at which the decay ends, counted from step 0.
        end_value: the value from step ``decay_steps`` on.
        exponent: the power of the cosine factor, as in :func:`cosine_decay`.

    Returns:
        The schedule.

    Example::

        f = fb.schedules.warmup_cosine_decay(0.0, 1e-3, warmup_steps=100, decay_steps=1000)
        f(0), f(100), f(1000)               # 0.0, 0.001, 0.0
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_cosine_decay: warmup_steps must be >= 0, got {warmup_steps}")
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay: decay_steps ({decay_steps}) must be greater than warmup_steps ({warmup_steps}): "
            "decay_steps counts from step 0 and includes the warmup"
        )
    return join_schedules(
        [
            linear(init_value, peak_value, warmup_steps),
            cosine_decay(
                peak_value, decay_steps - warmup_steps, end_value / peak_value if peak_value else 0.0, exponent
            ),
        ],
        [warmup_steps],
    )


def one_cycle(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal_strategy: str = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The 1cycle policy (Smith & Topin), as ``torch.optim.lr_scheduler.OneCycleLR``.

    From ``peak / div_factor`` up to ``peak`` at step ``pct_start * T - 1``, then down to
    ``peak / (div_factor * final_div_factor)`` at step ``T - 1`` (``T = transition_steps``);
    ``three_phase`` goes back to the initial value first. Each phase anneals as
    ``anneal(start, end, p) = end + (start - end) / 2 * (1 + cos(pi p))`` (or linearly).

    After step ``T - 1`` the final value is held (optax's rule; torch's scheduler raises when
    stepped past ``total_steps``, which a compiled step cannot do). A phase of zero steps
    (``pct_start * T == 1``; with ``three_phase`` also ``3 * pct_start * T == T + 1``), where
    torch divides by zero, raises a ValueError here.

    Args:
        transition_steps: ``T``, the number of steps of the cycle (``total_steps``); must be positive.
        peak_value: the highest value (``max_lr``).
        pct_start: the fraction of ``T`` spent going up, between 0 and 1.
        div_factor: the initial value is ``peak_value / div_factor``.
        final_div_factor: the final value is the initial one divided by ``final_div_factor``.
        anneal_strategy: ``"cos"`` or ``"linear"`` (a ValueError for anything else).
        three_phase: go back down to the initial value before annealing to the final one.

    Returns:
        The schedule.

    Example::

        f = fb.schedules.one_cycle(1000, 0.1)     # OneCycleLR(max_lr=0.1, total_steps=1000)
        f(0), f(299), f(999)                # 0.004, 0.1, 4e-07
    """
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
    if transition_steps <= 0:
        raise ValueError(f"one_cycle: transition_steps must be positive, got {transition_steps}")
    if not 0 <= pct_start <= 1:
        raise ValueError(f"one_cycle: pct_start must be a float between 0 and 1, got {pct_start}")
    initial = peak_value / div_factor
    minimum = initial / final_div_factor
    up_end = float(pct_start * transition_steps) - 1
    last = transition_steps - 1
    if three_phase:
        phases = [(up_end, initial, peak_value), (2 * up_end, peak_value, initial), (last, initial, minimum)]
    else:
        phases = [(up_end, initial, peak_value), (last, peak_value, minimum)]
    for i, ((start, end), _, _) in enumerate(_with_starts(phases)):
        if end == start:
            raise ValueError(
                f"one_cycle: phase {i} of the schedule is zero steps long (from step {start:g} to {end:g}) with "
                f"pct_start={pct_start} and transition_steps={transition_steps}; change pct_start "
                "(torch's OneCycleLR divides by zero here)"
            )

    def anneal(start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def schedule(count: Count) -> torch.Tensor:
        t = _step(count).clamp(max=last)
        value: Optional[torch.Tensor] = None
        for (start, end), low, high in reversed(_with_starts(phases)):
            here = anneal(low, high, (t - start) / (end - start))
            value = here if value is None else torch.where(t <= end, here, value)
        assert value is not None  # there are two or three phases
        return value

    return schedule


def _with_starts(phases: list[tuple[float, float, float]]) -> list[tuple[tuple[float, float], float, float]]:
    """Each phase as ``((start_step, end_step), start_value, end_value)``; the first starts at 0."""
    out, start = [], 0.0
    for end, low, high in phases:
        out.append(((start, end), low, high))
        start = end
    return out
