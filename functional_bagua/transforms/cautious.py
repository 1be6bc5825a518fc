"""Cautious updates (Liang et al., 2024, "Cautious Optimizers: Improving Training with One Line
of Code"): keep the coordinates of a direction that agree in sign with the gradient, zero the
others, and rescale the tensor so that its size stays about the same::

    mask = [d * g > 0]                         (per coordinate, 1 or 0)
    u    = d * mask * scale(mask)
    scale(mask) = numel / (sum(mask) + 1)      ("paper": the paper and pytorch-optimizer)
                = 1 / max(mean(mask), 1e-3)    ("mean": timm and heavyball)

The two conventions differ by a factor ``(nnz + 1) / nnz`` (11% at 10 agreeing coordinates);
"paper" is the default. The direction must point where the gradient points (a preconditioner
such as :func:`~functional_bagua.scale_by_adam`, before any learning rate): an alias such as
``fb.adamw`` returns a descent step, whose signs are the opposite, and is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from functional_bagua.base import EmptyState, GradientTransformation
from functional_bagua.transforms.direction import refuse_a_step
from functional_bagua.transforms.leafwise import stateless
from functional_bagua.tree import PyTree

RESCALES = ("paper", "mean")


def cautious(inner: GradientTransformation, rescale: str = "paper") -> GradientTransformation:
    """``inner``'s direction masked where it disagrees in sign with the gradient (module
    docstring); ``inner``'s state is this transform's state.

    Args:
        inner: a transform whose updates point where the gradients point (a direction, no
            learning rate).
        rescale: ``"paper"`` (``numel / (nnz + 1)``, default) or ``"mean"`` (``1 / mean(mask)``,
            at most 1000).

    Returns:
        A GradientTransformation with ``inner``'s state.

    Example::

        tx = fb.chain(fb.cautious(fb.scale_by_adam()), fb.add_decayed_weights(0.01), fb.scale_by_learning_rate(1e-3))
    """
    refuse_a_step("cautious", inner, "fb.chain(fb.cautious(fb.scale_by_adam()), fb.scale_by_learning_rate(lr))")
    if rescale not in RESCALES:
        raise ValueError(f"cautious: rescale must be one of {RESCALES}, got {rescale!r}")

    def masked(d: torch.Tensor, g: Optional[torch.Tensor]) -> torch.Tensor:
        assert g is not None  # the gradients are given as the masking transform's "params"
        agree = (d * g > 0).to(d.dtype)
        if rescale == "paper":
            scale = agree.numel() / (agree.sum() + 1)
        else:
            scale = 1 / agree.mean().clamp(min=1e-3)
        return d * agree * scale

    # the gradients go in where a stateless rule takes its parameters: each rule call then gets
    # (direction, gradient) of one tensor (one segment inside fb.fuse), with the checks on both
    mask = stateless(masked, name="cautious", needs_params=True, per_tensor=True)

    def update(grads: PyTree, state: Any, params: Optional[PyTree] = None) -> tuple[PyTree, Any]:
        directions, state = inner.update(grads, state, params)
        updates, _ = mask.update(directions, EmptyState(), grads)
        return updates, state

    return GradientTransformation(inner.init, update)
