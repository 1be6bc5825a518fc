"""Bagua's ``bagua.torch_api.contrib``: the fused optimizer (:mod:`functional_bagua.compat.fuse`),
the load-balancing samplers (:mod:`functional_bagua.compat.contrib.load_balancing_data_loader`) and
the cached dataset and loader (:mod:`functional_bagua.compat.contrib.cache_loader`)."""

from functional_bagua.compat.contrib.cache_loader import CacheLoader
from functional_bagua.compat.contrib.cached_dataset import CachedDataset
from functional_bagua.compat.contrib.load_balancing_data_loader import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)
from functional_bagua.compat.fuse import fuse_optimizer, fuse_step, fused_steps, is_fused_optimizer

__all__ = [
    "CacheLoader",
    "CachedDataset",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "fuse_optimizer",
    "fuse_step",
    "fused_steps",
    "is_fused_optimizer",
]
