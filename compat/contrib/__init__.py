"""Bagua's ``bagua.torch_api.contrib``: the fused optimizer (:mod:`functional_bagua.compat.fuse`)."""

from functional_bagua.compat.fuse import fuse_optimizer, fuse_step, fused_steps, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "fused_steps", "is_fused_optimizer"]
