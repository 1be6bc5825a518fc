"""Bagua's cache loader: values of an expensive function, cached by key in a key-value store.

    loader = CacheLoader(backend="store", dataset_name="train")
    sample = loader.get(index, lambda i: preprocess(raw[i]))    # computed once, then read back

Values are pickled and kept under ``"{dataset_name}_{key}"``. Where Bagua's store is a redis
cluster, the stores here are torch's and this process's own:

- ``"store"``: a ``torch.distributed.Store`` shared by every rank (the default process group's,
  or the one given as ``store=``): a value one rank computed is read by the others.
- ``"memory"``: this process's own store (a ``torch.distributed.HashStore``).
- ``"redis"``, Bagua's default, is served by ``"store"`` when torch.distributed is initialized and
  by ``"memory"`` otherwise (with a warning naming the choice): the same cache semantics, without
  redis servers.

Writes are buffered (``writer_buffer_size`` values per write to the store) and read back from the
buffer until written. A process forked from the one that made the loader (a ``DataLoader``
worker) talks to the store through a connection of its own (``Store.clone``); with ``"memory"``,
each worker has its own cache.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any, Callable, Optional

import torch.distributed as dist

__all__ = ["CacheLoader"]

_BACKENDS = ("store", "memory", "redis")


class CacheLoader:
    """A cache of ``load_fn``'s values by key (module docstring).

    Args:
        backend: ``"store"``, ``"memory"`` or Bagua's ``"redis"`` (module docstring).
        dataset_name: the prefix of this loader's keys; loaders of one name share (and overwrite)
            their values.
        writer_buffer_size: how many new values to gather before one write to the store.
        store: the ``torch.distributed.Store`` of the ``"store"`` backend (the default process
            group's by default).
        **kwargs: Bagua's redis settings (``hosts``, ``cluster_mode``, ``capacity_per_node``), taken
            and unused: there are no redis servers here.

    Example::

        loader = CacheLoader(backend="memory", dataset_name="squares")
        loader.get(3, lambda k: k * k)   # 9, computed
        loader.get(3, lambda k: k * k)   # 9, from the cache
    """

    def __init__(
        self,
        backend: str = "redis",
        dataset_name: str = "",
        writer_buffer_size: int = 1,
        store: Optional[dist.Store] = None,
        **kwargs: Any,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"Invalid backend {backend!r}: one of {list(_BACKENDS)}")
        if writer_buffer_size < 1:
            raise ValueError(f"writer_buffer_size must be at least 1, got {writer_buffer_size}")
        self.backend = backend
        self.dataset_name = dataset_name
        self.writer_buffer_size = writer_buffer_size
        self.store = _store_for(backend, store)
        self._pid = os.getpid()  # the process whose connection self.store is
        self._pending: dict[str, bytes] = {}
        del kwargs  # Bagua's redis settings

    def get(self, key: Any, load_fn: Callable[[Any], Any]) -> Any:
        """The value cached for ``key``; made with ``load_fn(key)`` and cached where there is none.

        Args:
            key: the key (its ``str`` is part of the store's key).
            load_fn: computes the value of a key.
        """
        cache_key = f"{self.dataset_name}_{key}"
        held = self._pending.get(cache_key)
        if held is None and self._store().check([cache_key]):
            held = self._store().get(cache_key)
        if held is not None:
            return pickle.loads(held)
        value = load_fn(key)
        self._pending[cache_key] = pickle.dumps(value)
        if len(self._pending) >= self.writer_buffer_size:
            self.flush()
        return value

    def flush(self) -> None:
        """Write the buffered values to the store."""
        if not self._pending:
            return
        keys, values = list(self._pending), list(self._pending.values())
        store = self._store()
        store.multi_set(keys, values)  # type: ignore[attr-defined]  # in torch, not in its stubs
        for key in keys:  # counted once, by whichever rank wrote a key first
            if store.add(f"{key}#written", 1) == 1:
                store.add(self._count_key(), 1)
        self._pending.clear()

    def num_keys(self) -> int:
        """The number of keys cached under this loader's ``dataset_name`` (written ones)."""
        return self._store().add(self._count_key(), 0)

    def _store(self) -> dist.Store:
        """The store, through a connection of this process's own (a forked DataLoader worker's
        copy of the parent's would share its socket)."""
        if os.getpid() != self._pid:
            self.store, self._pid = self.store.clone(), os.getpid()  # type: ignore[attr-defined]  # not in the stubs
        return self.store

    def _count_key(self) -> str:
        return f"{self.dataset_name}#count"


def _store_for(backend: str, store: Optional[dist.Store]) -> dist.Store:
    if backend == "memory":
        return dist.HashStore()
    shared = dist.is_available() and dist.is_initialized()
    if store is not None:
        return store
    if backend == "store":
        if not shared:
            raise RuntimeError(
                "CacheLoader(backend='store') shares the default process group's store, and torch.distributed is "
                "not initialized: initialize it, pass store=..., or use backend='memory'"
            )
        return dist.distributed_c10d._get_default_store()
    choice = "torch.distributed's store" if shared else "this process's memory"
    warnings.warn(
        f"CacheLoader(backend='redis'): there are no redis servers here; the cache is in {choice} "
        "(backend='store' or 'memory' says so explicitly)",
        stacklevel=3,
    )
    return dist.distributed_c10d._get_default_store() if shared else dist.HashStore()
