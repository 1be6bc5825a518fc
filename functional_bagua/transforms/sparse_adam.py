"""Adam for sparse gradients, as torch.optim.SparseAdam: only the elements a gradient holds move.

For a parameter whose sparse COO gradient holds values ``g_I`` at the elements ``I`` (duplicates
summed), with ``t`` the parameter's step count::

    m_I <- m_I + (1 - b1) (g_I - m_I)            v_I <- v_I + (1 - b2) (g_I^2 - v_I)
    u_I = -lr sqrt(1 - b2^t) / (1 - b1^t) * m_I / (sqrt(v_I) + eps)

and ``u`` is a sparse COO update holding ``u_I`` (``apply_updates`` adds it to the dense
parameter). The moments and parameter elements outside ``I`` stay as they are, where Adam would
decay the moments and move every element. The learning rate is part of this transform (not a
``scale_by_learning_rate`` after it) because torch rounds ``lr sqrt(1 - b2^t) / (1 - b1^t)`` as
one factor.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import as_scalar, zero_count
from functional_bagua.transforms.adam import bias_correction
from functional_bagua.transforms.leafwise import leafwise


class ScaleBySparseAdamState(NamedTuple):
    """Per tensor: ``count`` (steps taken), ``mu`` and ``nu`` (first and second moments, dense)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    mu: torch.Tensor
    nu: torch.Tensor


def scale_by_sparse_adam(
    learning_rate: Union[float, torch.Tensor] = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    maximize: bool = False,
) -> GradientTransformation:
    """SparseAdam's update for sparse COO gradients (module docstring); dense gradients raise a
    TypeError, as torch.optim.SparseAdam raises for them.

    Args:
        learning_rate: ``lr`` (a number or a 0-dim tensor).
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to ``sqrt(v)`` in the denominator.
        maximize: ascend the gradient instead.

    Returns:
        A GradientTransformation whose updates are sparse COO tensors.

    Example::

        tx = fb.scale_by_sparse_adam(1e-3)
        grads = {"embedding.weight": embedding.weight.grad}    # from nn.Embedding(sparse=True)
    """

    def init_leaf(p: torch.Tensor) -> ScaleBySparseAdamState:
        return ScaleBySparseAdamState(zero_count(p), torch.zeros_like(p), torch.zeros_like(p))

    def update_leaf(
        g: torch.Tensor, s: ScaleBySparseAdamState, p: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ScaleBySparseAdamState]:
        count = s.count + 1
        g = (g.neg() if maximize else g).coalesce()
        values = g._values()
        if values.numel() == 0:  # nothing to move; the step is counted, as torch counts it
            return g, ScaleBySparseAdamState(count, s.mu, s.nu)
        old_mu, old_nu = s.mu.sparse_mask(g)._values(), s.nu.sparse_mask(g)._values()
        mu_change = values.sub(old_mu).mul(1 - b1)
        nu_change = values.pow(2).sub(old_nu).mul(1 - b2)
        mu, nu = s.mu + _at_indices_of(g, mu_change), s.nu + _at_indices_of(g, nu_change)
        t = as_scalar(count)
        step_size = learning_rate * bias_correction(b2, t).sqrt() / bias_correction(b1, t)
        direction = mu_change.add(old_mu).div(nu_change.add(old_nu).sqrt().add(eps))
        return _at_indices_of(g, -step_size * direction), ScaleBySparseAdamState(count, mu, nu)

    return leafwise(ScaleBySparseAdamState, init_leaf, update_leaf, name="scale_by_sparse_adam", sparse_gradients=True)


def _at_indices_of(g: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor with ``values`` at the indices of the coalesced ``g`` (valid by
    construction, so torch's invariant checks are skipped)."""
    return torch.sparse_coo_tensor(g._indices(), values, g.shape, check_invariants=False, is_coalesced=True)
