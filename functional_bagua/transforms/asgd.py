"""Averaged SGD (Polyak & Juditsky, 1992), as torch.optim.ASGD.

Unlike the other ``scale_by_*`` transforms this returns the full descent step, because the
running average of the iterates it keeps needs the new parameters::

    u_t    = -eta_{t-1} (g_t + lambd * p_{t-1})          (p_t = p_{t-1} + u_t)
    ax_t   = p_t if mu_{t-1} = 1 else ax_{t-1} + mu_{t-1} (p_t - ax_{t-1})
    eta_t  = lr / (1 + lambd lr t)^alpha,                 eta_0 = lr
    mu_t   = 1 / max(1, t - t0),                          mu_0 = 1

``state.ax`` holds the averaged parameters (use them for evaluation).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import SCALAR_DTYPE, as_scalar, zero_count
from functional_bagua.transforms.leafwise import leafwise


class ScaleByAsgdState(NamedTuple):
    """Per tensor: ``count``, ``eta`` (step size), ``mu`` (averaging weight), ``ax`` (average)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    eta: torch.Tensor
    mu: torch.Tensor
    ax: torch.Tensor


def scale_by_asgd(
    lr: float = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6
) -> GradientTransformation:
    """ASGD's descent step and iterate averaging (module docstring).

    Args:
        lr: the initial step size ``eta_0``, and the ``lr`` of the decay ``eta_t = lr / (1 + lambd
            lr t)^alpha``.
        lambd: the decay term: the step includes ``lambd * p_{t-1}`` (weight decay), and it sets
            how fast ``eta_t`` decays.
        alpha: the power of the step-size decay ``eta_t``.
        t0: how many steps pass before averaging starts: ``mu_t = 1 / max(1, t - t0)``, and while
            ``mu_{t-1} = 1`` the average is just the latest iterate.

    Returns:
        A GradientTransformation giving the full descent step (sign included), whose state is a
        :class:`ScaleByAsgdState`; its ``update`` needs the parameters.

    Example::

        tx = fb.scale_by_asgd(lr=1e-2)
        updates, state = tx.update(grads, state, params)
        eval_params = state.ax
    """

    def init_leaf(p: torch.Tensor) -> ScaleByAsgdState:
        def scalar(x: float) -> torch.Tensor:
            return torch.as_tensor(x, dtype=SCALAR_DTYPE, device=p.device).clone()

        return ScaleByAsgdState(zero_count(p), scalar(lr), scalar(1.0), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleByAsgdState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleByAsgdState]:
        count = s.count + 1
        t = as_scalar(count)
        assert p is not None  # needs_params: update gets the parameters
        u = -s.eta * (g + lambd * p)
        new_p = p + u
        ax = torch.where(s.mu == 1, new_p, s.ax + (new_p - s.ax) * s.mu)
        eta = lr / (1 + lambd * lr * t) ** alpha
        mu = 1 / (t - t0).clamp(min=1)
        return u, ScaleByAsgdState(count, eta, mu, ax)

    return leafwise(ScaleByAsgdState, init_leaf, update_leaf, name="scale_by_asgd", needs_params=True)
