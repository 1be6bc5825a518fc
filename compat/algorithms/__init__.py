"""Bagua's data-parallel algorithms (``bagua.torch_api.algorithms``), on functional_bagua's collectives.

``Algorithm.init(name, **kwargs)`` builds one by its registry name: ``"gradient_allreduce"``,
``"bytegrad"``, ``"decentralized"``, ``"low_precision_decentralized"``, ``"qadam"``, ``"async"``.
"""

from functional_bagua.compat.algorithms import (
    async_model_average,
    bytegrad,
    decentralized,
    gradient_allreduce,
    q_adam,
)
from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

for _name, _cls in (
    ("gradient_allreduce", gradient_allreduce.GradientAllReduceAlgorithm),
    ("bytegrad", bytegrad.ByteGradAlgorithm),
    ("decentralized", decentralized.DecentralizedAlgorithm),
    ("low_precision_decentralized", decentralized.LowPrecisionDecentralizedAlgorithm),
    ("qadam", q_adam.QAdamAlgorithm),
    ("async", async_model_average.AsyncModelAverageAlgorithm),
):
    if _name not in GlobalAlgorithmRegistry:
        GlobalAlgorithmRegistry.register(_name, _cls)

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "GlobalAlgorithmRegistry",
    "async_model_average",
    "bytegrad",
    "decentralized",
    "gradient_allreduce",
    "q_adam",
]
