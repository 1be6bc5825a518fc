"""Bagua's communication backend: per model, the ordered buckets whose operations run once their
tensors are marked ready.

A model's algorithm registers its buckets in order (``register_ordered_buckets``); each bucket
holds the operations its algorithm appended (:mod:`functional_bagua.compat.bucket`). Marking a
tensor ready (``tensor.bagua_mark_communication_ready()``) runs, in the registered order, the
operations of every bucket at the head of the order whose tensors are all ready: bucket ``k``
runs only after buckets ``0..k-1`` did, so that every rank issues its collectives in the same
order. The operations run at once, on the calling thread and the current stream (Bagua ran them
on a thread and a stream of its own), so ``wait_pending_comm_ops()`` finds nothing left to wait
for; as Bagua's, it does not wait for buckets whose tensors are not all ready yet (an algorithm
may mark a bucket's tensors in several hooks, one optimizer's parameters at a time).
:meth:`CommBackend.incomplete` names the tensors a round still waits for.

:func:`get_backend` gives each model name its backend, as Bagua's: one per name for as long as
something holds it (the wrapped model's engine and its tensors do).
"""

from __future__ import annotations

import weakref
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

    def started(self) -> bool:
        """Whether a tensor of the bucket was marked ready in this round."""
        return any(not n.startswith(PADDING_PREFIX) for n in self.ready)

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
        """Replace the model's buckets by ``buckets``, run in this order; a ValueError where two
        tensors share a name or one tensor is in two buckets.

        Args:
            buckets: the buckets' backend sides (``bucket.backend_bucket``).
        """
        names: dict[str, str] = {}
        holders: dict[int, str] = {}
        for bucket in buckets:
            for name, tensor in zip(bucket.names, bucket.tensors):
                if name in names or id(tensor) in holders:
                    raise ValueError(
                        f"model {self.model_name!r}: Bagua tensor {name!r} of bucket {bucket.name!r} is in bucket "
                        f"{names.get(name, holders.get(id(tensor)))!r} too (a tensor or a name used twice): give every "
                        "tensor its own name (ensure_bagua_tensor(name, ...)) and put it in one bucket"
                    )
                names[name], holders[id(tensor)] = bucket.name, bucket.name
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
        """Return once every operation due ran (they already have: module docstring)."""

    def incomplete(self) -> list[str]:
        """``"bucket 'b': [names]"`` for each bucket of this round that waits for tensors not
        marked ready yet (empty when every bucket ran, or none has started)."""
        if self.next == 0 and not any(b.started() for b in self.buckets):
            return []
        return [f"bucket {b.name!r}: {b.missing()}" for b in self.buckets[self.next :]]

    def start_round(self) -> None:
        """Forget the marks of the current round (a bucket half marked starts again)."""
        for bucket in self.buckets:
            bucket.reset()
        self.next = 0

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


_backends: "weakref.WeakValueDictionary[str, CommBackend]" = weakref.WeakValueDictionary()


def get_backend(model_name: str) -> CommBackend:
    """The backend of the model named ``model_name`` (module docstring).

    Args:
        model_name: the model's ``bagua_module_name``.
    """
    backend = _backends.get(model_name)
    if backend is None:
        backend = _backends[model_name] = CommBackend(model_name)
    return backend
