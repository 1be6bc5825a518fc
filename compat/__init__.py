"""functional_bagua.compat: legacy stateful APIs (Bagua, torch.distributed.optim) rebuilt on the
functional core. Installed from the repository's ``compat/`` folder as ``functional_bagua.compat``.

- :func:`fuse_optimizer`, :func:`fuse_step`, :func:`is_fused_optimizer`, :func:`fused_steps`:
  Bagua's fused optimizer for any ``torch.optim.Optimizer`` (:mod:`functional_bagua.compat.fuse`).
"""

from functional_bagua.compat.fuse import (
    fuse_optimizer,
    fuse_step,
    fused_steps,
    is_fused_optimizer,
)

__all__ = ["fuse_optimizer", "fuse_step", "fused_steps", "is_fused_optimizer"]
