"""Weight decay as a transform.

``add_decayed_weights(wd)``: ``u = g + wd * p``.

Placed before a preconditioner it is L2 regularisation (torch.optim's ``weight_decay``); placed
after it and before the learning rate it is decoupled weight decay (AdamW's
``p <- p - lr * wd * p``)::

    adam_l2 = chain(add_decayed_weights(wd), scale_by_adam(), scale_by_learning_rate(lr))
    adamw   = chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))
"""

from __future__ import annotations

from typing import Union

import torch

from functional_bagua import tree
from functional_bagua.base import EmptyState, GradientTransformation, identity


def add_decayed_weights(weight_decay: Union[float, torch.Tensor] = 0.0) -> GradientTransformation:
    """``u = g + weight_decay * p``; the identity when ``weight_decay`` is the number 0."""
    if isinstance(weight_decay, (int, float)) and weight_decay == 0:
        return identity()

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("add_decayed_weights needs the parameters: call update(grads, state, params)")
        update_leaves, param_leaves, spec = tree.leaves_with_params(updates, params)
        decayed = [
            None if u is None else u.add(p, alpha=weight_decay) if _is_number(weight_decay)
            else (u + weight_decay * p).to(u.dtype)
            for u, p in zip(update_leaves, param_leaves)
        ]
        return spec.unflatten(decayed), state

    return GradientTransformation(init, update)


def _is_number(x) -> bool:
    return isinstance(x, (int, float))
