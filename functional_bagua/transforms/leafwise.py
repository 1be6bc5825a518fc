"""Build a transform from the rule for a single tensor.

Most optimizer math is written for one parameter tensor at a time::

    def update_leaf(g, s, p):            # gradient, this tensor's state, parameter
        ...
        return u, new_s

:func:`leafwise` lifts such a rule to whole parameter trees: the state becomes a NamedTuple of
trees (``state.mu["layer.weight"]``, as in optax), a ``None`` gradient leaves its update ``None``
and its state untouched (as torch.optim skips parameters whose ``.grad`` is ``None``), and bad
input (a gradient tree that does not match the parameters, a wrong dtype or shape, a sparse
gradient) raises a ValueError/TypeError naming the offending parameter (:mod:`functional_bagua.checks`).
Complex tensors are updated as torch.optim updates them, on their real views
(``torch.view_as_real``); a rule declared ``per_tensor`` refuses them.

Each update and state tensor keeps the dtype of its gradient and its initial state. Step counts
are kept per tensor, as torch.optim keeps ``state["step"]`` per parameter, so a
parameter that skipped steps bias-corrects with its own count.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import optree
import torch

from functional_bagua import accepted, checks, foreach, layout_context, numerics, ownership, tree
from functional_bagua.accepted import AcceptedStep
from functional_bagua.base import EmptyState, GradientTransformation, apply_updates_
from functional_bagua.flat import Segment
from functional_bagua.leaf_lists import LeafLists
from functional_bagua.tree import PyTree


def leafwise(
    state_type: Any,
    init_leaf: Callable[[torch.Tensor], NamedTuple],
    update_leaf: Callable[[torch.Tensor, Any, Optional[torch.Tensor]], tuple],  # Any: the rule's state NamedTuple
    *,
    name: str,
    needs_params: bool = False,
    per_tensor: bool = False,
    sparse_gradients: bool = False,
    fresh_updates: bool = False,
    write_leaf: Optional[Callable[[Any, Any, Any, float], Any]] = None,
    in_cache_chunks: bool = False,
) -> GradientTransformation:
    """A transform applying ``update_leaf(g, state_leaf, p) -> (u, new_state_leaf)`` per tensor.

    ``state_type`` is the NamedTuple of the per-tensor state; the transform's state is that
    NamedTuple with one tree per field. ``name`` appears in error messages. With
    ``needs_params=True``, ``update`` requires the ``params`` argument.

    ``per_tensor=True`` declares that the rule is not elementwise (it takes norms, means or
    shapes of the whole tensor). Inside :func:`~functional_bagua.fuse` such a rule runs on each
    parameter's segment of the flat buffer, and its state holds a tuple of per-segment states
    per buffer; an elementwise rule runs once on the whole buffer.

    Outside a fused update, the rule runs once per group of tensors of one device and dtype, on
    :class:`~functional_bagua.foreach.Leaves` (each operation one multi-tensor op over the
    group; norms and means stay per tensor); a rule that reads what only one tensor has (its
    shape, a Python number from its values) runs one tensor at a time instead.

    Args:
        state_type: the NamedTuple class of one tensor's state.
        init_leaf: ``init_leaf(p) -> state_leaf``, called on each parameter that is not ``None``.
        update_leaf: ``update_leaf(g, state_leaf, p) -> (u, new_state_leaf)``, called on each
            gradient that is not ``None`` (``p`` is ``None`` when ``update`` gets no ``params``).
            ``u`` is cast to ``g``'s dtype and each new state tensor to its old one's.
        name: the transform's name, used in error messages.
        needs_params: with ``True``, ``update`` without ``params`` raises a ValueError.
        per_tensor: ``True`` for a rule that is not elementwise: it gets whole tensors (one
            segment at a time inside a fused update) and refuses complex tensors; an elementwise
            rule gets complex tensors as their real views.
        sparse_gradients: ``True`` for a rule made for sparse COO gradients (and only those, as
            ``torch.optim.SparseAdam``); it refuses dense and complex ones and cannot run fused.
        fresh_updates: ``True`` declares that ``u`` is always a new tensor that nothing else
            holds (not ``g``, ``p``, nor a state tensor, old or new), so that the next link of a
            chain may overwrite it (``functional_bagua.ownership``).
        write_leaf: ``write_leaf(g, state_leaf, p, alpha) -> new_state_leaf``, the rule's step
            written into ``p`` as its reference writes it, ``p <- p + alpha u`` for the ``u`` of
            ``update_leaf`` (``p.addcdiv_(m, denom, value=alpha)``), its state computed in the
            old one (given up): ``fb.Optimizer`` calls it (``update.apply_in_place``) eagerly,
            on dense float32 or float64 tensors of at least one dimension
            (:func:`~functional_bagua.foreach.writable_in_place`) on the CPU, or on a GPU where
            the state's scalars are on the CPU (as ``fb.Optimizer`` holds them), where every
            factor of the rule is a Python number. Its write into ``p`` must be its last operation: a rule
            that raises before it runs again one tensor at a time.
        in_cache_chunks: a step on what a checked step accepted (``functional_bagua.accepted``)
            runs over slices of the tensors that stay in the processor's cache
            (``accepted.in_cache_chunks``): the rule runs on the first,
            its operations recorded (:func:`~functional_bagua.foreach.recorded`), and those
            operations again on each other slice. For rules whose operations depend on the
            step's numbers only, not on the values of their tensors: a number read from them
            (:func:`~functional_bagua.foreach.values_read`) makes the rule run on each slice,
            and on a slice whose tensors give different numbers, one tensor at a time.

    Returns:
        A GradientTransformation whose state is a ``state_type`` with one tree per field.

    Example::

        class TotalState(NamedTuple):
            total: torch.Tensor
        running_sum = fb.leafwise(TotalState, lambda p: TotalState(torch.zeros_like(p)),
                                  lambda g, s, p: (s.total + g, TotalState(s.total + g)), name="running_sum")
    """
    fields = state_type._fields
    # the grouped ops read CPU scalars as numbers; a rule on one tensor takes them to its device
    numerics.takes_cpu_scalars(state_type)
    rule = update_leaf if per_tensor else _on_real_views(update_leaf)
    expected_shapes = _ExpectedShapes(init_leaf, fields, name)
    complex_ok = not (per_tensor or sparse_gradients)
    layout = torch.sparse_coo if sparse_gradients else torch.strided

    # where a step keeps what its checks accepted (functional_bagua.accepted): the step written
    # into the parameters and the pure update each their own (the pure one takes tensors the
    # written one may not write: a bfloat16 parameter, parameters starting together)
    written_key, updated_key = (name, "written"), (name, "updated")

    def init(params: PyTree) -> NamedTuple:
        if sparse_gradients:
            layout_context.refuse_inside_fuse(name, "its sparse gradients have no flat buffer")
        leaves, spec = tree.flatten(params)
        for i, p in enumerate(leaves):
            if p is not None:
                checks.check_param(p, functools.partial(tree.leaf_name, spec, i), name, complex_ok=complex_ok)
        keys = _segmented_keys(spec, per_tensor)
        per_leaf = [
            state_type(*([None] * len(fields)))
            if p is None
            else init_leaf(p)
            if keys is None
            else _per_segment_states(state_type, [init_leaf(seg.of(p)) for seg in _segments_of(keys[i])])
            for i, p in enumerate(leaves)
        ]
        return state_type(*(spec.unflatten([s[i] for s in per_leaf]) for i in range(len(fields))))

    def update(grads: PyTree, state: NamedTuple, params: Optional[PyTree] = None) -> tuple[PyTree, NamedTuple]:
        if needs_params and params is None:
            raise ValueError(f"{name} needs the parameters: call update(grads, state, params)")
        grouped = not (per_tensor and layout_context.active_layout() is not None or sparse_gradients)
        x = LeafLists.of(
            grads, params, who=name, complex_ok=complex_ok, layout=layout, grouped=grouped and foreach.grouped_enabled()
        )
        updates, new_state = on_lists(x, state, False)
        return x.unflatten(updates), new_state

    def on_lists(x: LeafLists, state: NamedTuple, overwrite: bool) -> tuple[list, NamedTuple]:
        """The update on checked lists (:mod:`functional_bagua.leaf_lists`); the rule never
        writes in its input updates, so ``overwrite`` is unused; it may compute its new state in
        the old one's tensors where its caller gave that up (:func:`~functional_bagua.foreach.updated`)."""
        del overwrite
        given = ownership.state_given_to(update)
        records = (
            accepted.records_now() if given and x.params_given and layout_context.active_layout() is None else None
        )
        if records is not None and updated_key in records:
            replayed = replay(records, updated_key, x.spec, x.updates, x.params, state, None, None)
            if replayed is not None:
                return replayed
        before = [_field_leaves(x.spec, state, f, name) for f in fields] if records is not None else []
        updates, new_state = stepped(x, state, given, None)
        if records is not None:
            present = [i for i, u in enumerate(x.updates) if u is not None]
            remember(records, updated_key, x, present, before, new_state)
        return updates, new_state

    def apply_in_place(
        updates: PyTree, state: NamedTuple, params: PyTree, alpha: float, scaled_by: Optional[float] = None
    ) -> Optional[NamedTuple]:
        """``p <- p * scaled_by + alpha u`` written into ``params``: ``p.mul_(scaled_by)`` where
        given (a decoupled weight decay, first as the references decay), then ``write_leaf``, the
        state and the parameters given up by the caller. Where some tensors cannot be written so
        (:func:`~functional_bagua.foreach.writable_part`: a 0-dim parameter, a bfloat16 one),
        those take their update (in the same pass), added with ``alpha`` after the
        multiplication (the pure update's numbers to a rounding), and the rest are written.
        ``None``, nothing changed, where none can be (traced, a fused or segmented layout, on a
        GPU with the state's scalars there: its factors would not be numbers; ``fb.Optimizer``
        holds them on the CPU), or for ``scaled_by`` given to a rule that reads the parameters (it would
        read them scaled). Within :func:`functional_bagua.accepted.kept_in` (``fb.Optimizer``'s
        step), where every tensor was written, and the state with it, what the checks accepted
        is kept, and a next step on the same tensors runs the rule on them unchecked (as
        ``on_lists`` does for the pure update, in a record of its own: the pure update takes
        tensors this step does not write)."""
        if torch.compiler.is_compiling() or layout_context.active_layout() is not None:
            return None
        if scaled_by is not None and needs_params:
            return None
        records = accepted.records_now()
        if records is not None and written_key in records:
            param_leaves, spec = tree.flatten_like(params, records[written_key].spec)
            update_leaves = tree.leaves_matching(spec, updates, "grads", "params")
            replayed = replay(records, written_key, spec, update_leaves, param_leaves, state, alpha, scaled_by)
            if replayed is not None:
                return replayed[1]
        x = LeafLists.of(
            updates, params, who=name, complex_ok=complex_ok, layout=layout, grouped=foreach.grouped_enabled()
        )
        if _segmented_keys(x.spec, per_tensor) is not None or not isinstance(state, state_type):
            return None
        present = [i for i, g in enumerate(x.updates) if g is not None]
        state_leaves = [_field_leaves(x.spec, state, f, name, segmented=False) for f in fields]

        def tensors_of(indices: list) -> list:
            """The tensors at ``indices``: parameters, updates, state fields but counts."""
            tensors = [column[i] for column in (x.params, x.updates) for i in indices]
            return tensors + [t for leaves in state_leaves for t in (leaves[i] for i in indices) if _has_dims(t)]

        written = foreach.writable_part(present, tensors_of, _scalars_on_the_cpu(state_leaves, present))
        if not written:
            return None
        if len(written) == len(present):  # the usual case: every tensor
            new_state = stepped(x, state, True, alpha, scaled_by)[1]
            if records is not None:
                remember(records, written_key, x, present, state_leaves, new_state)
            return new_state
        others, new_state = stepped(x, state, True, alpha, scaled_by, frozenset(written))
        if scaled_by is not None:
            for p, u in zip(x.params, others):
                if u is not None:
                    p.mul_(scaled_by)
        apply_updates_(params, x.unflatten(others), alpha)
        return new_state

    def stepped(
        x: LeafLists,
        state: NamedTuple,
        given_up: bool,
        alpha: Optional[float],
        scaled_by: Optional[float] = None,
        written: Optional[frozenset] = None,
    ) -> tuple:
        """The updates (a list) and the new state; with ``alpha``, ``write_leaf``'s step written
        into the parameters instead (those with an update first multiplied by ``scaled_by``,
        where given, once the state is checked), and no updates, for the indices in ``written``
        (every one where ``None``): the others' updates are returned."""
        given = range(2, 2 + len(fields)) if given_up else ()
        if not isinstance(state, state_type):
            raise ValueError(
                f"{name}: got a state of type {type(state).__name__}, expected {state_type.__name__}; pass the "
                f"state this transform's init made (not another transform's, nor the whole chain's)"
            )
        keys = _segmented_keys(x.spec, per_tensor)
        state_leaves = [_field_leaves(x.spec, state, f, name, segmented=keys is not None) for f in fields]
        if keys is None and not torch.compiler.is_compiling():
            kinds = [None] * len(x.kinds) if sparse_gradients else x.kinds
            _check_state_shapes(x.updates, state_leaves, x.spec, expected_shapes, kinds)

        def writes(i: int) -> bool:
            return alpha is not None and (written is None or i in written)

        if scaled_by is not None:
            stepped_params = [p for i, (p, u) in enumerate(zip(x.params, x.updates)) if u is not None and writes(i)]
            torch._foreach_mul_(stepped_params, scaled_by)

        updates: list[Optional[torch.Tensor]] = [None] * len(x.updates)
        new_fields = [list(leaves) for leaves in state_leaves]  # a None gradient keeps its state
        singles = list(x.singles)
        columns = [x.updates, x.params, *state_leaves]
        written_rule = rule_of_fields if alpha is None else functools.partial(written_with_fields, alpha)
        for group in x.groups:
            parts = (
                [group]
                if written is None
                else [[i for i in group if i in written], [i for i in group if i not in written]]
            )
            for members in (part for part in parts if part):
                in_place = writes(members[0])
                grouped_rule = written_rule if in_place else rule_of_fields
                result = foreach.run_grouped(grouped_rule, columns, members, given, one_values=True)
                if result is None:  # the rule needs single tensors
                    singles.extend(members)
                    continue
                (us, new_s), writable = result
                if not in_place:
                    us = us.copies() if isinstance(us, foreach.OneValue) else us
                    _place(us, members, updates, x.updates, updates_of=name)  # each in its gradient's dtype
                for f, (column, old_column, new_column) in enumerate(zip(new_s, state_leaves, new_fields)):
                    if isinstance(column, foreach.OneValue):  # a count: into the old counts where given up
                        olds = [old_column[i] for i in members]
                        column = column.copied_into(olds) if 2 + f in writable else column.copies()
                    _place(column, members, new_column, old_column)  # each state tensor in its old one's
        for i in sorted(singles):
            g, p, s = x.updates[i], x.params[i], state_type(*(leaves[i] for leaves in state_leaves))
            with _scalars_beside(g, s):
                if writes(i):
                    assert write_leaf is not None and alpha is not None  # apply_in_place
                    u, new_s = None, write_leaf(g, s, p, alpha)
                elif keys is None:
                    u, new_s = rule(g, s, p)
                else:
                    u, new_s = _update_segments(update_leaf, state_type, g, s, p, _segments_of(keys[i]))
            updates[i] = None if u is None else _update_in(u, g.dtype, name)
            for f, value in enumerate(_with_dtypes_of(new_s, s)):
                new_fields[f][i] = value
        return updates, state_type(*(x.unflatten(column) for column in new_fields))

    def remember(records: dict, key: tuple, x: LeafLists, present: list, before: list, new_state: NamedTuple) -> None:
        """What the checks of a step on one group, its state stepped in place, accepted (the
        record dropped where the step did not step its whole state in place). ``before``: the
        old state's leaves, per field; ``key``: the record's (``written_key`` or ``updated_key``)."""
        records.pop(key, None)
        if x.singles or x.groups != [present]:
            return
        after = [_field_leaves(x.spec, new_state, f, name) for f in fields]
        record = AcceptedStep.after(
            x.spec,
            [u is not None for u in x.updates],
            [x.updates[i] for i in present],
            [x.params[i] for i in present],
            [[leaves[i] for i in present] for leaves in before],
            new_state,
            [[leaves[i] for i in present] for leaves in after],
        )
        if record is not None:
            records[key] = record

    def replay(
        records: dict,
        key: tuple,
        spec: Any,
        update_leaves: list,
        param_leaves: list,
        state: NamedTuple,
        alpha: Optional[float],
        scaled_by: Optional[float],
    ) -> Optional[tuple]:
        """The step on the tensors a step's checks accepted (``records[key]``), where this
        step's inputs are those (:meth:`AcceptedStep.inputs`): ``update_leaf``'s updates (a
        list) and the new state, or with ``alpha``, ``write_leaf``'s step written into the
        parameters, no updates. ``None``, nothing changed and the record dropped, where the
        inputs are not those (or the rule raised before writing anything)."""
        kept = accepted.kept_inputs(records, key, spec, update_leaves, param_leaves, state)
        if kept is None:
            return None
        record, grads, stepped_params = kept
        if scaled_by is not None:
            torch._foreach_mul_(stepped_params, scaled_by)
        overwrites: list = []  # as foreach.run_grouped: the fields overwritten
        chunks = record.chunks if in_cache_chunks else [slice(0, len(grads))]
        grouped = [  # the rule's tensors, grouped: per chunk, its gradients, the state given, its parameters
            (
                foreach.Leaves(grads[part], plain=record.dtype),
                state_type(
                    *(
                        None if column is None else _as_given(column[part], shared, overwrites, record.dtype)
                        for column, shared in zip(record.columns, record.shared)
                    )
                ),
                foreach.Leaves(stepped_params[part], plain=record.dtype),
            )
            for part in chunks
        ]
        results: list = []  # per chunk done, the rule's (u, new state)
        try:
            if alpha is None:
                foreach.run_in_chunks(update_leaf, grouped, results)
            else:
                assert write_leaf is not None  # apply_in_place
                foreach.run_in_chunks(functools.partial(_written_by, write_leaf, alpha), grouped, results)
        except Exception as error:
            del records[key]
            if not (overwrites or results) and scaled_by is None:
                return None  # nothing written: the checked step, which raises what it raises
            raise RuntimeError(
                f"{name}: the rule raised {type(error).__name__} after writing into the state or the parameters; "
                "the step is part-made"
            ) from error
        ran = [(part, given, u, new) for part, (_, given, _), (u, new) in zip(chunks, grouped, results)]
        updates: Optional[list] = None
        if alpha is None:  # each in its gradient's dtype, as the checked step places them
            updates = [None] * len(update_leaves)
            for part, _, u, _ in ran:
                values = foreach._as_lists(u, _length(part))
                _place(values, record.present[part], updates, update_leaves, updates_of=name)
        in_place = True
        for part, given, _, new in ran:
            for column, shared, before, value in zip(record.columns, record.shared, given, new):
                if column is None:
                    in_place = in_place and value is None
                elif not shared:
                    in_place = in_place and value is before
                elif _one_scalar_like(value, column[0]):  # a count: into the old ones, as one_values does
                    torch._foreach_copy_(column[part], [value] * _length(part))
                else:
                    in_place = False
        if in_place:
            record.note_versions()
            return updates, state
        del records[key]  # the rule stepped a field into new tensors: the state made anew
        per_field = [
            [v for part, _, _, new in ran for v in foreach._as_lists(new[f], _length(part))] for f in range(len(fields))
        ]
        return updates, state_of_fields(record, state, per_field)

    def state_of_fields(record: AcceptedStep, state: NamedTuple, new: list) -> NamedTuple:
        """The state with each field's values at the leaves with a gradient from ``new`` (per
        field, a list of them)."""
        present = record.present
        out = []
        for f, values in zip(fields, new):
            leaves = _field_leaves(record.spec, state, f, name)
            into = list(leaves)
            _place(values, present, into, leaves)
            out.append(record.spec.unflatten(into))
        return state_type(*out)

    def rule_of_fields(g: Any, p: Any, *fields: Any) -> Any:
        return update_leaf(g, state_type(*fields), p)

    def written_with_fields(alpha: float, g: Any, p: Any, *fields: Any) -> Any:
        assert write_leaf is not None  # apply_in_place
        return None, write_leaf(g, state_type(*fields), p, alpha)

    update.fresh_updates = fresh_updates  # type: ignore[attr-defined]
    if not (per_tensor or sparse_gradients):  # a chain may run it on its checked lists (leaf_lists)
        update.on_lists = on_lists  # type: ignore[attr-defined]
        update.input_name = name  # type: ignore[attr-defined]
        update.needs_params = needs_params  # type: ignore[attr-defined]
        if write_leaf is not None:
            update.apply_in_place = apply_in_place  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


class _ExpectedShapes:
    """The shape of each state field that ``init_leaf`` makes for parameters of given shapes and
    dtypes (``None`` for a field that is not a tensor), found by running ``init_leaf`` on meta
    tensors (no memory, no data): per (shape, dtype) once, and per whole list of gradients once
    (the same every step), so that checking a step compares lists, not leaves one by one."""

    def __init__(self, init_leaf: Callable[[torch.Tensor], NamedTuple], fields: tuple, name: str) -> None:
        self.init_leaf, self.fields, self.name = init_leaf, fields, name
        self.known: dict[tuple, Optional[tuple]] = {}
        self.columns: dict[tuple, list] = {}  # the gradients' (shape, dtype)s -> per field, per leaf

    def of(self, key: tuple) -> Optional[tuple]:
        if key not in self.known:
            try:
                made = self.init_leaf(torch.empty(key[0], dtype=key[1], device="meta"))
            except Exception:  # a rule whose init reads values: nothing to compare with
                self.known[key] = None
            else:
                self.known[key] = tuple(f.shape if isinstance(f, torch.Tensor) else None for f in made)
        return self.known[key]

    def for_grads(self, keys: tuple) -> list:
        if keys not in self.columns:
            per_leaf = [None if key is None else self.of(key) for key in keys]
            self.columns[keys] = [
                [None if shapes is None else shapes[f] for shapes in per_leaf] for f in range(len(self.fields))
            ]
        return self.columns[keys]


def _check_state_shapes(
    grad_leaves: list, state_leaves: list, spec: Any, expected: _ExpectedShapes, kinds: list
) -> None:
    """Raise unless each state tensor has the shape ``init_leaf`` makes for its parameter: a
    state made for other parameters would otherwise be broadcast into the update (and grow).
    ``kinds`` holds each dense gradient's ``(shape, dtype)`` (``None`` for the others)."""
    for field, leaves, shapes in zip(expected.fields, state_leaves, expected.for_grads(tuple(kinds))):
        if _shapes_if_tensors(leaves) == shapes:  # the usual case, in one comparison of lists
            continue
        actual = [
            leaf.shape if isinstance(leaf, torch.Tensor) and shape is not None else shape
            for leaf, shape in zip(leaves, shapes)
        ]
        if actual == shapes:
            continue
        i = next(i for i, (a, b) in enumerate(zip(actual, shapes)) if a != b)
        raise ValueError(
            f"{expected.name}: the state's {field!r} for {tree.leaf_name(spec, i)!r} has shape "
            f"{tuple(actual[i])}, where a parameter of shape {tuple(grad_leaves[i].shape)} has {tuple(shapes[i])}: "
            "the state was made for other parameters; make it for these, tx.init(params)"
        )


def _shapes_if_tensors(leaves: list) -> Optional[list]:
    """Each leaf's shape, or ``None`` if a leaf is not a tensor."""
    try:
        return [leaf.shape for leaf in leaves]
    except AttributeError:
        return None


def stateless(
    update_leaf: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
    *,
    name: str,
    needs_params: bool = False,
    per_tensor: bool = False,
    per_buffer: Optional[Callable[[torch.Tensor, Optional[torch.Tensor], list, str], torch.Tensor]] = None,
    in_place: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = None,
) -> GradientTransformation:
    """A transform without state applying ``update_leaf(u, p) -> new_u`` per tensor.

    ``None`` updates stay ``None``; each new update keeps its input's dtype; ``params`` (``p``
    is ``None`` without them) must match the updates' structure, else a ValueError names the keys.
    ``per_tensor`` as in :func:`leafwise`. ``per_buffer(u, p, lengths, key)``, optional with
    ``per_tensor``, is the same rule written for a whole flat buffer ``key`` whose segments have
    ``lengths`` elements (with ``functional_bagua.segments``); inside a fused update it runs
    instead of a loop over the segments. A rule that only sums over each segment may run where
    the buffer holds DTensors' local shards, taking its sums across the ranks with
    ``norms_of_whole_tensors`` (``lengths`` are then this rank's
    parts). Without ``per_buffer``, a per-tensor rule gets whole tensors there too: each gathered
    to an owner rank, which runs the rule (with the whole parameter where ``needs_params``, else
    ``p`` is ``None``), and its rows sent back (``functional_bagua.distributed.whole_tensors``).

    Args:
        update_leaf: ``update_leaf(u, p) -> new_u``, called on each update that is not ``None``
            (``p`` is ``None`` when ``update`` gets no ``params``).
        name: the transform's name, used in error messages.
        needs_params: with ``True``, ``update`` without ``params`` raises a ValueError.
        per_tensor: ``True`` for a rule that is not elementwise (as in :func:`leafwise`).
        per_buffer: ``per_buffer(u, p, lengths, key) -> new_u``, the rule for a whole flat buffer,
            used inside a fused update (only with ``per_tensor``); ``None`` loops over the segments.
        in_place: the same rule computing its result in ``u`` (``u.mul_(s)`` for ``u * s``), to
            the same bits, for an elementwise rule that returns new tensors: the transform then
            declares its updates fresh, and runs ``in_place`` where the chain hands it updates
            it may overwrite (``functional_bagua.ownership``).

    Returns:
        A GradientTransformation whose state is an ``EmptyState``.

    Example::

        double = fb.stateless(lambda u, p: 2 * u, name="double")
    """

    if in_place is not None and per_tensor:
        raise ValueError(f"{name}: in_place is for elementwise rules, not per_tensor ones")
    own_rules = {  # (the rule, the rule on complex tensors' real views), by whether it may overwrite u
        overwrite: (leaf_rule, leaf_rule if per_tensor else _stateless_on_real_views(leaf_rule))
        for overwrite, leaf_rule in ((False, update_leaf), (True, update_leaf if in_place is None else in_place))
    }

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: Optional[PyTree] = None) -> tuple[PyTree, EmptyState]:
        if params is None and needs_params:
            raise ValueError(f"{name} needs the parameters: call update(grads, state, params)")
        grouped = not per_tensor and foreach.grouped_enabled()
        x = LeafLists.of(updates, params, who=name, complex_ok=not per_tensor, grouped=grouped)
        new, state = on_lists(x, state, ownership.granted_to(update))
        return x.unflatten(new), state

    def on_lists(x: LeafLists, state: EmptyState, overwrite: bool) -> tuple[list, EmptyState]:
        """The update on checked lists (:mod:`functional_bagua.leaf_lists`), computed in the
        given updates when ``overwrite`` grants them and the rule can."""
        leaf_rule, rule = own_rules[in_place is not None and overwrite]
        keys = _segmented_keys(x.spec, per_tensor)
        new: list[Optional[torch.Tensor]] = [None] * len(x.updates)
        singles = list(x.singles)
        if per_tensor and per_buffer is None and keys is None:  # FSDP2's row-sharded DTensors: whole on owners
            singles = _map_row_sharded(leaf_rule, x, singles, new, needs_params, name)
        columns = [x.updates, x.params]
        for members in x.groups:
            us = foreach.run_grouped(leaf_rule, columns, members)
            if us is None:  # the rule needs single tensors
                singles.extend(members)
                continue
            _place(us, members, new, x.updates, updates_of=name)
        for i in sorted(singles):
            u, p = x.updates[i], x.params[i]
            new[i] = (
                _update_in(rule(u, p), u.dtype, name)
                if keys is None
                else per_buffer(u, p, layout_context.segment_lengths_of(keys[i]), keys[i]).to(u.dtype)
                if per_buffer
                else _map_whole_tensors(leaf_rule, u, p if needs_params else None, keys[i])
                if layout_context.owner_plan_of(keys[i]) is not None
                else _map_segments(leaf_rule, u, p, _segments_of(keys[i]))
            )
        return new, state

    update.fresh_updates = in_place is not None  # type: ignore[attr-defined]
    if not per_tensor:  # a chain may run it on its checked lists (leaf_lists)
        update.on_lists = on_lists  # type: ignore[attr-defined]
        update.input_name = name  # type: ignore[attr-defined]
        update.needs_params = needs_params  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


def _segmented_keys(spec: optree.PyTreeSpec, per_tensor: bool) -> Optional[list]:
    """The flat-buffer key of each leaf when a per-tensor rule runs inside a fused update, else ``None``."""
    return tree.leaf_names(spec) if per_tensor and layout_context.active_layout() is not None else None


def _segments_of(key: str) -> tuple[Segment, ...]:
    """The segments of the flat buffer ``key``; called only while a fused update runs."""
    segments = layout_context.segments_of(key)
    assert segments is not None, "no fused update is running"
    return segments


def _per_segment_states(state_type: Any, states: list) -> Any:
    """Per-segment states of one buffer, as one state whose fields are tuples over the segments."""
    return state_type(*(tuple(s[k] for s in states) for k in range(len(state_type._fields))))


def _update_segments(
    update_leaf: Callable[[torch.Tensor, Any, Optional[torch.Tensor]], tuple],
    state_type: Any,
    g: torch.Tensor,
    s: NamedTuple,
    p: Optional[torch.Tensor],
    segments: Sequence[Segment],
) -> tuple:
    """A per-tensor rule on each segment of a flat buffer: the updates concatenated back into one
    buffer, the states kept per segment."""
    updates, states = [], []
    for j, seg in enumerate(segments):
        old = state_type(*(field[j] for field in s))
        u, new = update_leaf(seg.of(g), old, None if p is None else seg.of(p))
        updates.append(u.to(g.dtype).reshape(-1))
        states.append(_with_dtypes_of(new, old))
    return torch.cat(updates), _per_segment_states(state_type, states)


def _map_segments(
    update_leaf: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
    u: torch.Tensor,
    p: Optional[torch.Tensor],
    segments: Sequence[Segment],
) -> torch.Tensor:
    """A stateless per-tensor rule on each segment of a flat buffer, concatenated back."""
    return torch.cat(
        [update_leaf(seg.of(u), None if p is None else seg.of(p)).to(u.dtype).reshape(-1) for seg in segments]
    )


def _map_row_sharded(
    update_leaf: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
    x: LeafLists,
    singles: list,
    new: list,
    needs_params: bool,
    name: str,
) -> list:
    """A stateless per-tensor rule on the DTensors among ``singles`` that are sharded by rows
    (FSDP2's): each gathered whole to an owner rank, which runs the rule, and its rows sent back,
    in two collectives per mesh and dtype (:func:`~functional_bagua.distributed.whole_tensors.map_dtensors`),
    instead of the rule's ops on DTensors (a collective per matmul). Their results go into
    ``new``; the indices of the other tensors are returned."""
    from functional_bagua.flat import is_dtensor

    if not any(is_dtensor(x.updates[i]) for i in singles):
        return singles
    from functional_bagua.distributed import whole_tensors

    sharded = [i for i in singles if whole_tensors.gatherable(x.updates[i])]
    if not sharded:
        return singles
    params = [x.params[i] if needs_params else None for i in sharded]
    mapped = whole_tensors.map_dtensors(
        lambda u, p: update_leaf(u, p).to(u.dtype), [x.updates[i] for i in sharded], params
    )
    for i, u in zip(sharded, mapped):
        new[i] = _update_in(u, x.updates[i].dtype, name)
    done = set(sharded)
    return [i for i in singles if i not in done]


def _map_whole_tensors(
    update_leaf: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
    u: torch.Tensor,
    p: Optional[torch.Tensor],
    key: str,
) -> torch.Tensor:
    """A stateless per-tensor rule on the whole tensors of a flat buffer of DTensors' local
    shards: each computed by its owner rank, this rank's rows of the results back in one buffer
    (:mod:`functional_bagua.distributed.whole_tensors`)."""
    return layout_context.owner_plan_of(key).map(lambda whole, whole_p: update_leaf(whole, whole_p).to(u.dtype), u, p)


def _field_leaves(spec: optree.PyTreeSpec, state: NamedTuple, field: str, name: str, segmented: bool = False) -> list:
    try:
        field_tree = getattr(state, field)
    except AttributeError:
        raise ValueError(f"{name}: state has no field {field!r}; was it made by this transform's init?") from None
    if segmented:  # one tuple of per-segment tensors per buffer
        return tree.leaves_up_to(spec, field_tree, "grads", "the params the state was made for")
    try:
        return tree.leaves_matching(spec, field_tree, "grads", "the params the state was made for")
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _as_given(column: Optional[list], shared: bool, overwrites: list, dtype: torch.dtype) -> Any:
    """A state field's tensors as ``foreach.run_grouped`` gives them to a rule: ``None`` for a
    field of ``None`` s, the one value of equal per-tensor scalars, else ``Leaves`` of state
    given up (its overwrites noted in ``overwrites``)."""
    if column is None:
        return None
    return column[0] if shared else foreach.Leaves(column, given=overwrites, plain=dtype)


def _written_by(write_leaf: Callable[..., Any], alpha: float, g: Any, s: Any, p: Any) -> tuple:
    """``(None, new state)``: ``write_leaf``'s step with ``alpha`` written into ``p``, as a rule's
    ``(u, new state)`` (no update)."""
    return None, write_leaf(g, s, p, alpha)


def _length(part: slice) -> int:
    """The number of tensors in a chunk's slice (:func:`~functional_bagua.accepted.in_cache_chunks`)."""
    return part.stop - part.start


def _one_scalar_like(value: Any, old: torch.Tensor) -> bool:
    """Whether ``value`` is a 0-dim CPU tensor of ``old``'s dtype that autograd does not record
    (a count computed once for a group, copied into each tensor's old one)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.dtype == old.dtype
        and value.is_cpu
        and not value.requires_grad
    )


def _scalars_beside(g: Any, s: NamedTuple) -> Any:
    """Where a rule runs on one tensor: on a GPU, its state's 0-dim CPU tensors (step counts
    ``fb.Optimizer`` holds on the CPU) taken beside its tensors by each op that mixes them
    (:class:`~functional_bagua.foreach.ScalarsBeside`: its factors computed on the CPU, as
    grouped); else nothing."""
    if (
        isinstance(g, torch.Tensor)
        and not g.is_cpu
        and any(isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_cpu for t in s)
    ):
        return foreach.ScalarsBeside(g.device)
    return contextlib.nullcontext()


def _scalars_on_the_cpu(state_leaves: list, present: list) -> bool:
    """Whether the state's 0-dim tensors at ``present`` (its step counts) are all on the CPU, so
    that the rule's factors are numbers whatever its tensors' device (``fb.Optimizer`` holds them
    there beside a GPU's tensors)."""
    return all(
        t.is_cpu
        for leaves in state_leaves
        for t in (leaves[i] for i in present)
        if isinstance(t, torch.Tensor) and t.dim() == 0
    )


def _has_dims(x: Any) -> bool:
    """Whether ``x`` is a tensor of at least one dimension (a state field beside a step count)."""
    return isinstance(x, torch.Tensor) and x.dim() > 0


def _with_dtypes_of(new: Any, old: Any) -> Any:
    """``new`` with each tensor cast to the dtype of its counterpart in ``old``.

    Scalar factors are float64 0-dim tensors, and 0-dim by 0-dim arithmetic promotes, so a 0-dim
    float32 parameter's math runs in float64; the cast brings state and updates back to the
    tensor's own dtype (a no-op for every other tensor).
    """
    return type(new)(*(_like(n, o) for n, o in zip(new, old)))


def _like(new: Any, old: Any) -> Any:
    """``new`` in ``old``'s dtype when both are tensors (:func:`_with_dtypes_of` for one field)."""
    return _in_dtype(new, old.dtype) if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) else new


def _place(values: list, members: list, into: list, like: list, *, updates_of: Optional[str] = None) -> None:
    """``into[i] = values[j]`` for the ``j``-th index ``i`` of ``members``, each tensor in the
    dtype of ``like[i]`` when that is a tensor (:func:`_like` for a group's results: in the usual
    case, where every dtype is already right, one comparison of two lists). ``updates_of``: the
    values are the updates of the rule of that transform, which must be tensors (a TypeError
    names it otherwise); ``like`` holds their inputs."""
    olds = [like[i] for i in members]
    try:
        kept = [v.dtype for v in values] == [o.dtype for o in olds]
    except AttributeError:  # a value or an old leaf that is not a tensor
        kept = False
    if kept:
        for i, value in zip(members, values):
            into[i] = value
    else:
        for i, value, old in zip(members, values, olds):
            into[i] = _update_in(value, old.dtype, updates_of) if updates_of is not None else _like(value, old)


def _update_in(u: Any, dtype: torch.dtype, who: str) -> torch.Tensor:
    """A rule's update ``u`` in ``dtype``; a TypeError naming ``who`` if it is not a tensor."""
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"{who}: the rule gave a {type(u).__name__} as an update, not a tensor")
    return u.to(dtype)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (``t`` itself when it is already)."""
    return t if t.dtype == dtype else t.to(dtype)


def _on_real_views(update_leaf: Callable[..., tuple]) -> Callable[..., tuple]:
    """An elementwise rule applied to complex tensors as torch.optim does: on their real views
    (``torch.view_as_real``: each complex number as a pair of reals, so a second moment is
    ``re^2`` and ``im^2``, never the complex square ``g^2``); real tensors go through as they are."""

    def rule(g: torch.Tensor, s: NamedTuple, p: Optional[torch.Tensor]) -> tuple:
        if not g.is_complex():
            return update_leaf(g, s, p)
        u, new_s = update_leaf(_real_view(g), type(s)(*map(_real_view, s)), _real_view(p))
        back = [torch.view_as_complex(n) if _is_complex(o) else n for n, o in zip(new_s, s)]
        return torch.view_as_complex(u.to(g.real.dtype)), type(new_s)(*back)

    return rule


def _stateless_on_real_views(update_leaf: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """:func:`_on_real_views` for a stateless rule ``update_leaf(u, p) -> new_u``."""

    def rule(u: torch.Tensor, p: Optional[torch.Tensor]) -> torch.Tensor:
        if not u.is_complex():
            return update_leaf(u, p)
        return torch.view_as_complex(update_leaf(_real_view(u), _real_view(p)).to(u.real.dtype))

    return rule


def _is_complex(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.is_complex()


def _real_view(x: Any) -> Any:
    return torch.view_as_real(x) if _is_complex(x) else x
