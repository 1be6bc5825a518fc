"""Bagua's ``bagua.torch_api.data_parallel``:
:func:`~functional_bagua.compat.data_parallel.distributed.DistributedDataParallel`."""

from functional_bagua.compat.data_parallel.distributed import DistributedDataParallel, DistributedDataParallel_V1_9_0

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0"]
