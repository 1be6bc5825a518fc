"""``torch.distributed.optim`` on functional_bagua: a script changes ``torch.distributed.optim`` to
``functional_bagua.compat.optim`` (and ``torch.distributed.algorithms.model_averaging.averagers`` to
``functional_bagua.compat.optim.averagers``).

- :class:`PostLocalSGDOptimizer` with the averagers of :mod:`~functional_bagua.compat.optim.averagers`.
"""

from functional_bagua.compat.optim import averagers
from functional_bagua.compat.optim.post_local_sgd import PostLocalSGDOptimizer

__all__ = ["PostLocalSGDOptimizer", "averagers"]
