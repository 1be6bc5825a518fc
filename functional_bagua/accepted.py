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
transform's name, and which of its steps: written into the parameters, or the pure update; a
chain keeps its checked lists there too, :class:`~functional_bagua.leaf_lists.KeptLists`).

What a step reads of its tensors, it reads once:

- the parameters' detached views are kept from one step to the next while each parameter still
  holds what its view shows (:class:`KeptViews`); a record given the very views it accepted does
  not check them again;
- gradients a chain found of a record's signatures in this step are noted
  (:func:`note_checked`), and a record given the very same objects does not read them again.

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
import operator
from typing import Any, Iterator, Optional

import optree
import torch

from functional_bagua import foreach

STRIDED = torch.strided
_PLAIN = {torch.Tensor}  # the one type an accepted step's gradients and parameters have
# what AcceptedStep.inputs reads of each gradient and parameter, in one pass each
_SIGNATURE = operator.attrgetter("shape", "dtype", "device", "layout", "requires_grad")
_START = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")
_SHAPE_AND_DTYPE = operator.attrgetter("shape", "dtype")
_VIEWED = {torch.Tensor, torch.nn.Parameter}  # the parameters whose views KeptViews keeps

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
        params: the parameters with a gradient, the tensor objects the step was given
            (``fb.Optimizer`` hands the same detached views to the next step while they show
            what their parameters hold, :class:`KeptViews`: those need no check again).
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
    params: list

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
        state_starts = list(map(_START, _state_tensors(columns)))
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
            list(params),
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
        docstring); else ``None``. Each check is one pass over the tensors (a step asks at every
        step: on many tensors these passes are what the step costs beside its arithmetic).

        Args:
            spec: the parameters' tree structure.
            update_leaves: the step's gradients, one per leaf (``None`` where there is none).
            param_leaves: the parameters, one per leaf.
            state: the state the step is given.
        """
        if state is not self.state or spec != self.spec:
            return None
        if list(map(operator.is_not, update_leaves, itertools.repeat(None))) != self.given:
            return None
        grads = list(itertools.compress(update_leaves, self.given))
        params = list(itertools.compress(param_leaves, self.given))
        # dense, of the shapes and dtype accepted, on its device, not recorded by autograd;
        # torch.Tensor objects (no subclass): the gradients, and the parameters unless they are
        # the very views checked before (else detached views: moved, cast or reshaped by
        # ``p.data = ...``, their start, dtype or shape differs)
        if not _noted(grads, self.signatures):
            if signatures_of(grads) != self.signatures:
                return None
            note_checked(grads, self.signatures)
        if not (len(params) == len(self.params) and all(map(operator.is_, params, self.params))):
            if signatures_of(params) != self.signatures or list(map(_START, params)) != self.param_starts:
                return None
            self.params = params  # checked: the next step's, the same views where kept, need not be
        starts = set(map(_START, grads))
        if len(starts) != len(grads) or not starts.isdisjoint(self.taken):
            return None
        if list(map(_START, self.state_tensors)) != self.state_starts:
            return None
        for column, versions in zip(self.columns, self.versions):
            if versions is not None and list(map(_VERSION, column)) != versions:
                return None
        return grads, params

    @functools.cached_property
    def signatures(self) -> list:
        """Per leaf with a gradient, what :meth:`inputs` asks of its gradient and parameter
        (:data:`_SIGNATURE`): its shape, this record's dtype, device and strided layout, and no
        ``requires_grad``."""
        return [(shape, self.dtype, self.device, STRIDED, False) for shape in self.shapes]

    @functools.cached_property
    def state_tensors(self) -> list:
        """The state's tensors whose starts :attr:`state_starts` holds (:func:`_state_tensors`)."""
        return _state_tensors(self.columns)

    @functools.cached_property
    def present(self) -> list:
        """The indices of the leaves with a gradient."""
        return [i for i, g in enumerate(self.given) if g]


class KeptViews:
    """The detached views of a group's parameters that its last step handed its transform
    (``{position: p.detach()}``), kept for the next step while each parameter still holds what
    its view shows (:meth:`of`). Making a view costs about what checking a tensor does: on 200
    tensors, a tenth of a millisecond a step. A copy or a pickle starts without them (they are
    views of the original's parameters).

    The views hold their parameters' memory: after ``p.data = ...`` (``model.half()``,
    ``model.to(...)``) the memory ``p`` held before is freed at the group's next step, when new
    views are made, or with the optimizer (``del optimizer``), not at once.

    Example::

        views = KeptViews()
        params = views.of(positions(len(group["params"])), group["params"])   # each step
    """

    __slots__ = ("sources", "views", "where")

    def __init__(self) -> None:
        self.sources: tuple = ()
        self.views: Optional[dict] = None
        self.where: Optional[tuple] = None

    def __reduce__(self) -> tuple:
        return (KeptViews, ())

    def of(self, keys: tuple, params: list) -> dict:
        """``{key: p.detach()}`` for ``params`` (keyed by ``keys``, one per parameter): the last
        call's views where these are the same parameter objects and each still starts where its
        view does, with its shape, strides and dtype (``p.data = ...``, ``set_`` or ``resize_``
        give it others, or a negated view of the same memory: new views are made). Made anew
        every time while traced, and for parameters that are not dense tensors of a real dtype
        (a tensor subclass; a conjugated complex view of the same memory would look the same).

        Args:
            keys: the keys of the views, one per parameter.
            params: the group's parameters.
        """
        if torch.compiler.is_compiling():
            return {k: p.detach() for k, p in zip(keys, params)}
        if (
            self.views is not None
            and len(self.sources) == len(params)
            and all(map(operator.is_, self.sources, params))
            and _where(params) == self.where
        ):
            return self.views
        views = {k: p.detach() for k, p in zip(keys, params)}
        kept = set(map(type, params)) <= _VIEWED and not any(p.layout is not STRIDED or p.is_complex() for p in params)
        self.sources, self.views, self.where = (tuple(params), views, _where(params)) if kept else ((), None, None)
        return views


def _where(params: list) -> tuple:
    """Where and how each of ``params`` holds its values now: its start, shape and dtype,
    strides, and whether it is a negated view (``x.conj().imag`` of a complex ``x``)."""
    return (
        list(map(_START, params)),
        list(map(_SHAPE_AND_DTYPE, params)),
        list(map(torch.Tensor.stride, params)),
        list(map(torch.Tensor.is_neg, params)),
    )


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


# within a step: the gradients last found of the signatures a record holds (note_checked)
_CHECKED: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("functional_bagua_checked", default=None)


@contextlib.contextmanager
def kept_in(records: dict) -> Iterator[None]:
    """Within: the eager steps that can keep what their checks accepted keep it in ``records``,
    under keys of their own (``fb.Optimizer`` gives each group its dict, around its step).

    Args:
        records: where to keep the records (and to find those of the previous step).
    """
    token, checked = _KEPT.set(records), _CHECKED.set([])
    try:
        yield
    finally:
        _CHECKED.reset(checked)
        _KEPT.reset(token)


def note_checked(grads: list, signatures: list) -> None:
    """Within a step (:func:`kept_in`): ``grads``, torch.Tensor objects, were found of
    ``signatures`` (per tensor its shape, dtype, device, layout and ``requires_grad``), so that
    a record that accepts the same objects later in the step need not read them again (a chain
    checks its gradients, then its links' records do: one pass over them, not two).

    Args:
        grads: the gradients checked.
        signatures: what was found of them, as :attr:`AcceptedStep.signatures`.
    """
    checked = _CHECKED.get()
    if checked is not None:
        checked[:] = [grads, signatures]


def _noted(grads: list, signatures: list) -> bool:
    """Whether ``grads`` are the very tensors :func:`note_checked` last noted in this step, of
    ``signatures``."""
    checked = _CHECKED.get()
    if not checked:
        return False
    noted, found = checked
    return (
        len(noted) == len(grads)
        and all(map(operator.is_, noted, grads))
        and (found is signatures or found == signatures)
    )


def records_now() -> Optional[dict]:
    """The records of the step running now (:func:`kept_in`); ``None`` outside one, while traced,
    and with the grouped path off (:func:`functional_bagua.foreach.per_tensor`: every step checked)."""
    records = _KEPT.get()
    if records is None or torch.compiler.is_compiling() or not foreach.grouped_enabled():
        return None
    return records


def signatures_of(tensors: list) -> Optional[list]:
    """What :meth:`AcceptedStep.inputs` asks of each of ``tensors`` (its shape, dtype, device,
    layout and ``requires_grad``), or ``None`` unless they are torch.Tensor objects (no
    subclass)."""
    if set(map(type, tensors)) != _PLAIN:
        return None
    return list(map(_SIGNATURE, tensors))


def _state_tensors(columns: list) -> list:
    """The tensors of the fields that hold tensors of at least one dimension."""
    return [t for column in columns if column is not None and column[0].dim() > 0 for t in column]


def _plain(t: Any, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``t`` is a dense tensor of ``dtype`` (any shape) on ``device`` that autograd does not record."""
    return type(t) is torch.Tensor and t.dtype is dtype and _dense_untracked_on([t], device)


def _dense_untracked_on(tensors: list, device: torch.device) -> bool:
    """Whether ``tensors`` are dense tensors on ``device`` that autograd does not record."""
    if device.type == "cpu":
        return all(t.is_cpu and t.layout is STRIDED and not t.requires_grad for t in tensors)
    return all(t.device == device and t.layout is STRIDED and not t.requires_grad for t in tensors)
