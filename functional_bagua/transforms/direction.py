"""Directions and steps: which transforms give a direction without a learning rate.

Wrappers such as :func:`~functional_bagua.schedule_free` and :func:`~functional_bagua.cautious`
work on a *direction* ``d`` (the gradient, or a preconditioned gradient: it points where the
gradient points), not on a *step* (``-lr * d``, what an alias such as ``fb.adamw`` returns). A
transform takes a step of its own when it, or a link of its chain, was built by an alias or
:func:`~functional_bagua.scale_by_learning_rate` (they record how: ``update.built_from``, or the
numbers of :func:`~functional_bagua.inject_hyperparams`), or it declares that its updates hold a
step size of their own (``update.takes_a_step``: LaProp's, Prodigy's, D-Adaptation's).
"""

from __future__ import annotations

from typing import Optional

from functional_bagua.base import GradientTransformation


def step_of_its_own(tx: GradientTransformation) -> Optional[str]:
    """The name of what makes ``tx`` take a step (an alias, a learning rate in its chain), or
    ``None`` for a direction.

    Args:
        tx: any transform.
    """
    for link in _links(tx):
        stepper = getattr(link.update, "takes_a_step", None)  # the name of a transform whose updates are steps
        if stepper is not None:
            return str(stepper)
        built = getattr(link.update, "built_from", None)
        if built is not None:
            return str(built[0].__name__)
        if hasattr(link.update, "adjustable"):
            return "an alias built with schedules"
    return None


def refuse_a_step(who: str, tx: GradientTransformation, example: str) -> None:
    """Raise a ValueError when ``tx`` takes a step of its own (:func:`step_of_its_own`), naming
    it and how to give ``who`` a direction instead (``example``); a TypeError when ``tx`` is not
    a transform.

    Args:
        who: the wrapper's name, for the message.
        tx: the transform given as a direction.
        example: a call of ``who`` on a direction, for the message.
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{who}: expected a GradientTransformation, got {type(tx).__name__}")
    stepper = step_of_its_own(tx)
    if stepper is not None:
        raise ValueError(
            f"{who}: the transform given takes a step of its own ({stepper}), with a learning rate and the "
            f"sign of a descent; {who} needs a direction that points where the gradient points, without a "
            f"learning rate: {example}"
        )


def _links(tx: GradientTransformation) -> list[GradientTransformation]:
    """``tx`` and, for a chain, every transform inside it (nested chains too)."""
    inner = getattr(tx.update, "transforms", None)
    if inner is None:
        return [tx]
    return [tx, *(link for t in inner for link in _links(t))]
