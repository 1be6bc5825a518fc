"""Parameter averaging: an exponential moving average of the weights, for evaluation.

After each step ``t`` (parameters ``p_t``)::

    ema_1 = p_1
    ema_t = decay * ema_{t-1} + (1 - decay) * p_t          (t > 1)

as ``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` with
``update_parameters`` called after every ``optimizer.step()``.

Unlike optax's ``ema`` (which smooths the *updates*), ``fb.ema`` averages the *parameters*: put
it last in a chain; it passes the updates through and keeps the average of
``apply_updates(params, updates)`` in its state.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from functional_bagua import tree
from functional_bagua.base import GradientTransformation, apply_updates
from functional_bagua.hyperparams import accepts_schedules, checkable
from functional_bagua.numerics import lerp, zero_count
from functional_bagua.tree import PyTree


class EmaParamsState(NamedTuple):
    """``count``: parameter versions averaged so far; ``ema``: the averaged parameters."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    ema: Any


@accepts_schedules
def ema(decay: float = 0.999) -> GradientTransformation:
    """Exponential moving average of the parameters (module docstring); ``decay`` may be a schedule.

    Example::

        tx = fb.chain(fb.adamw(1e-3), fb.ema(0.999))
        ...
        eval_params = state[-1].ema

    Args:
        decay: the weight of the old average, in [0, 1] (a ValueError otherwise): ``ema_t =
            decay * ema_{t-1} + (1 - decay) * p_t``; a schedule of the step count builds the
            transform through ``inject_hyperparams``.

    Returns:
        A GradientTransformation that passes the updates through unchanged and keeps the average
        in an :class:`EmaParamsState`; its ``update`` needs the parameters.
    """
    decay_now = checkable(decay)
    if decay_now is not None and not 0.0 <= decay_now <= 1.0:
        raise ValueError(f"Invalid decay value {decay} provided. Please provide a value in [0,1] range.")

    def init(params: PyTree) -> EmaParamsState:
        return EmaParamsState(zero_count(params), tree.clone(params))

    def update(
        updates: PyTree, state: EmaParamsState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, EmaParamsState]:
        if params is None:
            raise ValueError("ema needs the parameters: call update(grads, state, params)")
        new_params = apply_updates(params, updates)
        first = state.count == 0
        averaged = tree.tree_map(
            lambda avg, p: None if p is None else torch.where(first, p, lerp(avg, p, 1 - decay)), state.ema, new_params
        )
        return updates, EmaParamsState(state.count + 1, averaged)

    return GradientTransformation(init, update)
