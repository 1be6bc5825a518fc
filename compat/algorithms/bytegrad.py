"""Bagua's ByteGrad: gradients averaged in 8 bits. Each bucket is cut into one chunk per rank,
each chunk quantized with its own minimum and maximum (255 levels); rank ``j`` receives every
rank's chunk ``j``, averages the dequantized copies, quantizes the result again and sends it to
every rank. Every rank ends with the same bits, within half a quantization step of each rounding
of the exact average (``minmax_uint8`` of ``functional_bagua.distributed.compression``)."""

from __future__ import annotations

from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, engine_on_demand  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.algorithms.gradient_allreduce import GradientAllReduceAlgorithmImpl
from functional_bagua.compat.bucket import BaguaBucket  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.communication import BaguaProcessGroup
from functional_bagua.compat.tensor import BaguaTensor  # noqa: F401  # Bagua's module exports it

__all__ = ["ByteGradAlgorithm", "ByteGradAlgorithmImpl"]


class ByteGradAlgorithmImpl(GradientAllReduceAlgorithmImpl):
    """:class:`~functional_bagua.compat.algorithms.gradient_allreduce.GradientAllReduceAlgorithmImpl` with the
    ``minmax_uint8`` codec.

    Args:
        process_group: the group to average over.
        hierarchical: accepted for Bagua's scripts; the reduction is flat over all ranks.
        average: the mean over the ranks (``True``) or the sum.
    """

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True, average: bool = True) -> None:
        super().__init__(process_group, hierarchical, average, compression="minmax_uint8")


class ByteGradAlgorithm(Algorithm):
    """Average the gradients in 8 bits (module docstring; Bagua's signature).

    Args:
        hierarchical: accepted for Bagua's scripts (Bagua first reduced within each machine in full
            precision); here one flat compressed reduction over all ranks.
        average: the mean over the ranks (``True``) or the sum.
    """

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        self.hierarchical, self.average = hierarchical, average

    def reify(self, process_group: BaguaProcessGroup) -> ByteGradAlgorithmImpl:
        return ByteGradAlgorithmImpl(process_group, self.hierarchical, self.average)


__getattr__ = engine_on_demand(__name__)  # Bagua's module exports BaguaDistributedDataParallel
