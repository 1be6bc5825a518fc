"""Bagua's ``bagua.torch_api.contrib``: the fused optimizer (:mod:`functional_bagua.compat.fuse`) and
the load-balancing samplers (:mod:`functional_bagua.compat.contrib.load_balancing_data_loader`)."""

from functional_bagua.compat.contrib.load_balancing_data_loader import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)
from functional_bagua.compat.fuse import fuse_optimizer, fuse_step, fused_steps, is_fused_optimizer

__all__ = [
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "fuse_optimizer",
    "fuse_step",
    "fused_steps",
    "is_fused_optimizer",
]
