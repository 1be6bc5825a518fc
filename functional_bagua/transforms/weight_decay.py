"""Weight decay as a transform.

``add_decayed_weights(wd)``: ``u = g + wd * p``.

Placed before a preconditioner it is L2 regularisation (torch.optim's ``weight_decay``); placed
after it and before the learning rate it is decoupled weight decay (AdamW's
``p <- p - lr * wd * p``)::

    adam_l2 = chain(add_decayed_weights(wd), scale_by_adam(), scale_by_learning_rate(lr))
    adamw   = chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))
"""

from __future__ import annotations

from typing import Any, Union

import torch

from functional_bagua.base import GradientTransformation, identity
from functional_bagua.numerics import eager_number
from functional_bagua.transforms.leafwise import stateless


def add_decayed_weights(weight_decay: Union[float, torch.Tensor] = 0.0) -> GradientTransformation:
    """``u = g + weight_decay * p``; the identity when ``weight_decay`` is the number 0.

    Args:
        weight_decay: the factor of the parameters added to the updates, a number or a tensor.

    Returns:
        A stateless GradientTransformation whose ``update`` needs the parameters (the identity for
        the number 0).

    Example (decoupled, as AdamW)::

        tx = fb.chain(fb.scale_by_adam(), fb.add_decayed_weights(0.01), fb.scale_by_learning_rate(1e-3))
    """
    if isinstance(weight_decay, (int, float)):
        if weight_decay == 0:
            return _decaying(identity(), weight_decay)
        rule = lambda u, p: u.add(p, alpha=weight_decay)  # noqa: E731  (one fused kernel for a number)
        in_place = lambda u, p: u.add_(p, alpha=weight_decay)  # noqa: E731
    else:

        def rule(u: Any, p: Any) -> Any:
            wd = eager_number(weight_decay, u)
            if wd is None:  # traced, on a device, or half precision: the tensor as it is
                return u + weight_decay * p
            # at 0 a copy (the updates are declared fresh), in one multi-tensor op for grouped leaves
            return u.mul(1.0) if wd == 0 else u.add(p, alpha=wd)

        def in_place(u: Any, p: Any) -> Any:
            wd = eager_number(weight_decay, u)
            if wd is None:
                return u.add_(weight_decay * p)
            return u if wd == 0 else u.add_(p, alpha=wd)

    return _decaying(stateless(rule, name="add_decayed_weights", needs_params=True, in_place=in_place), weight_decay)


def _decaying(tx: GradientTransformation, weight_decay: Union[float, torch.Tensor]) -> GradientTransformation:
    """Record on ``tx`` its ``weight_decay`` (``update.decay()``, a tensor read at each call), so
    that a caller writing the step into the parameters may take it as the reference optimizers
    do: ``p.mul_(1 - lr wd)`` before the step's own write (:class:`~functional_bagua.Optimizer`,
    where it sits between a link that writes in place and the learning rate)."""
    tx.update.decay = lambda: weight_decay  # type: ignore[attr-defined]
    return tx
