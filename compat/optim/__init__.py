"""``torch.distributed.optim`` on functional_bagua: a script changes ``torch.distributed.optim`` to
``functional_bagua.compat.optim`` (and ``torch.distributed.algorithms.model_averaging.averagers`` to
``functional_bagua.compat.optim.averagers``).

- :class:`ZeroRedundancyOptimizer` (:mod:`~functional_bagua.compat.optim.zero`);
- :class:`DistributedOptimizer` over RPC (:mod:`~functional_bagua.compat.optim.distributed_optimizer`);
- :class:`PostLocalSGDOptimizer` with the averagers of :mod:`~functional_bagua.compat.optim.averagers`.
"""

from functional_bagua.compat.optim import averagers
from functional_bagua.compat.optim.distributed_optimizer import DistributedOptimizer
from functional_bagua.compat.optim.post_local_sgd import PostLocalSGDOptimizer
from functional_bagua.compat.optim.zero import ZeroRedundancyOptimizer

__all__ = ["DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer", "averagers"]
