"""``torch.distributed.optim`` on functional_bagua: a script changes ``torch.distributed.optim`` to
``functional_bagua.compat.optim`` (and ``torch.distributed.algorithms.model_averaging.averagers`` to
``functional_bagua.compat.optim.averagers``).

- :class:`~functional_bagua.compat.optim.zero.ZeroRedundancyOptimizer` (:mod:`~functional_bagua.compat.optim.zero`),
  and torch DDP's ZeRO hooks :func:`~functional_bagua.compat.optim.ddp_zero_hook.hook_with_zero_step` /
  :func:`~functional_bagua.compat.optim.ddp_zero_hook.hook_with_zero_step_interleaved` for
  ``overlap_with_ddp=True`` (:mod:`~functional_bagua.compat.optim.ddp_zero_hook`);
- :class:`~functional_bagua.compat.optim.distributed_optimizer.DistributedOptimizer` over RPC
  (:mod:`~functional_bagua.compat.optim.distributed_optimizer`);
- :class:`~functional_bagua.compat.optim.post_local_sgd.PostLocalSGDOptimizer` with the averagers of
  :mod:`~functional_bagua.compat.optim.averagers`.
"""

from functional_bagua.compat.optim import averagers
from functional_bagua.compat.optim.ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved
from functional_bagua.compat.optim.distributed_optimizer import DistributedOptimizer
from functional_bagua.compat.optim.post_local_sgd import PostLocalSGDOptimizer
from functional_bagua.compat.optim.zero import ZeroRedundancyOptimizer

__all__ = [
    "DistributedOptimizer",
    "PostLocalSGDOptimizer",
    "ZeroRedundancyOptimizer",
    "averagers",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
]
