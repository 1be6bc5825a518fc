"""Bagua's communication backend: per model, the ordered buckets whose operations run once their
tensors are marked ready.

A model's algorithm registers its buckets in order (``register_ordered_buckets``); each bucket
holds the operations its algorithm appended (:mod:`functional_bagua.compat.bucket`). Marking a
tensor ready (``tensor.bagua_mark_communication_ready()``) runs, in the registered order, the
operations of every bucket at the head of the order whose tensors are all ready: bucket ``k``
runs only after buckets ``0..k-1`` did, so that every rank issues its collectives in the same
order. The operations run at once, on the calling thread and the current stream (Bagua ran them
on a thread and a stream of its own); ``wait_pending_comm_ops()`` then finds nothing left to
wait for, and raises, naming them, where some tensors of a bucket were never marked (Bagua waited
for them forever).

:func:`get_backend` gives each model name its backend, as Bagua's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

PADDING_PREFIX = "bagua_padding_tensor"  # a bucket's padding is ready from the start (Bagua's rule)

__all__ = ["BackendBucket", "CommBackend", "get_backend"]


class BackendBucket:
    """The backend's side of one bucket: its tensors' names, its operations, and which tensors
    are ready in the current round.

    Args:
        name: the bucket's name.
        tensors: the proxies of the bucket (padding included), in order.
    """

    def __init__(self, name: str, tensors: Sequence[Any]) -> None:
        self.name = name
        self.tensors = list(tensors)
        self.names = [t.bagua_tensor_name for t in self.tensors]
        self.ops: list[Callable[[str], Any]] = []
        self.ready: set[str] = set()
        self.reset()

    def append_op(self, op: Callable[[str], Any]) -> Any:
        """Append ``op`` (called with the bucket's name when the bucket runs); returns it.

        Args:
            op: the operation.
        """
        self.ops.append(op)
        return op

    def clear_ops(self) -> None:
        """Forget every operation."""
        self.ops = []

    def reset(self) -> None:
        """A new round: only the padding is ready."""
        self.ready = {n for n in self.names if n.startswith(PADDING_PREFIX)}

    def mark_ready(self, name: str) -> None:
        """Record that the tensor ``name`` is ready.

        Args:
            name: a tensor of this bucket.
        """
        self.ready.add(name)

    def is_ready(self) -> bool:
        """Whether every tensor of the bucket is ready."""
        return len(self.ready) == len(set(self.names))

    def missing(self) -> list[str]:
        """The tensors not marked ready in this round."""
        return [n for n in self.names if n not in self.ready]

    def execute(self) -> None:
        """Run the operations in the order they were appended, then start a new round."""
        for op in self.ops:
            op(self.name)
        self.reset()


class CommBackend:
    """One model's backend (module docstring; Bagua's ``BaguaCommBackendPy``).

    Args:
        model_name: the model's ``bagua_module_name``.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.buckets: list[BackendBucket] = []
        self.next = 0  # the first bucket of the order not run in this round

    def register_ordered_buckets(self, buckets: Sequence[BackendBucket]) -> None:
        """Replace the model's buckets by ``buckets``, run in this order.

        Args:
            buckets: the buckets' backend sides (``bucket.backend_bucket``).
        """
        self.buckets = list(buckets)
        for bucket in self.buckets:
            bucket.reset()
        self.next = 0

    def mark_communication_ready(self, tensor: Any, ready_cuda_event: Optional[int] = None) -> None:
        """Record that ``tensor`` is ready and run every bucket now due (module docstring).

        Args:
            tensor: the proxy's backend tensor (``proxy.bagua_backend_tensor()``).
            ready_cuda_event: Bagua's CUDA event; not needed here (the operations run at once).
        """
        bucket = self._bucket_of(tensor)
        bucket.mark_ready(tensor.name)
        while self.next < len(self.buckets) and self.buckets[self.next].is_ready():
            self.buckets[self.next].execute()
            self.next = (self.next + 1) % len(self.buckets)
            if self.next == 0:
                break

    def wait_pending_comm_ops(self) -> None:
        """Return once every due operation ran (they already have: module docstring); raise a
        RuntimeError naming the tensors never marked ready where a round is incomplete."""
        started = [b for b in self.buckets if b.ready != {n for n in b.names if n.startswith(PADDING_PREFIX)}]
        if self.next == 0 and not started:
            return
        missing = [f"bucket {b.name!r}: {b.missing()}" for b in self.buckets[self.next :] if b.missing()]
        for bucket in self.buckets:
            bucket.reset()
        self.next = 0
        raise RuntimeError(
            f"model {self.model_name!r}: these tensors were not marked ready in this round, so their "
            f"buckets' operations never ran (Bagua would wait forever): {'; '.join(missing)}. A parameter "
            "that got no gradient is never marked: give every parameter a gradient in each backward, or "
            "mark it yourself"
        )

    def _bucket_of(self, tensor: Any) -> BackendBucket:
        proxy_bucket = getattr(tensor.proxy, "_bagua_bucket", None)
        bucket = None if proxy_bucket is None else proxy_bucket.backend_bucket
        if bucket is None or not any(bucket is b for b in self.buckets):
            raise RuntimeError(
                f"Bagua tensor {tensor.name!r} is in no bucket registered with model {self.model_name!r}'s "
                "backend: put it in a BaguaBucket and register the buckets (the engine does, after "
                "tensors_to_buckets)"
            )
        return bucket


@functools.lru_cache(maxsize=None)
def get_backend(model_name: str) -> CommBackend:
    """The backend of the model named ``model_name`` (one per name, as Bagua's).

    Args:
        model_name: the model's ``bagua_module_name``.
    """
    return CommBackend(model_name)
