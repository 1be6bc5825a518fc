"""Bagua's data-parallel algorithms (``bagua.torch_api.algorithms``), on functional_bagua's collectives.

``Algorithm.init(name, **kwargs)`` builds one by its registry name: ``"gradient_allreduce"``,
``"bytegrad"``, ``"decentralized"``, ``"low_precision_decentralized"``, ``"qadam"``, ``"async"``.
"""

from functional_bagua.compat.algorithms import bytegrad, gradient_allreduce
from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

GlobalAlgorithmRegistry.register("gradient_allreduce", gradient_allreduce.GradientAllReduceAlgorithm)
GlobalAlgorithmRegistry.register("bytegrad", bytegrad.ByteGradAlgorithm)

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry", "bytegrad", "gradient_allreduce"]
