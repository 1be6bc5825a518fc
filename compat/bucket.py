"""Bagua's buckets: the tensors an algorithm communicates together, and the operations that run
on them once all are ready (:mod:`functional_bagua.compat.backend`).

A :class:`BaguaBucket` holds proxies (:mod:`functional_bagua.compat.tensor`); its operations act on
their effective tensors, concatenated in order (``flattened_tensor()``). ``flatten=True`` first
moves the effective tensors into one flat storage, back to back. The operations an algorithm may
append, each run in the order appended:

- ``append_centralized_synchronous_op``: ``x <- mean_r x[r]`` (or the sum) over the group, in full
  precision or with Bagua's ``"MinMaxUInt8"`` codec (``minmax_uint8`` of
  ``functional_bagua.distributed.compression``);
- ``append_decentralized_synchronous_op``: ``peer_weight <- mean_r x[r]`` (``"all"``) or
  ``(x[rank] + x[peer]) / 2`` (``"shift_one"``, the peer of the op's k-th run); the bucket keeps
  its values until ``op.copy_back_peer_weight(bucket)``;
- ``append_low_precision_decentralized_synchronous_op``: one step of 8-bit decentralized SGD with
  the ring neighbours (:class:`~functional_bagua.compat.algorithms.decentralized.LowPrecisionDecentralizedAlgorithm`'s
  rule), the result written into the bucket;
- ``append_python_op``: ``f(bucket_name)``.

``hierarchical`` is accepted and the collectives are flat over the group (torch's collectives
pick their own topology), as in this layer's algorithms. Bagua's asynchronous model-average
operation is not offered here: :class:`~functional_bagua.compat.algorithms.async_model_average.AsyncModelAverageAlgorithm`
runs that algorithm.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from functional_bagua.compat.backend import PADDING_PREFIX, BackendBucket, get_backend
from functional_bagua.compat.communication import BaguaProcessGroup, _bagua_backend_comm, _get_default_group  # noqa: F401  # Bagua's module exports them
from functional_bagua.compat.tensor import BaguaTensor  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.utils import check_contiguous, get_flattened_tensor
from functional_bagua.distributed.averaging import PEER_SELECTION_MODES, mean_over_ranks, mean_with_peer
from functional_bagua.distributed.compression import all_reduce
from functional_bagua.distributed.process_group import Group, resolve

__all__ = ["BaguaBucket"]

CODECS = {None: None, "MinMaxUInt8": "minmax_uint8"}  # Bagua's compression names -> this library's


class BaguaBucket:
    """Tensors communicated together (module docstring; Bagua's signature).

    Args:
        tensors: proxies of one model (``ensure_bagua_tensor`` with its ``module_name``).
        name: the bucket's name, unique within the model.
        flatten: move the effective tensors into one flat storage first.
        alignment: pad the bucket with zeros to a multiple of this many elements.
    """

    def __init__(self, tensors: list, name: str, flatten: bool, alignment: int = 1) -> None:
        if not tensors:
            raise ValueError(f"BaguaBucket {name!r}: a bucket needs at least one tensor")
        if not all(hasattr(t, "_bagua_backend_tensor") for t in tensors):
            raise TypeError(
                f"BaguaBucket {name!r}: make each tensor a Bagua tensor first (tensor.ensure_bagua_tensor(...))"
            )
        modules = {t.bagua_module_name for t in tensors}
        if len(modules) != 1:
            raise ValueError(
                f"BaguaBucket {name!r}: the tensors of one bucket belong to one model, got {sorted(map(str, modules))}"
            )
        kinds = {(t.bagua_getter_closure().dtype, t.bagua_getter_closure().device) for t in tensors}
        if len(kinds) != 1:
            raise ValueError(
                f"BaguaBucket {name!r}: the tensors of one bucket share a dtype and a device (their operations "
                f"run on them as one flat tensor), got {sorted(map(str, kinds))}: put each kind in a bucket of its own"
            )
        self.tensors = list(tensors)
        self.bagua_module_name = tensors[0].bagua_module_name
        self._bagua_backend = get_backend(self.bagua_module_name)
        self.name = name
        self.padding_tensor: Optional[torch.Tensor] = None
        short = -sum(t.bagua_getter_closure().numel() for t in self.tensors) % alignment if alignment > 1 else 0
        if short:
            first = self.tensors[0].bagua_getter_closure()
            self.padding_tensor = torch.zeros(short, dtype=first.dtype, device=first.device)
            self.padding_tensor.ensure_bagua_tensor(f"{PADDING_PREFIX}_bucket_{name}", self.bagua_module_name)  # type: ignore[attr-defined]
        self._all_tensors = self.tensors + ([self.padding_tensor] if self.padding_tensor is not None else [])
        self.backend_tensor: Optional[torch.Tensor] = None
        self.flatten = flatten
        if flatten:
            self._flatten_()
        self.backend_bucket = BackendBucket(name, self._all_tensors)
        for t in self._all_tensors:
            t._bagua_bucket = self

    # ---- the tensors ---------------------------------------------------------------------------

    def effective_tensors(self) -> list[torch.Tensor]:
        """The effective tensors of the bucket (padding included), in order."""
        return [t.bagua_getter_closure() for t in self._all_tensors]

    def flattened_tensor(self) -> torch.Tensor:
        """A new 1-D tensor: the effective tensors' values back to back (padding included)."""
        return get_flattened_tensor(self.effective_tensors())  # type: ignore[return-value]

    def _flatten_(self) -> None:
        """Move the effective tensors into one flat storage, back to back, their values kept."""
        if self.check_flatten() and any(t.numel() for t in self.effective_tensors()):
            first = next(t for t in self.effective_tensors() if t.numel())
            total = sum(t.numel() for t in self.effective_tensors())
            self.backend_tensor = first.new_empty(0).set_(
                first.untyped_storage(), first.storage_offset(), (total,), (1,)
            )
            return
        flat = self.flattened_tensor()
        offset = 0
        for t in self._all_tensors:
            t.bagua_set_storage(flat.untyped_storage(), offset)
            offset += t.bagua_getter_closure().numel()
        self.backend_tensor = flat
        if not self.check_flatten():
            raise RuntimeError(f"BaguaBucket {self.name!r}: the effective tensors did not stay in the flat storage")

    def check_flatten(self) -> bool:
        """Whether the effective tensors lie back to back in memory (empty ones anywhere)."""
        return check_contiguous([t for t in self.effective_tensors() if t.numel()])

    def _write(self, values: torch.Tensor) -> None:
        """Copy the 1-D ``values`` into the effective tensors, in order."""
        with torch.no_grad():
            offset = 0
            for t in self.effective_tensors():
                t.copy_(values[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def bytes(self) -> int:
        """The bytes of the bucket's effective tensors (padding excluded)."""
        return sum(t.bagua_getter_closure().numel() * t.bagua_getter_closure().element_size() for t in self.tensors)

    # ---- the operations ------------------------------------------------------------------------

    def _group(self, group: Optional[BaguaProcessGroup]) -> Group:
        return resolve((group if group is not None else _get_default_group()).torch_group, f"BaguaBucket {self.name!r}")

    def _flat_sized(self, tensor: Any, what: str) -> None:
        """Raise a ValueError unless ``tensor``'s effective tensor is 1-D, of the bucket's size,
        dtype and device (what ``flattened_tensor()`` gives)."""
        effective, members = tensor.bagua_getter_closure(), self.effective_tensors()
        flat = ((sum(t.numel() for t in members),), members[0].dtype, members[0].device)  # no copy made to compare
        if (tuple(effective.shape), effective.dtype, effective.device) != flat:
            raise ValueError(
                f"BaguaBucket {self.name!r}: {what} is {tuple(effective.shape)} {effective.dtype} on {effective.device}, "
                f"the bucket flat {flat[0]} {flat[1]} on {flat[2]}; make it with "
                "bucket.flattened_tensor().ensure_bagua_tensor(...)"
            )

    def append_python_op(
        self, python_function: Callable[[str], None], group: Optional[BaguaProcessGroup] = None
    ) -> None:
        """Append ``python_function(bucket_name)``.

        Args:
            python_function: the operation.
            group: kept for Bagua's signature (the function runs on the current stream).
        """
        self.backend_bucket.append_op(python_function)

    def append_centralized_synchronous_op(
        self,
        hierarchical: bool = False,
        average: bool = True,
        scattergather: bool = False,
        compression: Optional[str] = None,
        group: Optional[BaguaProcessGroup] = None,
    ) -> None:
        """Append ``x <- mean_r x[r]`` (or the sum) over the group.

        Args:
            hierarchical: accepted; the reduction is flat (module docstring).
            average: the mean (``True``) or the sum.
            scattergather: accepted (the compressed reduction always scatters and gathers).
            compression: ``None`` or ``"MinMaxUInt8"``.
            group: the group (``None``: the default group).
        """
        if compression not in CODECS:
            raise ValueError(
                f"BaguaBucket {self.name!r}: compression must be None or 'MinMaxUInt8', got {compression!r}"
            )
        g, codec = self._group(group), CODECS[compression]

        def centralized(name: str) -> None:
            self._write(all_reduce([self.flattened_tensor()], g, average, codec)[0])

        self.backend_bucket.append_op(centralized)

    def append_decentralized_synchronous_op(
        self,
        peer_weight: Any,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        group: Optional[BaguaProcessGroup] = None,
    ) -> "DecentralizedSynchronousOp":
        """Append the decentralized average into ``peer_weight`` (module docstring); returns the
        operation, whose ``copy_back_peer_weight(bucket)`` writes the average into the bucket.

        Args:
            peer_weight: a proxy of the bucket's size (``bucket.flattened_tensor().ensure_bagua_tensor(...)``).
            hierarchical: accepted; flat (module docstring).
            peer_selection_mode: ``"all"`` or ``"shift_one"`` (an even number of ranks).
            group: the group (``None``: the default group).
        """
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(f"peer_selection_mode must be one of {PEER_SELECTION_MODES}, got {peer_selection_mode!r}")
        self._flat_sized(peer_weight, "peer_weight")
        g = self._group(group)
        if peer_selection_mode == "shift_one" and g.world_size % 2:
            raise ValueError(f"peer_selection_mode='shift_one' needs an even number of ranks, got {g.world_size}")
        op = DecentralizedSynchronousOp(self, peer_weight, peer_selection_mode, g)
        return self.backend_bucket.append_op(op)

    def append_low_precision_decentralized_synchronous_op(
        self,
        weight: Any,
        left_peer_weight: Any,
        right_peer_weight: Any,
        hierarchical: bool = True,
        compression: str = "MinMaxUInt8",
        group: Optional[BaguaProcessGroup] = None,
    ) -> None:
        """Append one step of 8-bit decentralized SGD with the ring neighbours (module docstring).

        Args:
            weight: this rank's compressed replica ``x_hat``, a proxy of the bucket's size.
            left_peer_weight: the left neighbour's replica, as this rank knows it.
            right_peer_weight: the right neighbour's replica, as this rank knows it.
            hierarchical: accepted; flat (module docstring).
            compression: ``"MinMaxUInt8"``.
            group: the group (``None``: the default group).
        """
        from functional_bagua.compat.algorithms.decentralized import low_precision_ring_step

        if compression != "MinMaxUInt8":
            raise ValueError(f"BaguaBucket {self.name!r}: compression must be 'MinMaxUInt8', got {compression!r}")
        for tensor, what in (
            (weight, "weight"),
            (left_peer_weight, "left_peer_weight"),
            (right_peer_weight, "right_peer_weight"),
        ):
            self._flat_sized(tensor, what)
        g = self._group(group)

        @torch.no_grad()
        def low_precision_decentralized(name: str) -> None:
            x_hat, left, right = (t.bagua_getter_closure() for t in (weight, left_peer_weight, right_peer_weight))
            self._write(low_precision_ring_step(self.flattened_tensor(), x_hat, left, right, g))

        self.backend_bucket.append_op(low_precision_decentralized)

    def append_asynchronous_model_average_op(
        self, peer_selection_mode: str, group: Optional[BaguaProcessGroup] = None
    ) -> None:
        """Not offered here (module docstring): raises a NotImplementedError naming the algorithm that is.

        Args:
            peer_selection_mode: Bagua's argument.
            group: Bagua's argument.
        """
        raise NotImplementedError(
            "BaguaBucket.append_asynchronous_model_average_op: this layer runs asynchronous model averaging "
            "as an algorithm of its own; use bagua.torch_api.algorithms.async_model_average.AsyncModelAverageAlgorithm"
        )

    def clear_ops(self) -> "BaguaBucket":
        """Forget the operations appended so far; returns the bucket."""
        self.backend_bucket.clear_ops()
        return self


class DecentralizedSynchronousOp:
    """The decentralized average of a bucket into ``peer_weight`` (see
    :meth:`BaguaBucket.append_decentralized_synchronous_op`).

    Args:
        bucket: the bucket averaged.
        peer_weight: the proxy the average is written into.
        peer_selection_mode: ``"all"`` or ``"shift_one"``.
        group: the resolved group.
    """

    def __init__(self, bucket: BaguaBucket, peer_weight: Any, peer_selection_mode: str, group: Group) -> None:
        self.bucket, self.peer_weight, self.mode, self.group = bucket, peer_weight, peer_selection_mode, group
        self.communications = 0  # the shift_one peer changes with each run

    @torch.no_grad()
    def __call__(self, name: str) -> None:
        mine = [self.bucket.flattened_tensor()]
        if self.mode == "all":
            average = mean_over_ranks(mine, self.group)[0]
        else:
            average = mean_with_peer(mine, self.group, self.communications)[0]
        self.communications += 1
        self.peer_weight.bagua_getter_closure().copy_(average)

    def copy_back_peer_weight(self, bucket: Any) -> None:
        """Write the last average into the bucket's effective tensors.

        Args:
            bucket: the bucket (or its ``backend_bucket``, as Bagua's algorithms pass it).
        """
        self.bucket._write(self.peer_weight.bagua_getter_closure())
