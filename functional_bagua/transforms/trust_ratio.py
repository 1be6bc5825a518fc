"""Layer-wise trust ratio (LARS: You et al., 2017; LAMB: You et al., 2020), per tensor::

    r = trust_coefficient * ||p|| / (||u|| + eps)        (r = 1 if ||p|| = 0 or ||u|| = 0)
    u <- r * u

Inside a fused update the norms of all tensors of a flat buffer are taken at once
(:mod:`functional_bagua.segments`), so fused LAMB/LARS cost a few ops whatever the number of tensors.
"""

from __future__ import annotations

import torch

from functional_bagua import segments
from functional_bagua.base import GradientTransformation
from functional_bagua.transforms.leafwise import stateless


def ratio_of_norms(p_norm: torch.Tensor, u_norm: torch.Tensor, trust_coefficient: float = 1.0, eps: float = 0.0) -> torch.Tensor:
    """The trust ratio from the norms (elementwise: one ratio per pair of norms)."""
    ratio = trust_coefficient * p_norm / (u_norm + eps)
    return torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)


def trust_ratio(p: torch.Tensor, u: torch.Tensor, trust_coefficient: float = 1.0, eps: float = 0.0) -> torch.Tensor:
    """The 0-dim trust ratio of one tensor (module docstring)."""
    return ratio_of_norms(p.norm(), u.norm(), trust_coefficient, eps)


def scale_by_trust_ratio(trust_coefficient: float = 1.0, eps: float = 0.0) -> GradientTransformation:
    """``u = trust_ratio(p, u) * u`` per tensor (module docstring). Example (LAMB)::

        lamb = chain(scale_by_adam(eps=1e-6), add_decayed_weights(0.01),
                     scale_by_trust_ratio(), scale_by_learning_rate(1e-3))
    """

    def per_tensor(u, p):
        return u * trust_ratio(p, u, trust_coefficient, eps)

    def per_buffer(u, p, lengths):
        ratios = ratio_of_norms(segments.norms(p, lengths), segments.norms(u, lengths), trust_coefficient, eps)
        return segments.scale(u, ratios, lengths)

    return stateless(per_tensor, name="scale_by_trust_ratio", needs_params=True, per_tensor=True, per_buffer=per_buffer)
