"""Layer-wise trust ratio (LARS: You et al., 2017; LAMB: You et al., 2020), per tensor::

    r = trust_coefficient * ||p|| / (||u|| + eps)        (r = 1 if ||p|| = 0 or ||u|| = 0)
    u <- r * u

Inside a fused update the norms of all tensors of a flat buffer are taken at once
(:mod:`functional_bagua.segments`), so fused LAMB/LARS cost a few ops whatever the number of tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from functional_bagua import segments
from functional_bagua.base import GradientTransformation
from functional_bagua.transforms.leafwise import stateless


def ratio_of_norms(
    p_norm: torch.Tensor, u_norm: torch.Tensor, trust_coefficient: float = 1.0, eps: float = 0.0
) -> torch.Tensor:
    """The trust ratio from the norms (elementwise: one ratio per pair of norms).

    Args:
        p_norm: the norms of the parameters.
        u_norm: the norms of the updates, of ``p_norm``'s shape.
        trust_coefficient: the factor of the ratio ``trust_coefficient * p_norm / (u_norm + eps)``.
        eps: added to ``u_norm`` in the denominator.

    Returns:
        A tensor of ratios, 1 where either norm is 0.
    """
    ratio = trust_coefficient * p_norm / (u_norm + eps)
    return torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)


def trust_ratio(p: torch.Tensor, u: torch.Tensor, trust_coefficient: float = 1.0, eps: float = 0.0) -> torch.Tensor:
    """The 0-dim trust ratio of one tensor (module docstring).

    Args:
        p: the parameter tensor.
        u: its update.
        trust_coefficient: the factor of the ratio, as in ``ratio_of_norms``.
        eps: added to ``||u||`` in the denominator.

    Returns:
        A 0-dim tensor, ``trust_coefficient * ||p|| / (||u|| + eps)``, or 1 if either norm is 0.
    """
    return ratio_of_norms(p.norm(), u.norm(), trust_coefficient, eps)


def scale_by_trust_ratio(trust_coefficient: float = 1.0, eps: float = 0.0) -> GradientTransformation:
    """``u = trust_ratio(p, u) * u`` per tensor (module docstring). Example (LAMB)::

        lamb = chain(scale_by_adam(eps=1e-6), add_decayed_weights(0.01),
                     scale_by_trust_ratio(), scale_by_learning_rate(1e-3))

    Args:
        trust_coefficient: the factor of the ratio ``trust_coefficient * ||p|| / (||u|| + eps)``.
        eps: added to ``||u||`` in the denominator.

    Returns:
        A stateless GradientTransformation; its ``update`` needs the parameters.
    """

    def per_tensor(u: torch.Tensor, p: Optional[torch.Tensor]) -> torch.Tensor:
        assert p is not None  # needs_params: update gets the parameters
        return u * trust_ratio(p, u, trust_coefficient, eps)

    def per_buffer(u: torch.Tensor, p: Optional[torch.Tensor], lengths: list, key: str) -> torch.Tensor:
        assert p is not None  # needs_params: update gets the parameters
        p_norms, u_norms = segments.norms_of_whole_tensors(key, lengths, p, u)  # over DTensors' shards too
        ratios = ratio_of_norms(p_norms, u_norms, trust_coefficient, eps)
        return segments.scale(u, ratios, lengths)

    return stateless(per_tensor, name="scale_by_trust_ratio", needs_params=True, per_tensor=True, per_buffer=per_buffer)
