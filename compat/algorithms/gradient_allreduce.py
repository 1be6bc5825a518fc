"""Bagua's GradientAllReduce: the gradients averaged (or summed) over the ranks after each backward,
as torch's DDP does; the communication overlaps backward (:class:`~functional_bagua.distributed.GradientReducer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, engine_on_demand
from functional_bagua.compat.bucket import BaguaBucket  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.communication import BaguaProcessGroup
from functional_bagua.distributed import GradientReducer

if TYPE_CHECKING:
    from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    """Gradients reduced over the ranks during backward, in the engine's buckets.

    Args:
        process_group: the group to average over.
        hierarchical: Bagua's two-level reduction (within each machine, then across machines'
            leaders); the result is the same average, and here it runs as one flat reduction over
            all ranks (torch's collectives pick their own topology).
        average: the mean over the ranks (``True``) or the sum.
        compression: a codec of ``functional_bagua.distributed.compression`` (``None``: exact).
    """

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        hierarchical: bool = False,
        average: bool = True,
        compression: Optional[str] = None,
    ) -> None:
        super().__init__(process_group)
        self.hierarchical, self.average, self.compression = hierarchical, average, compression
        self.reducer: Optional[GradientReducer] = None

    def init(self, ddp: "BaguaDistributedDataParallel") -> None:
        self.reducer = GradientReducer(
            ddp.named_parameters_to_sync(),
            group=self.process_group.torch_group,
            bucket_cap_mb=ddp.bucket_cap_mb,
            average=self.average,
            compression=self.compression,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            find_unused_parameters=ddp.find_unused_parameters,
        )
        self.reducer.enabled = ddp.require_backward_grad_sync

    def set_gradient_sync(self, enabled: bool) -> None:
        if self.reducer is not None:
            self.reducer.enabled = enabled

    def detach(self, ddp: "BaguaDistributedDataParallel") -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None

    supports_join = True

    def shadow(self, ddp: "BaguaDistributedDataParallel") -> None:
        """One step's all-reduces with zero gradients (torch's Join; see GradientReducer.shadow)."""
        if self.reducer is not None:
            self.reducer.shadow()

    def buckets(self) -> list:
        return [] if self.reducer is None else list(self.reducer.buckets)

    def used_in_last_backward(self) -> Optional[list[bool]]:
        return None if self.reducer is None else self.reducer.used_in_last_backward

    def bytes_per_step(self, ddp: "BaguaDistributedDataParallel") -> int:
        return 0 if self.reducer is None else self.reducer.bytes_per_step()


class GradientAllReduceAlgorithm(Algorithm):
    """Average (or sum) the gradients over the ranks, as torch's DDP (Bagua's signature).

    Args:
        hierarchical: accepted for Bagua's scripts; the reduction is one flat all-reduce (see
            :class:`GradientAllReduceAlgorithmImpl`).
        average: the mean over the ranks (``True``) or the sum.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        self.hierarchical, self.average = hierarchical, average

    def reify(self, process_group: BaguaProcessGroup) -> GradientAllReduceAlgorithmImpl:
        return GradientAllReduceAlgorithmImpl(process_group, self.hierarchical, self.average)


__getattr__ = engine_on_demand(__name__)  # Bagua's module exports BaguaDistributedDataParallel
