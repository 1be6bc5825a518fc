"""SOAP (Vyas et al., 2024): Adam in the eigenbasis of Shampoo's preconditioner.

Per tensor ``G`` (viewed with shape ``(d_1, ..., d_k)``, see ``merge_dims``), each dimension
``i`` keeps Shampoo's statistic ``L_i`` and its eigenbasis ``Q_i``; a dimension larger than
``max_precondition_dim`` (and a vector's only one, unless ``precondition_1d``) keeps none, and
its ``Q_i`` is the identity. With ``G x_i Q`` the product of ``G`` with ``Q`` along dimension
``i`` (for a matrix, ``Q_1^T G Q_2`` projects it into the eigenbasis)::

    L_i <- lerp(L_i, G_(i) G_(i)^T, 1 - shampoo_beta)       G_(i): dimension i by all the others

    the first gradient:   L_i from it, Q_i = eigenvectors(L_i) by decreasing eigenvalue, u = 0
    each later step s = 1, 2, ... (the number of gradients before this one):
        G' = G x_1 Q_1 ... x_k Q_k                            into the eigenbasis
        m <- lerp(m, G, 1 - b1)                               in the parameter's basis
        v <- lerp(v, G'^2, 1 - b2)                            in the eigenbasis
        u = ((m x_1 Q_1 ... x_k Q_k) / (sqrt(v) + eps)) x_1 Q_1^T ... x_k Q_k^T
        u <- u / (RMS(u) + eps)                               (normalize_gradient)
        u <- u * sqrt(1 - b2^s) / (1 - b1^s)                  (bias correction)
        then L_i takes G (above), and when s % precondition_frequency == 0 each Q_i is
        refreshed by one power iteration: P = L_i Q_i, its columns (and v along dimension i)
        ordered by decreasing diag(Q_i^T P), Q_i = QR(P).Q

as the authors' algorithm and pytorch-optimizer's ``SOAP``. Here ``m`` is kept in the eigenbasis
(``m' = m x_1 Q_1 ... x_k Q_k``, updated with ``G'``: the same numbers, as projecting is
linear), so each step projects ``G`` in and ``u`` back once; a refresh carries ``m'`` over to the
new eigenbasis. The matrix work of tensors of one shape is batched: one ``eigh``, one QR and one
batched matmul per shape and product, whatever the number of tensors, and between steps the
state of one shape stays the rows of one tensor. Where a statistic may still be of less than
full rank when it is next decomposed (one gradient of a non-square matrix), its eigenvectors
depend on every rounding: there the products and decompositions run one matrix at a time,
rounded as the reference's (:func:`rounding_matters`). Each tensor counts its own gradients (as
torch.optim's ``state["step"]``), so a tensor whose first gradient comes late initializes its
preconditioner then.

A scalar (0-dim) tensor has no dimension to precondition: it steps as Adam does, as in the
reference.

Compiled (``torch.compile``, ``make_train_step``) nothing is read from the counts: the tensors of
one shape step as one batch, each row at its own count, and the decompositions run in an
operator of their own that the compiled step calls (:func:`decompose_`: a first gradient's
``eigh`` only in a step where some row is at its first, a refresh only where some row
refreshes; rows that do not are kept), so inductor generates no code for them. Every shape then runs
batched, including where :func:`rounding_matters`, so directions that rounding decides may
differ from an eager run's. Inside :func:`~functional_bagua.fuse` the state of each flat buffer
is kept per group of equal-shaped tensors, stacked (:func:`fused_state_of`): the graph, and its
compile time, grow with the number of distinct shapes, not of tensors.

``matrix_dtype`` is the precision of the eigendecompositions and QRs: ``None`` (the reference's)
takes ``eigh`` in the statistics' dtype (at least float32) and the QR in float32; a dtype takes
both in it (``torch.float64`` for the most exact eigenbases). The statistics keep the gradient's
dtype, as the reference.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from functional_bagua import layout_context, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.compiling import own_code
from functional_bagua.flat import Rows
from functional_bagua.leaf_lists import LeafLists
from functional_bagua.numerics import number_now, read_counts, zero_count
from functional_bagua.transforms.batched_matrices import (
    Owners,
    at_least_float32,
    cached_eagerly,
    check_number,
    check_state_type,
    decided_by,
    device_of,
    fused_buffers,
    gather_rows,
    initial_fields,
    merge_small_dims,
    own_storage,
    owner_computes_all,
    per_element,
    per_row,
    restack,
    rows_of,
    scatter_rows,
)
from functional_bagua.tree import PyTree

NAME = "scale_by_soap"
EIGH_JITTER = 1e-30  # added to the diagonal before eigh, as the reference
NO_MATRIX = (0,)  # the shape of the placeholder of a dimension without a preconditioner


class ScaleBySoapState(NamedTuple):
    """Per tensor: ``count`` (its gradients so far), ``mu`` (``m'``, the first moment in the
    eigenbasis) and ``nu`` (``v``, in the eigenbasis), both of the tensor's shape, and per
    dimension of its preconditioned view the statistic ``L_i`` (``statistics``) and eigenbasis
    ``Q_i`` (``eigenbases``), tuples holding an empty tensor for a dimension without a
    preconditioner. Inside :func:`~functional_bagua.fuse`, per flat buffer, each field is a tuple
    over its groups of equal-shaped tensors, each stacked (``fused_state_of``)."""

    count: PyTree  # a field named like tuple.count, as in optax
    mu: PyTree
    nu: PyTree
    statistics: PyTree
    eigenbases: PyTree


class Layout(NamedTuple):
    """How SOAP views one tensor: ``shape``, the view its preconditioners act on, and which of
    its dimensions have one."""

    shape: tuple
    preconditioned: tuple


def layout_of(shape: tuple, max_precondition_dim: int, merge_dims: bool, precondition_1d: bool) -> Layout:
    """The view of a tensor of ``shape`` and its preconditioned dimensions (module docstring).

    Args:
        shape: the tensor's shape.
        max_precondition_dim: dimensions above it get no preconditioner.
        merge_dims: merge small neighbouring dimensions first (:func:`merge_small_dims`).
        precondition_1d: give a vector a preconditioner.
    """
    if len(shape) == 0:
        return Layout((1,), (False,))
    if len(shape) == 1:
        return Layout(tuple(shape), (precondition_1d and shape[0] <= max_precondition_dim,))
    view = merge_small_dims(tuple(shape), max_precondition_dim) if merge_dims else tuple(shape)
    return Layout(view, tuple(d <= max_precondition_dim for d in view))


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: Optional[float] = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precondition_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_gradient: bool = False,
    correct_bias: bool = True,
    matrix_dtype: Optional[torch.dtype] = None,
    group: Any = None,
) -> GradientTransformation:
    """SOAP's direction ``u`` (module docstring); chain it with a learning rate.

    Args:
        b1: the decay of the first moment ``m``.
        b2: the decay of the second moment ``v``.
        shampoo_beta: the decay of the statistics ``L_i`` (``None``: ``b2``).
        eps: added to ``sqrt(v)`` (and to the RMS with ``normalize_gradient``).
        precondition_frequency: refresh the eigenbases every this many steps (an int >= 1).
        max_precondition_dim: dimensions above it get no preconditioner (an int >= 1).
        merge_dims: precondition a view with small neighbouring dimensions merged.
        precondition_1d: give vectors (biases, norms) a preconditioner too.
        normalize_gradient: divide ``u`` by its RMS before the bias correction.
        correct_bias: multiply ``u`` by ``sqrt(1 - b2^s) / (1 - b1^s)``.
        matrix_dtype: the precision of ``eigh`` and QR (module docstring).
        group: a torch process group whose ranks hold the same gradients (after
            ``allreduce_gradients``): each eigendecomposition and QR is computed by one of its
            ranks and shared, all of an update's in one all-gather
            (``batched_matrices.owner_computes_all``: ranks whose statistics differ are refused,
            each with the same ValueError); eager only (a TypeError under torch.compile);
            ``None``: all here.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleBySoapState`.

    Example::

        tx = fb.chain(fb.scale_by_soap(), fb.scale_by_learning_rate(3e-3))
    """
    shampoo = b2 if shampoo_beta is None else shampoo_beta
    _check_arguments(b1, b2, shampoo, eps, precondition_frequency, max_precondition_dim, matrix_dtype)

    owners = Owners(group, NAME, "decompositions")  # who computes which rows (group=), per update

    @cached_eagerly
    def layout(shape: tuple) -> Layout:
        """The layout of a tensor of ``shape``."""
        return layout_of(shape, max_precondition_dim, merge_dims, precondition_1d)

    def init_leaf(p: torch.Tensor) -> tuple:
        view = layout(p.shape)
        matrices = zero_matrices(p, view)
        return zero_count(p), torch.zeros_like(p), torch.zeros_like(p), matrices, tuple(m.clone() for m in matrices)

    def init(params: PyTree) -> ScaleBySoapState:
        return ScaleBySoapState(*initial_fields(params, NAME, 5, init_leaf, fused_state_of, _groups))

    def _groups(key: str) -> list[tuple[Layout, Rows]]:
        """The groups of equal-shaped tensors of the flat buffer ``key`` of the fused update
        running now: ``(layout, rows)`` each (:meth:`~functional_bagua.FlatLayout.shape_groups`)."""
        return [(layout(shape), rows) for shape, rows in layout_context.shape_groups_of(key, NAME)]

    def update(grads: PyTree, state: ScaleBySoapState, params: Optional[PyTree] = None) -> tuple:
        check_state_type(NAME, state, ScaleBySoapState)
        owners.begin_update()
        traced = torch.compiler.is_compiling()
        x = LeafLists.of(grads, params, who=NAME, complex_ok=False, grouped=False)
        fields = [
            tree.leaves_up_to(x.spec, field, f"the state's {name!r}", "the gradients")
            for name, field in zip(ScaleBySoapState._fields, state)
        ]
        if not traced:  # with group=: every rank decides alike (else its collectives would wait for ever)
            owners.agree(lambda: decided_by(x.updates, fields[0]), device_of(x.updates, fields[0]))
        if layout_context.active_layout() is not None:
            return fused_update(x, fields, traced)
        stepping = _batches(x.updates, fields[0], layout, traced)
        stepped = {i for members, _ in stepping for i in members}
        # a tensor that does not step keeps its state, in storage of its own (module docstring)
        new_fields = [
            [leaf if i in stepped or traced else own_storage(leaf) for i, leaf in enumerate(column)]
            for column in fields
        ]
        updates: list = [None if g is None else torch.zeros_like(g) for g in x.updates]  # empty ones stay 0
        calls = []
        for members, count in stepping:
            view = layout(x.updates[members[0]].shape)
            batch_state = [[column[i] for i in members] for column in fields]
            check = functools.partial(_check_states, x.updates, fields, members, view, x.spec)
            # the stacked gradient and state are made when the batch steps: not every batch's at once
            calls.append(
                (
                    functools.partial(restack, [x.updates[i] for i in members], view.shape),
                    functools.partial(_Batch.stacked, count, batch_state, view, check, traced),
                    view,
                )
            )
        for (members, _), (u, batch) in zip(stepping, steps_all(calls)):
            shape = x.updates[members[0]].shape
            for i, (u_i, count_i, mu_i, nu_i, statistics_i, bases_i) in zip(members, batch.rows(u, shape)):
                updates[i] = u_i
                new_fields[0][i], new_fields[1][i], new_fields[2][i] = count_i, mu_i, nu_i
                new_fields[3][i] = _kept_where_none(statistics_i, fields[3][i])
                new_fields[4][i] = _kept_where_none(bases_i, fields[4][i])
        return x.unflatten(updates), ScaleBySoapState(*(x.unflatten(column) for column in new_fields))

    def fused_update(x: LeafLists, fields: list, traced: bool) -> tuple:
        """The update on flat buffers (inside :func:`~functional_bagua.fuse`): per buffer, each
        group of equal-shaped tensors gathered into one batch, stepped, and scattered back."""
        updates: list = list(x.updates)
        new_fields = [list(column) for column in fields]
        buffers, calls = list(fused_buffers(x, fields, NAME, fused_state_of, _groups)), []
        for _, g, groups, buffer_state in buffers:
            counts = None if traced else read_counts([c[0] for c in buffer_state[0]])
            for j, (view, rows) in enumerate(groups):
                batch = _Batch.of_group(None if counts is None else counts[j], [f[j] for f in buffer_state], view)
                calls.append((functools.partial(gather_rows, g, rows, view.shape), batch, view))
        stepped = iter(steps_all(calls))  # every group's step, its decompositions all at once
        for i, g, groups, buffer_state in buffers:
            u = torch.zeros_like(g)
            per_group = []
            for j, (_, rows) in enumerate(groups):
                u_rows, batch = next(stepped)
                u = scatter_rows(u, u_rows, rows)
                per_group.append(batch.grouped(buffer_state[3][j], buffer_state[4][j]))
            updates[i] = u
            for f in range(5):
                new_fields[f][i] = tuple(state_j[f] for state_j in per_group)
        return x.unflatten(updates), ScaleBySoapState(*(x.unflatten(column) for column in new_fields))

    def steps_all(calls: list) -> list:
        """One step (module docstring) of each batch in ``calls`` (per batch ``(g, batch,
        view)``, ``g`` and ``batch`` each given or a function that makes it; the list is
        emptied as the batches begin), every decomposition of the update
        at once: eagerly one :func:`owner_computes_all` (with ``group=``, one all-gather for the
        update); traced, each batch's in :func:`decompose_`. Per batch, ``u`` and its new state."""
        begun = []
        for k, (g, s, view) in enumerate(calls):
            calls[k] = None  # each batch's stacked gradient and old state, freed once begun
            begun.append(begin(g() if callable(g) else g, s() if callable(s) else s, view))
        decompositions = [fn for b in begun for fn in b.decompositions]
        operands = [operand for b in begun for operand in b.operands]
        found = iter(owner_computes_all(decompositions, operands, owners, NAME) if decompositions else [])
        return [b.finish([next(found) for _ in b.decompositions]) for b in begun]

    def begin(g: torch.Tensor, s: "_Batch", view: Layout) -> "Begun":
        """A batch's step up to its decompositions (:class:`Begun`). ``m`` is kept in the
        eigenbasis (the same numbers: projecting is linear), so each step projects ``g`` once
        and ``u`` back once; a refresh carries ``m`` over to the new eigenbasis. The new state
        is a new :class:`_Batch` (torch.compile has lost attributes set on an older object after a
        ``torch.cond``)."""
        exact = rounding_matters(view, s.count, precondition_frequency)
        statistics = accumulate(s.statistics, g, exact)
        on = [d for d, stat in enumerate(statistics) if stat is not None]
        if s.count == 0:  # eager, every row at its first gradient: its first eigenbases, u = 0
            zeros, counts, mu, nu = torch.zeros_like(g), s.counts, s.mu, s.nu

            def first_bases(found: list) -> tuple:
                bases = placed(found, on, [None] * len(statistics))
                return zeros, _Batch(0, counts, mu, nu, statistics, bases)

            eigh = [functools.partial(eigenbasis, matrix_dtype=matrix_dtype, exact=exact[d]) for d in on]
            return Begun(eigh, [statistics[d] for d in on], first_bases)
        projected = project(g, s.bases)
        mu = torch.lerp(s.mu, projected, 1 - b1)
        nu = torch.lerp(s.nu, projected.square(), 1 - b2)
        # the closures below hold only what the new state needs (not the batch's old moments)
        count, counts, bases = s.count, s.counts, s.bases
        first = None if s.count is not None else s.counts == 1  # traced: the rows that only initialize
        if first is not None:
            mu, nu = torch.where(per_row(first, mu), s.mu, mu), torch.where(per_row(first, nu), s.nu, nu)
        correction = bias_correction(s.count, s.counts, g.dtype) if correct_bias else 1.0
        if normalize_gradient:
            u = project(mu / (nu.sqrt() + eps), s.bases, back=True)
            u = u / (u.square().mean(dim=tuple(range(1, u.dim())), keepdim=True).sqrt() + eps) * per_row(correction, u)
        else:  # the correction folded into the first back-projection's matrix: one pass less
            u = project(mu / (nu.sqrt() + eps), s.bases, back=True, scale=correction)
        if first is not None:
            u = torch.where(per_row(first, u), 0.0, u)
            new_bases, mu, nu = decomposed_traced(statistics, s.bases, mu, nu, s.counts, first)
            return Begun([], [], lambda found: (u, _Batch(None, counts, mu, nu, statistics, new_bases)))
        if count is None or count % precondition_frequency or not on:
            return Begun([], [], lambda found: (u, _Batch(count, counts, mu, nu, statistics, bases)))
        m, nu, products = refresh_begun(statistics, bases, mu, nu, matrix_dtype, exact)

        def refreshed_bases(found: list) -> tuple:
            new_bases, new_mu = refresh_finished(bases, m, on, found)
            return u, _Batch(count, counts, new_mu, nu, statistics, new_bases)

        return Begun([functools.partial(orthonormal, exact=exact[d]) for d in on], products, refreshed_bases)

    def bias_correction(count: Optional[int], counts: torch.Tensor, dtype: torch.dtype) -> Any:
        """``sqrt(1 - b2^s) / (1 - b1^s)`` for ``s`` gradients before this one: a number when
        ``count`` is known, else per row from ``counts`` (``s + 1``; 1 where ``s`` is 0, which
        only initializes)."""
        if count is not None:  # a number, or a 0-dim tensor where the betas are (the factory form's)
            factor: Any = math.sqrt(1 - b2**count) / (1 - b1**count)
            # a number, as the alias's (a float64 tensor made one per row would promote the
            # projection); the count was read already, so reading it waits for nothing more
            return float(factor)
        before = (counts - 1).clamp(min=1).to(torch.float64)
        factor = torch.sqrt(1 - torch.pow(b2, before)) / (1 - torch.pow(b1, before))
        return factor.to(dtype)

    def decomposed_traced(
        statistics: list, bases: list, mu: torch.Tensor, nu: torch.Tensor, counts: torch.Tensor, first: torch.Tensor
    ) -> tuple:
        """The decompositions of a traced step (:func:`decompose_`, on copies of the bases):
        the new bases, ``mu`` and ``nu``."""
        on = [d for d, stat in enumerate(statistics) if stat is not None]
        if not on:
            return bases, mu, nu
        new = [b.clone() if b is not None else None for b in bases]
        refreshing = ((counts - 1) % precondition_frequency == 0) & ~first
        # computed in the graph, read by the operator at once
        decisions = torch.stack([first.any(), refreshing.any(), refreshing.all()])
        # mu and nu were computed in this step, so they may be overwritten
        decompose_(
            [statistics[d] for d in on], [new[d] for d in on], on, mu, nu, first, refreshing, decisions, matrix_dtype
        )
        return new, mu, nu

    def accumulate(statistics: list, g: torch.Tensor, exact: list) -> list:
        """Each ``L_d <- lerp(L_d, G_(d) G_(d)^T, 1 - shampoo_beta)`` (``None``: no preconditioner)."""
        return [
            None if stat is None else accumulated(stat, g, d, shampoo, exact[d]) for d, stat in enumerate(statistics)
        ]

    # a code object per instance: dynamo's compiled graphs of one do not count against another's
    # recompile limit (each configuration, its closure's numbers, would otherwise recompile it)
    return GradientTransformation(init, own_code(update))


class Begun(NamedTuple):
    """A batch's step up to its decompositions: ``decompositions`` (functions, each of a batch
    of matrices) of ``operands``, and ``finish``, which takes their results (in that order) and
    gives ``u`` and the batch's new state. The decompositions of every batch of an update run
    together (with ``group=``, in one all-gather)."""

    decompositions: list
    operands: list
    finish: Callable[[list], tuple]


def placed(found: list, on: list, matrices: list) -> list:
    """``matrices`` with ``found``'s entries at the dimensions ``on``."""
    new = list(matrices)
    for d, matrix in zip(on, found):
        new[d] = matrix
    return new


class _Batch:
    """The state of one batch of same-layout tensors during a step, stacked along a new dim 0
    (``None`` for a dimension without a preconditioner)."""

    def __init__(
        self,
        count: Optional[int],
        counts: torch.Tensor,
        mu: torch.Tensor,
        nu: torch.Tensor,
        statistics: list,
        bases: list,
    ) -> None:
        self.count, self.counts, self.mu, self.nu = count, counts, mu, nu
        self.statistics, self.bases = statistics, bases

    @classmethod
    def stacked(
        cls, count: Optional[int], fields: list, view: Layout, check: Callable[[], None], traced: bool = False
    ) -> "_Batch":
        """The batch of the tensors whose state is ``fields`` (one list per field of
        :class:`ScaleBySoapState`, one entry per tensor), all at ``count`` gradients (``None``:
        each at its own, traced): without a copy where each field holds the rows of the previous
        step's batch, else stacked after ``check()`` (which raises for a state made for other
        tensors or options)."""
        counts, mus, nus, statistics, bases = fields
        on = [d for d, kept in enumerate(view.preconditioned) if kept]
        columns = [(counts, ()), (mus, view.shape), (nus, view.shape)] + [
            ([m[d] for m in column], (view.shape[d], view.shape[d])) for column in (statistics, bases) for d in on
        ]
        found: list[Optional[torch.Tensor]] = [
            None if traced else rows_of(tensors, shape) for tensors, shape in columns
        ]
        placeholders = [
            m[d] for column in (statistics, bases) for m in column for d in range(len(view.shape)) if d not in on
        ]
        if traced or any(f is None for f in found) or any(tuple(p.shape) != NO_MATRIX for p in placeholders):
            check()
        stacked = [
            f if f is not None else torch.stack([t.reshape(shape) for t in tensors])
            for f, (tensors, shape) in zip(found, columns)
        ]
        counts_b, mu, nu, *matrices = stacked

        def per_dim(first: int) -> list:
            pieces = iter(matrices[first : first + len(on)])
            return [next(pieces) if d in on else None for d in range(len(view.shape))]

        return cls(count, counts_b + 1, mu, nu, per_dim(0), per_dim(len(on)))

    @classmethod
    def of_group(cls, count: Optional[int], fields: list, view: Layout) -> "_Batch":
        """The batch of one group of a flat buffer, from its stacked state (``fields``: one value
        per field of :class:`ScaleBySoapState`, :func:`fused_state_of`)."""
        counts, mu, nu, statistics, bases = fields

        def per_dim(matrices: tuple) -> list:
            return [m if on else None for m, on in zip(matrices, view.preconditioned)]

        return cls(count, counts + 1, mu, nu, per_dim(statistics), per_dim(bases))

    def grouped(self, statistics: tuple, bases: tuple) -> tuple:
        """The new state of a group of a flat buffer (:func:`fused_state_of`), keeping the
        placeholders of ``statistics`` and ``bases`` for dimensions without a preconditioner."""
        return (
            self.counts,
            self.mu,
            self.nu,
            _kept_where_none(tuple(self.statistics), statistics),
            _kept_where_none(tuple(self.bases), bases),
        )

    def rows(self, u: torch.Tensor, shape: torch.Size) -> list[tuple]:
        """Per tensor of the batch, its update and new state, one value per field of
        :class:`ScaleBySoapState` (views of the batch's tensors, which the next step stacks back
        without a copy; a dimension without a preconditioner keeps its old placeholder)."""
        per_row = [
            u.unbind(),
            self.counts.unbind(),
            self.mu.unbind(),
            self.nu.unbind(),
            _per_row_tuples(self.statistics, len(u)),
            _per_row_tuples(self.bases, len(u)),
        ]
        if tuple(shape) != tuple(u.shape[1:]):  # a merged view: back to the tensor's shape
            per_row[0], per_row[2], per_row[3] = ([t.view(shape) for t in per_row[k]] for k in (0, 2, 3))
        return list(zip(*per_row))


def _kept_where_none(new: object, old: object) -> object:
    """``new``, with ``old``'s entries where ``new`` (or an entry of its tuple) is ``None``."""
    if new is None:
        return old
    if isinstance(new, tuple):
        return tuple(o if n is None else n for n, o in zip(new, old))  # type: ignore[call-overload]
    return new


def zero_matrices(like: torch.Tensor, view: Layout, rows: tuple = ()) -> tuple:
    """Per dimension of ``view``, a zero ``(*rows, d, d)`` matrix in ``like``'s dtype and device,
    or the empty placeholder where the dimension has no preconditioner."""
    return tuple(
        like.new_zeros(*rows, d, d) if on else like.new_zeros(NO_MATRIX)
        for d, on in zip(view.shape, view.preconditioned)
    )


def fused_state_of(flat: torch.Tensor, groups: list) -> tuple:
    """The initial state of one flat buffer of :func:`~functional_bagua.fuse`: per field of
    :class:`ScaleBySoapState`, a tuple over the buffer's groups of equal-shaped tensors
    (``groups``: ``(layout, rows)`` each), each stacked: counts ``(B,)``, moments
    ``(B, *view)``, and per dimension ``(B, d, d)`` matrices or an empty placeholder.

    Args:
        flat: the flat parameter buffer (its dtype and device).
        groups: its groups, in the order the update visits them.
    """
    fields: list[list] = [[] for _ in range(5)]
    for view, where in groups:
        rows = where.number
        fields[0].append(torch.zeros(rows, dtype=zero_count(flat).dtype, device=flat.device))
        fields[1].append(flat.new_zeros(rows, *view.shape))
        fields[2].append(flat.new_zeros(rows, *view.shape))
        for f in (3, 4):
            fields[f].append(zero_matrices(flat, view, (rows,)))
    return tuple(tuple(column) for column in fields)


def _per_row_tuples(matrices: list, rows: int) -> list:
    """Per row, the tuple of its matrices (``None`` where a dimension has none), or ``None``
    per row where no dimension has one (the old placeholders stay)."""
    if all(m is None for m in matrices):
        return [None] * rows
    columns = [m.unbind() if m is not None else [None] * rows for m in matrices]
    return [tuple(row) for row in zip(*columns)]


def rounding_matters(view: Layout, count: Optional[int], frequency: int) -> list[bool]:
    """Per dimension, whether its statistic may still be of less than full rank when it is next
    decomposed (now, at the first gradient, or at the next refresh). Its eigenvectors then
    depend on every rounding, so its products and decompositions round as the reference's
    unbatched ones (:func:`per_element`); elsewhere they run batched. After ``t`` gradients
    ``L_d`` has rank at most ``t`` times the product of the other dimensions."""
    if count is None:  # traced: batched throughout (module docstring)
        return [False] * len(view.shape)
    numel = math.prod(view.shape)
    decomposed_at = 0 if count == 0 else -(-count // frequency) * frequency
    return [on and (decomposed_at + 1) * (numel // n) < n for n, on in zip(view.shape, view.preconditioned)]


def _check_states(grads: list, fields: list, members: list, view: Layout, spec: object) -> None:
    """:func:`_check_state` for each tensor of a batch (``fields``: per field, every tensor's)."""
    for i in members:
        _check_state(grads[i], [column[i] for column in fields], view, spec, i)


def _check_state(g: torch.Tensor, leaf: list, view: Layout, spec: object, i: int) -> None:
    """Raise a ValueError unless one tensor's state (``leaf``: one value per field) is what
    ``init`` makes for a parameter of ``g``'s shape with these options."""
    _, mu, nu, statistics, bases = leaf
    expected = tuple((d, d) if on else NO_MATRIX for d, on in zip(view.shape, view.preconditioned))
    got = tuple(tuple(m.shape) for m in statistics) if isinstance(statistics, tuple) else None
    got_bases = tuple(tuple(m.shape) for m in bases) if isinstance(bases, tuple) else None
    if mu.shape != g.shape or nu.shape != g.shape or got != expected or got_bases != expected:
        name = tree.leaf_name(spec, i)  # type: ignore[arg-type]
        raise ValueError(
            f"{NAME}: the state of {name!r} was made for another parameter or other options: its moments have "
            f"shape {tuple(mu.shape)} and its preconditioners {got}, where a parameter of shape {tuple(g.shape)} "
            f"with these options (max_precondition_dim, merge_dims, precondition_1d) has {expected}; make the "
            "state with this transform, tx.init(params)"
        )


def _batches(
    grads: list, counts: list, layout: Callable[[tuple], Layout], traced: bool = False
) -> list[tuple[list[int], Optional[int]]]:
    """The indices of the gradients that step together (one shape, layout, dtype, device and
    count), with their count (all counts read at once: one device sync); traced, the counts are
    not read and each batch's count is ``None``. An empty tensor has nothing to step."""
    present = [i for i, g in enumerate(grads) if g is not None and g.numel()]
    if not present:
        return []
    known: list[Optional[int]] = [None] * len(present) if traced else list(read_counts([counts[i] for i in present]))
    batches: dict[tuple, list[int]] = {}
    for i, count in zip(present, known):
        g = grads[i]  # the shape too: tensors of other shapes may share a view, (1,) and () say
        batches.setdefault((tuple(g.shape), layout(g.shape), g.dtype, g.device, count), []).append(i)
    return [(members, key[4]) for key, members in batches.items()]


def project(x: torch.Tensor, bases: list, back: bool = False, scale: Any = 1.0) -> torch.Tensor:
    """``scale * x x_1 Q_1 ... x_k Q_k`` for a batch ``x`` of shape ``(B, d_1, ..., d_k)`` (with
    ``Q_i^T`` when ``back``); a ``None`` basis is the identity. For matrices ``Q_1^T X Q_2``
    (``Q_1 X Q_2^T`` back); otherwise each product contracts the leading dimension and appends
    the new one last, so after all ``k`` the dimensions are in order. ``scale`` (a number, or
    one per batch element) multiplies the first matrix (or ``x`` where every basis is the
    identity)."""
    matrices: list[Optional[torch.Tensor]] = [
        None if q is None else (q.transpose(-2, -1) if back else q) for q in bases
    ]
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        first = next((d for d, q in enumerate(matrices) if q is not None), None)
        if first is None:
            x = x * per_row(scale, x)
        else:
            factor = per_row(scale, bases[first])
            matrices[first] = bases[first].transpose(-2, -1) * factor if back else bases[first] * factor
    if len(matrices) == 2:
        left, right = matrices
        if left is not None:
            x = left.transpose(-2, -1) @ x
        return x if right is None else x @ right
    batch = x.shape[0]
    for q in matrices:
        x = x.movedim(1, -1)
        if q is not None:
            shape = x.shape
            x = torch.matmul(x.reshape(batch, -1, shape[-1]), q).reshape(shape)
    return x


def accumulated(statistic: torch.Tensor, g: torch.Tensor, d: int, beta: float, exact: bool) -> torch.Tensor:
    """``lerp(L_d, G_(d) G_(d)^T, 1 - beta)`` per batch element, ``G_(d)``: ``g`` with dimension
    ``d`` by all the others. Where ``exact`` (:func:`rounding_matters`) as the reference rounds
    it, one product per element and then the lerp; elsewhere ``beta L + (1 - beta) G G^T`` in one
    batched product."""
    rows = g.movedim(d + 1, 1).reshape(g.shape[0], g.shape[d + 1], -1)
    if exact:
        return torch.lerp(statistic, per_element(torch.matmul, rows, rows.mT), 1 - beta)
    number = number_now(beta)
    if number is None:  # held as a tensor and read as data (traced, or on a GPU)
        return statistic * beta + (rows @ rows.mT) * (1 - beta)
    return torch.baddbmm(statistic, rows, rows.mT, beta=number, alpha=1 - number)


def eigenbasis(statistic: torch.Tensor, matrix_dtype: Optional[torch.dtype], exact: bool) -> torch.Tensor:
    """The eigenvectors of each symmetric ``statistic`` by decreasing eigenvalue, in
    ``statistic``'s dtype (computed in ``matrix_dtype``, or at least float32; one matrix at a
    time where ``exact``)."""
    dtype = matrix_dtype or at_least_float32(statistic.dtype)
    jitter = EIGH_JITTER * torch.eye(statistic.shape[-1], dtype=dtype, device=statistic.device)
    matrices = statistic.to(dtype) + jitter
    if exact:
        vectors = per_element(lambda m: torch.linalg.eigh(m).eigenvectors, matrices)
    else:
        vectors = torch.linalg.eigh(matrices).eigenvectors
    return vectors.flip(-1).to(statistic.dtype).contiguous()  # LAPACK's column-major result: rows restack


def ordered_product(
    statistic: torch.Tensor,
    basis: torch.Tensor,
    nu: torch.Tensor,
    d: int,
    matrix_dtype: Optional[torch.dtype],
    exact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of one power iteration of the eigenbasis of dimension ``d`` (module
    docstring): ``L_d Q_d`` with its columns by decreasing eigenvalue estimate, in
    ``matrix_dtype`` (:func:`orthonormal` makes it the new basis), and ``nu`` with its entries
    along dimension ``d`` in that order (one matrix at a time where ``exact``)."""
    product = per_element(torch.matmul, statistic, basis) if exact else statistic @ basis
    estimates = (basis * product).sum(dim=-2)
    order = torch.argsort(estimates, dim=-1, descending=True)
    product = product.gather(-1, order.unsqueeze(-2).expand_as(product))
    index = order.view(order.shape[0], *([1] * d), -1, *([1] * (nu.dim() - d - 2))).expand_as(nu)
    return product.to(matrix_dtype or torch.float32), nu.gather(d + 1, index)


def orthonormal(matrices: torch.Tensor, exact: bool) -> torch.Tensor:
    """The ``Q`` of each matrix's QR decomposition (one matrix at a time where ``exact``)."""
    return per_element(lambda m: torch.linalg.qr(m).Q, matrices) if exact else torch.linalg.qr(matrices).Q


def refresh_begun(
    statistics: list, bases: list, mu: torch.Tensor, nu: torch.Tensor, matrix_dtype: Optional[torch.dtype], exact: list
) -> tuple:
    """The first half of a refresh of the eigenbases (one power iteration each, module
    docstring): ``m`` in the parameter's basis (to carry over to the new eigenbases), ``nu``
    reordered as the bases will be, and per preconditioned dimension ``L_d Q_d``, reordered,
    whose QR (:func:`orthonormal`) is the new basis."""
    m = project(mu, bases, back=True)
    products = []
    for d, stat in enumerate(statistics):
        if stat is not None:
            product, nu = ordered_product(stat, bases[d], nu, d, matrix_dtype, exact[d])
            products.append(product)
    return m, nu, products


def refresh_finished(bases: list, m: torch.Tensor, on: list, found: list) -> tuple:
    """The second half of a refresh: the new bases (``found``, the QRs' ``Q`` of the
    dimensions ``on``, in the bases' dtype) and ``m`` carried over to them."""
    new = placed([q.to(bases[d].dtype).contiguous() for d, q in zip(on, found)], on, bases)
    return new, project(m, new)


# a CUDA graph cannot hold it: it reads its conditions back to the host (inductor runs it between graphs)
@torch.library.custom_op(
    "functional_bagua::soap_decompose_", mutates_args=("bases", "mu", "nu"), tags=(torch.Tag.cudagraph_unsafe,)
)
def decompose_(
    statistics: list[torch.Tensor],
    bases: list[torch.Tensor],
    on: list[int],
    mu: torch.Tensor,
    nu: torch.Tensor,
    first: torch.Tensor,
    rows: torch.Tensor,
    decisions: torch.Tensor,
    matrix_dtype: Optional[torch.dtype],
) -> None:
    """The decompositions of a compiled step, in place, for one batch (rows: tensors of one
    shape; ``statistics`` and ``bases`` those of the preconditioned dimensions ``on``): the rows
    at their first gradient (``first``) take their statistics' eigenvectors as bases, and the
    rows that refresh (``rows``) theirs by a power iteration (module docstring), reordering
    ``nu`` and carrying ``mu`` over; the other rows keep theirs. ``decisions``: whether any row
    is at its first gradient, whether any refreshes and whether all do (3 bools).

    An operator of its own (``functional_bagua::soap_decompose_``), so that a compiled step
    calls it rather than compiling it: inductor would generate code for both sides of each
    ``torch.cond`` (most of a SOAP step's compile time), and a refresh runs one step in
    ``precondition_frequency``. It reads ``decisions`` (on a GPU, one wait for them) and does
    nothing else in a step that neither initializes nor refreshes.
    """
    any_first, any_refresh, every_row = decisions.tolist()
    if any_first:
        for statistic, basis in zip(statistics, bases):
            basis.copy_(torch.where(per_row(first, basis), eigenbasis(statistic, matrix_dtype, False), basis))
    if not any_refresh:
        return
    dims = mu.dim() - 1
    old = placed(bases, on, [None] * dims)
    m, new_nu, products = refresh_begun(
        placed(statistics, on, [None] * dims), old, mu, nu, matrix_dtype, [False] * dims
    )
    new, new_mu = refresh_finished(old, m, on, [orthonormal(p, False) for p in products])
    for target, value in [*((old[d], new[d]) for d in on), (mu, new_mu), (nu, new_nu)]:
        target.copy_(value if every_row else torch.where(per_row(rows, target), value, target))


@decompose_.register_fake
def _decompose_shapes(*args: Any) -> None:
    return None


def _check_arguments(
    b1: float,
    b2: float,
    shampoo_beta: float,
    eps: float,
    precondition_frequency: int,
    max_precondition_dim: int,
    matrix_dtype: Optional[torch.dtype],
) -> None:
    for name, value in (("b1", b1), ("b2", b2), ("shampoo_beta", shampoo_beta)):
        check_number(NAME, name, value, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    check_number(NAME, "eps", eps, lambda v: v >= 0.0, ">= 0")
    for name, count in (
        ("precondition_frequency", precondition_frequency),
        ("max_precondition_dim", max_precondition_dim),
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{NAME}: {name} must be an int >= 1, got {count!r}")
    if matrix_dtype not in (None, torch.float32, torch.float64):
        raise ValueError(
            f"{NAME}: matrix_dtype must be None, torch.float32 or torch.float64 (eigh and QR), got {matrix_dtype!r}"
        )
