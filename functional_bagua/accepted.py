"""What a checked eager step accepted, so that the next step on the same tensors need not check
them again.

``fb.Optimizer`` steps the same parameters, in a state it keeps, step after step. A step written
into the parameters (a link's ``apply_in_place``) checks every time that the gradients match the
parameters, that the state was made for them and that every tensor may be written in place
(:func:`~functional_bagua.foreach.writable_part`), and groups them; a leafwise rule's pure update
checks and groups the same: on a few small tensors that costs more than the step's own arithmetic. Where such a step stepped its whole state in place, an
:class:`AcceptedStep` records what those checks accepted:

- the parameters' tree structure and which of them had a gradient;
- the gradients' shapes, their one dtype and device (dense tensors that autograd does not record);
- where each parameter and state tensor starts in memory;
- the state the step returned (the same tensors, stepped in place), and the version counters of
  its per-tensor scalars (step counts), which the step reads as one value while they hold the
  same bits (a step whose state holds other 0-dim tensors keeps no record).

:meth:`AcceptedStep.inputs` gives the next step's gradients and parameters where they match, in a
few passes of attribute reads. Anything else (a gradient of a new shape or dtype, a parameter
moved or cast by ``p.data = ...``, a gradient that starts where a parameter or a state tensor
does, the state replaced, a count written in place by anyone else) gives ``None``: the step then
runs its checks again, and raises what they raise. A count written where autograd's version
counter does not see it (through its ``.data``, or its numpy view) is not seen, as autograd does
not see it either; counts made under ``torch.inference_mode`` (no version counter) keep no record.

A step on a record may run over slices of its tensors (:func:`in_cache_chunks`), one after the
other, so that a slice's tensors stay in the processor's cache between its operations (each
record holds its ``chunks``; a leafwise rule declared ``in_cache_chunks`` uses them).

``fb.Optimizer`` gives each group a dict for the records, around its step (:func:`kept_in`);
a step finds it with :func:`records_now`, and keeps its record there under a key of its own (its
transform's name, and which of its steps: written into the parameters, or the pure update).

Example::

    record = AcceptedStep.after(spec, given, grads, params, columns_before, state_after, columns_after)
    inputs = record.inputs(spec, next_update_leaves, next_param_leaves, state_after) if record else None
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
from typing import Any, Iterator, Optional

import optree
import torch

from functional_bagua import foreach

STRIDED = torch.strided

#: The parameter bytes a replayed step runs its rule over at once (:func:`in_cache_chunks`).
CHUNK_BYTES = 2 << 20


@dataclasses.dataclass
class AcceptedStep:
    """The inputs a step accepted (module docstring).

    Attributes:
        state: the state the step returned.
        spec: the parameters' tree structure.
        given: per leaf, whether it had a gradient.
        shapes: the shapes of the leaves with a gradient.
        dtype: their one dtype (of the gradients, parameters and state tensors alike).
        device: their one device.
        param_starts: where each parameter with a gradient starts in memory.
        columns: per field of the state, its tensors at the leaves with a gradient (``None``
            for a field that holds none).
        shared: per field, whether its tensors are 0-dim scalars the step read as one value.
        state_starts: where each tensor of ``columns`` starts, in order.
        taken: where the parameters and the state's tensors start (no gradient may).
        versions: per field, its tensors' version counters after the step where ``shared``.
        chunks: the slices of the leaves with a gradient that a replayed step runs its rule on
            one after the other (:func:`in_cache_chunks`).
    """

    state: Any
    spec: optree.PyTreeSpec
    given: list
    shapes: list
    dtype: torch.dtype
    device: torch.device
    param_starts: list
    columns: list
    shared: list
    state_starts: list
    taken: frozenset
    versions: list
    chunks: list

    @classmethod
    def after(
        cls,
        spec: optree.PyTreeSpec,
        given: list,
        grads: list,
        params: list,
        columns_before: list,
        state_after: Any,
        columns_after: list,
    ) -> Optional["AcceptedStep"]:
        """The record of a step that the checks accepted, ``None`` unless it stepped every
        tensor of its state in place: each of ``columns_after`` (per field, its values at the
        leaves with a gradient, after the step) holds the very tensors of ``columns_before``.

        Args:
            spec: the parameters' tree structure.
            given: per leaf, whether it had a gradient.
            grads: the gradients of the leaves with one.
            params: their parameters.
            columns_before: per field of the state, its values at those leaves before the step.
            state_after: the state the step returned.
            columns_after: the same after the step.
        """
        if not grads:
            return None
        dtype, device = grads[0].dtype, grads[0].device
        tensors = [*grads, *params]
        columns: list = []
        shared: list = []
        for before, after in zip(columns_before, columns_after):
            if all(v is None for v in before) and all(v is None for v in after):
                columns.append(None)
                shared.append(False)
                continue
            if any(a is not b for a, b in zip(after, before)) or not all(isinstance(t, torch.Tensor) for t in before):
                return None  # a field stepped into new tensors
            columns.append(list(before))
            shared.append(all(t.dim() == 0 for t in before))
            if not shared[-1] and any(t.dim() == 0 for t in before):
                return None  # 0-dim state beside tensors
            if shared[-1] and (
                any(t.is_inference() for t in before)  # no version counter to follow
                or isinstance(foreach._shared_or_leaves(list(before), beside=grads), foreach.Leaves)
            ):
                return None  # per-tensor scalars the step took one by one (they differ, or are float32)
            if not shared[-1]:
                tensors.extend(before)
        if not all(_plain(t, dtype, device) for t in tensors):
            return None
        state_starts = [t.data_ptr() for t in _state_tensors(columns)]
        accepted = cls(
            state_after,
            spec,
            list(given),
            [g.shape for g in grads],
            dtype,
            device,
            [p.data_ptr() for p in params],
            columns,
            shared,
            state_starts,
            frozenset([*(p.data_ptr() for p in params), *state_starts]),
            [],
            # on a GPU one slice: its cache is not what a step's operations run through
            in_cache_chunks([g.numel() * g.element_size() for g in grads])
            if device.type == "cpu"
            else [slice(0, len(grads))],
        )
        accepted.note_versions()
        return accepted

    def note_versions(self) -> None:
        """Record the shared scalars' version counters, after this object's step wrote them."""
        self.versions = [[t._version for t in c] if s else None for c, s in zip(self.columns, self.shared)]

    def inputs(
        self, spec: optree.PyTreeSpec, update_leaves: list, param_leaves: list, state: Any
    ) -> Optional[tuple[list, list]]:
        """The gradients and parameters of the leaves with a gradient, where the step's leaves
        (of the tree structure ``spec``) and ``state`` are what this record accepted (module
        docstring); else ``None``.

        Args:
            spec: the parameters' tree structure.
            update_leaves: the step's gradients, one per leaf (``None`` where there is none).
            param_leaves: the parameters, one per leaf.
            state: the state the step is given.
        """
        if state is not self.state or spec != self.spec:
            return None
        if [u is not None for u in update_leaves] != self.given:
            return None
        grads = list(itertools.compress(update_leaves, self.given))
        params = list(itertools.compress(param_leaves, self.given))
        if not (_all_of(grads, self.dtype, self.shapes) and _dense_untracked_on(grads, self.device)):
            return None
        if not _all_of(params, self.dtype, self.shapes):  # detached (untracked) views: moved, cast or
            return None  # reshaped by ``p.data = ...``, their start, dtype or shape differs
        if [p.data_ptr() for p in params] != self.param_starts:
            return None
        starts = {g.data_ptr() for g in grads}
        if len(starts) != len(grads) or not starts.isdisjoint(self.taken):
            return None
        if [t.data_ptr() for t in _state_tensors(self.columns)] != self.state_starts:
            return None
        for column, versions in zip(self.columns, self.versions):
            if versions is not None and [t._version for t in column] != versions:
                return None
        return grads, params

    @functools.cached_property
    def present(self) -> list:
        """The indices of the leaves with a gradient."""
        return [i for i, g in enumerate(self.given) if g]


def in_cache_chunks(sizes: list, most: Optional[int] = None) -> list:
    """Consecutive slices of tensors of ``sizes`` bytes, as few as hold at most ``most`` bytes
    each on average (by default :data:`CHUNK_BYTES`), of about equal sizes: every tensor in one
    slice where they fit.

    An eager step on the CPU runs each operation over every tensor of its list, one tensor after
    the other. Where a list's tensors and their state outgrow the processor's cache, each operation
    reads them back from memory; run on slices of a megabyte or two of parameters, they stay in the
    cache from one operation to the next, as in torch.optim's for-loop step (the bits are the
    same: each operation runs on each tensor alone either way).

    Example::

        >>> in_cache_chunks([1 << 20] * 5)
        [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    most = CHUNK_BYTES if most is None else most
    total = sum(sizes)
    count = max(1, -(-total // max(most, 1)))  # ceil(total / most) slices at most
    chunks, start, so_far, shares = [], 0, 0, 0
    for i, size in enumerate(sizes):
        so_far += size
        reached = so_far * count // total if total else 0  # the equal shares of the bytes now passed
        if shares < reached < count:  # past a share, and bytes left for the next slice
            chunks.append(slice(start, i + 1))
            start, shares = i + 1, reached
    chunks.append(slice(start, len(sizes)))
    return chunks


def kept_inputs(
    records: Optional[dict], key: Any, spec: optree.PyTreeSpec, update_leaves: list, param_leaves: list, state: Any
) -> Optional[tuple[AcceptedStep, list, list]]:
    """The record kept under ``key`` and this step's gradients and parameters of the leaves with
    a gradient, where the record accepts them (:meth:`AcceptedStep.inputs`); else ``None``, a
    record that does not accept them dropped.

    Args:
        records: the step's records (:func:`records_now`), or ``None``.
        key: the step's key in them.
        spec: the parameters' tree structure.
        update_leaves: the step's gradients, one per leaf (``None`` where there is none).
        param_leaves: the parameters, one per leaf.
        state: the state the step is given.
    """
    record = records.get(key) if records is not None else None
    if record is None:
        return None
    inputs = record.inputs(spec, update_leaves, param_leaves, state)
    if inputs is None:
        del records[key]  # type: ignore[union-attr]
        return None
    return (record, *inputs)


_KEPT: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("functional_bagua_accepted", default=None)


@contextlib.contextmanager
def kept_in(records: dict) -> Iterator[None]:
    """Within: the eager steps that can keep what their checks accepted keep it in ``records``,
    under keys of their own (``fb.Optimizer`` gives each group its dict, around its step).

    Args:
        records: where to keep the records (and to find those of the previous step).
    """
    token = _KEPT.set(records)
    try:
        yield
    finally:
        _KEPT.reset(token)


def records_now() -> Optional[dict]:
    """The records of the step running now (:func:`kept_in`); ``None`` outside one, while traced,
    and with the grouped path off (:func:`functional_bagua.foreach.per_tensor`: every step checked)."""
    records = _KEPT.get()
    if records is None or torch.compiler.is_compiling() or not foreach.grouped_enabled():
        return None
    return records


def _state_tensors(columns: list) -> list:
    """The tensors of the fields that hold tensors of at least one dimension."""
    return [t for column in columns if column is not None and column[0].dim() > 0 for t in column]


def _plain(t: Any, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``t`` is a dense tensor of ``dtype`` (any shape) on ``device`` that autograd does not record."""
    return type(t) is torch.Tensor and t.dtype is dtype and _dense_untracked_on([t], device)


def _all_of(tensors: list, dtype: torch.dtype, shapes: list) -> bool:
    """Whether ``tensors`` are torch.Tensor objects (no subclass) of ``dtype`` and ``shapes``."""
    return (
        set(map(type, tensors)) == {torch.Tensor}
        and [t.shape for t in tensors] == shapes
        and all(t.dtype is dtype for t in tensors)
    )


def _dense_untracked_on(tensors: list, device: torch.device) -> bool:
    """Whether ``tensors`` are dense tensors on ``device`` that autograd does not record."""
    if device.type == "cpu":
        return all(t.is_cpu and t.layout is STRIDED and not t.requires_grad for t in tensors)
    return all(t.device == device and t.layout is STRIDED and not t.requires_grad for t in tensors)
