"""A line search for the strong Wolfe conditions (Nocedal & Wright, Numerical Optimization,
Algorithms 3.5 and 3.6), with torch.optim.LBFGS's choices of trial steps.

Along a descent direction ``d`` from ``x`` (``phi(t) = f(x + t d)``, ``phi'(0) = g.d < 0``) it looks
for a step ``t`` with

    sufficient decrease:   phi(t) <= phi(0) + c1 t phi'(0)
    curvature:             |phi'(t)| <= -c2 phi'(0)

first by extrapolation (each trial the minimiser of the cubic through the last two points, kept
within ``[t + 0.01 (t - t_prev), 10 t]``) until an interval brackets such a step, then by zooming
into the bracket (cubic interpolation, pulled away from the ends when it lands too close to
them), at most ``max_ls`` evaluations in all.

The search works on flat vectors: ``evaluate(t)`` returns the loss (a Python float) and the
gradient (a flat tensor) at ``x + t d``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

Scalar = Any  # a Python float or a 0-dim tensor: torch.optim.LBFGS mixes both, and so must we to match it


class Point(NamedTuple):
    """A trial step ``t`` with the loss there, its gradient and the directional derivative ``g.d``."""

    t: Scalar
    f: float
    g: torch.Tensor
    gtd: Scalar


def cubic_minimizer(a: Point, b: Point, bounds: Optional[tuple] = None) -> Scalar:
    """The minimiser of the cubic through ``(a.t, a.f)`` and ``(b.t, b.f)`` with slopes ``a.gtd`` and
    ``b.gtd``, clamped to ``bounds`` (default: between the two points); the middle of the bounds
    where the cubic has no minimiser.

    With ``d1 = a.gtd + b.gtd - 3 (a.f - b.f) / (a.t - b.t)`` and ``d2 = sqrt(d1^2 - a.gtd b.gtd)``,
    for ``a.t <= b.t``::

        t* = b.t - (b.t - a.t) (b.gtd + d2 - d1) / (b.gtd - a.gtd + 2 d2)

    Args:
        a, b: the two points, with ``t``, ``f`` and ``gtd`` set.
        bounds: ``(low, high)`` to clamp the result to.
    """
    low, high = bounds if bounds is not None else (min(a.t, b.t), max(a.t, b.t))
    d1 = a.gtd + b.gtd - 3 * (a.f - b.f) / (a.t - b.t)
    d2_square = d1**2 - a.gtd * b.gtd
    if not d2_square >= 0:  # no minimiser (or NaN)
        return (low + high) / 2.0
    d2 = d2_square.sqrt()
    left, right = (a, b) if a.t <= b.t else (b, a)
    t = right.t - (right.t - left.t) * ((right.gtd + d2 - d1) / (right.gtd - left.gtd + 2 * d2))
    return min(max(t, low), high)


def strong_wolfe(
    evaluate: Callable[[Scalar], tuple[float, torch.Tensor]],
    t: Scalar,
    d: torch.Tensor,
    start: Point,
    c1: float = 1e-4,
    c2: float = 0.9,
    tolerance_change: float = 1e-9,
    max_ls: int = 25,
) -> tuple:
    """A step along ``d`` that satisfies the strong Wolfe conditions (module docstring).

    Args:
        evaluate: ``evaluate(t) -> (loss, flat_gradient)`` at ``x + t d``.
        t: the first trial step.
        d: the descent direction (flat).
        start: the point ``t = 0``: the loss, gradient and ``g.d`` at ``x``.
        c1, c2: the constants of the sufficient-decrease and curvature conditions.
        tolerance_change: stop zooming once the bracket is this short (times ``max |d|``).
        max_ls: evaluations allowed in all.

    Returns:
        ``(loss, gradient, t, evaluations)`` at the step found (the best point seen if the
        evaluations ran out).
    """
    d_norm = d.abs().max()
    sufficient = lambda p: p.f <= start.f + c1 * p.t * start.gtd  # noqa: E731
    flat_enough = lambda p: abs(p.gtd) <= -c2 * start.gtd  # noqa: E731

    def trial(t: Scalar) -> Point:
        f, g = evaluate(t)
        return Point(t, f, g, g.dot(d))

    previous, current = Point(0, start.f, start.g, start.gtd), trial(t)
    evaluations, iterations = 1, 0
    bracket = None
    while iterations < max_ls:
        if not sufficient(current) or (iterations > 1 and current.f >= previous.f):
            bracket = [previous, current]
            break
        if flat_enough(current):
            return current.f, current.g, current.t, evaluations
        if current.gtd >= 0:  # past a minimum along d
            bracket = [previous, current]
            break
        bounds = (current.t + 0.01 * (current.t - previous.t), current.t * 10)
        next_t = cubic_minimizer(previous, current, bounds)
        previous, current = current, trial(next_t)
        evaluations += 1
        iterations += 1
    if iterations == max_ls:
        bracket = [start, current]
    assert bracket is not None  # set by a break, or by running out of evaluations
    bracket, evaluations = _zoom(
        trial, bracket, start, sufficient, flat_enough, d_norm, tolerance_change, evaluations, iterations, max_ls
    )
    best = bracket[0]
    return best.f, best.g, best.t, evaluations


def _zoom(
    trial: Callable[[Scalar], Point],
    bracket: list[Point],
    start: Point,
    sufficient: Callable[[Point], bool],
    flat_enough: Callable[[Point], bool],
    d_norm: torch.Tensor,
    tolerance_change: float,
    evaluations: int,
    iterations: int,
    max_ls: int,
) -> tuple[list[Point], int]:
    """Shrink ``bracket`` (two points, one of them the lower, ``low``) until a point in it meets
    both conditions, it is shorter than ``tolerance_change``, or the evaluations run out; the
    bracket with its lower point first."""
    low = 0 if bracket[0].f <= bracket[-1].f else 1
    insufficient_progress = False
    while iterations < max_ls:
        a, b = bracket
        if abs(b.t - a.t) * d_norm < tolerance_change:
            break
        t = cubic_minimizer(a, b)
        lo, hi = min(a.t, b.t), max(a.t, b.t)
        margin = 0.1 * (hi - lo)
        if min(hi - t, t - lo) < margin:  # too close to an end: step away from it
            if insufficient_progress or t >= hi or t <= lo:
                t = hi - margin if abs(t - hi) < abs(t - lo) else lo + margin
                insufficient_progress = False
            else:
                insufficient_progress = True
        else:
            insufficient_progress = False
        point = trial(t)
        evaluations += 1
        iterations += 1
        high = 1 - low
        if not sufficient(point) or point.f >= bracket[low].f:
            bracket[high] = point
            low = 0 if bracket[0].f <= bracket[1].f else 1
            continue
        if flat_enough(point):
            bracket[low] = point
            break
        if point.gtd * (bracket[high].t - bracket[low].t) >= 0:  # the minimum is on the other side
            bracket[high] = bracket[low]
        bracket[low] = point
    return _with_low_first(bracket, low), evaluations


def _with_low_first(bracket: list, low: int) -> list:
    return [bracket[low], bracket[1 - low]]
