"""Bagua's cached dataset: a dataset whose samples, once made, are read back from a cache
(:class:`~functional_bagua.compat.contrib.cache_loader.CacheLoader`, keyed by index).

    dataset = CachedDataset(SlowDataset(), backend="store", dataset_name="train")
    loader = torch.utils.data.DataLoader(dataset, batch_size=32)
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.utils.data import Dataset

from functional_bagua.compat.contrib.cache_loader import CacheLoader

__all__ = ["CachedDataset"]


class CachedDataset(Dataset):
    """``dataset`` with its samples cached by index.

    Args:
        dataset: the dataset to wrap (of constant length).
        backend: the cache's store, as :class:`~functional_bagua.compat.contrib.cache_loader.CacheLoader`'s.
        dataset_name: the prefix of the cache's keys.
        writer_buffer_size: new samples gathered before one write to the store.
        store: the ``torch.distributed.Store`` of the ``"store"`` backend.
        **kwargs: Bagua's redis settings, taken and unused.
    """

    def __init__(
        self,
        dataset: Dataset,
        backend: str = "redis",
        dataset_name: str = "",
        writer_buffer_size: int = 20,
        store: Optional[dist.Store] = None,
        **kwargs: Any,
    ) -> None:
        self.dataset = dataset
        self.cache_loader = CacheLoader(backend, dataset_name, writer_buffer_size, store=store, **kwargs)

    def __getitem__(self, item: Any) -> Any:
        return self.cache_loader.get(item, self.dataset.__getitem__)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
