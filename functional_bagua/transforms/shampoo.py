"""Shampoo (Gupta et al., 2018), with the distributed-Shampoo reference's blocking, filtered
gradient and grafting (Anil et al., 2020; Meta's ``DistributedShampoo``).

Each tensor is viewed with shape ``(d_1, ..., d_k)`` (small neighbouring dimensions merged with
``merge_dims``) and cut into blocks of at most ``max_preconditioner_dim`` along every dimension.
Each block ``G`` keeps one statistic ``L_i`` per dimension and its inverse root ``R_i``; with
``t`` the tensor's gradients so far (this one included) and ``G x_i R`` the product of ``G``
with ``R`` along dimension ``i`` (``R_1 G R_2`` for a matrix)::

    L_i <- b2 L_i + (1 - b2) G_(i) G_(i)^T      (b2 < 1)    L_i <- L_i + G_(i) G_(i)^T   (b2 = 1)
    every precondition_frequency-th t:  R_i = (L_i / (1 - b2^t) + epsilon I)^(-1/(2k))
                                        (no division for b2 = 1 or without bias correction)
    M <- lerp(M, G, 1 - b1);  M_hat = M / (1 - b1^t)           (M_hat = G for b1 = 0)
    P = M_hat x_1 R_1 ... x_k R_k                              from t = start_preconditioning_step
    P <- P * ||A|| / (||P|| + 1e-16)                           grafting, per block
    P = A                                                      before start_preconditioning_step

with the grafted direction ``A`` (``grafting``) from ``M_hat`` and second moments ``V`` of the
gradient: ``"sgd"``: ``A = M_hat``; ``"adagrad"``: ``V <- V + G^2``, ``A = M_hat / (sqrt(V) + e)``;
``"rmsprop"``: ``V <- lerp(V, G^2, 1 - grafting_beta2)``, the same ``A``; ``"adam"``: the same ``V``,
``A = M_hat / (sqrt(V / (1 - grafting_beta2^t)) + e)``. Without grafting ``P`` is not rescaled,
and before ``start_preconditioning_step`` it is ``M_hat``. The inverse roots come from ``eigh``
(``(max(lambda, 0) + epsilon)^(-1/(2k))`` on each eigenvalue: a statistic is positive
semi-definite, so a negative eigenvalue is rounding) in ``matrix_dtype``, or with
``root_method="newton"`` from the coupled Newton iteration (:func:`inverse_root_newton`: matmuls
only, ``eigh`` for a matrix it leaves unconverged). Blocks of one shape
are batched: one ``eigh`` and one batched matmul per shape, whatever the number of tensors.
Each tensor counts its own gradients, as torch.optim's ``state["step"]``. The statistics,
moments and filtered gradient are kept in float32 at least (for bfloat16 and float16 parameters
too; the direction is cast back), as the reference's factor matrices, and the roots and the
preconditioning run in ``matrix_dtype``: where a statistic is of less than full rank its root
has entries near ``epsilon^(-1/(2k))`` that cancel only in that precision. An empty tensor gets
a zero update.

Compiled (``torch.compile``, ``make_train_step``) nothing is read from the counts: the blocks of
one shape step as one batch, each row at its own count (its bias corrections, refreshes and
start of preconditioning its own), and the inverse roots are recomputed in an operator of their
own that the compiled step calls (:func:`refresh_roots_`, so inductor generates no code for
them), only in a step where some row refreshes (the other rows keep theirs). Inside
:func:`~functional_bagua.fuse` the state of each flat buffer is kept per group of equal-shaped
tensors, per block stacked: the graph, and its compile time, grow with the number of distinct
shapes, not of tensors. With ``epsilon`` far below a rank-deficient statistic's scale, a
compiled step's rounding (inductor's) is amplified by the root's ``epsilon^(-1/(2k))`` entries
as an eager one's would be by any other rounding.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from functional_bagua import layout_context, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.compiling import own_code
from functional_bagua.leaf_lists import LeafLists
from functional_bagua.numerics import is_number, number_now, read_counts, zero_count
from functional_bagua.transforms.batched_matrices import (
    Owners,
    at_least_float32,
    cached_eagerly,
    check_number,
    check_state_type,
    decided_by,
    device_of,
    float_operands,
    fused_buffers,
    gather_rows,
    initial_fields,
    merge_small_dims,
    one_minus_power,
    own_storage,
    owner_computes_all,
    per_row,
    restack,
    scatter_rows,
)
from functional_bagua.tree import PyTree

NAME = "scale_by_shampoo"
GRAFTINGS = (None, "sgd", "adagrad", "rmsprop", "adam")
ROOT_METHODS = ("eigh", "newton")
SECOND_MOMENTS = ("adagrad", "rmsprop", "adam")  # the grafting methods that keep V
NORM_FLOOR = 1e-16  # added to the Shampoo direction's norm before grafting, as the reference


class ScaleByShampooState(NamedTuple):
    """Per tensor: ``count`` (its gradients so far), and per block (in ``blocks_of`` order):
    ``mu`` (``M``, the filtered gradient; an empty tensor for ``b1 = 0``), ``graft`` (``V``, the
    grafting method's second moments; empty without), and tuples of the statistics ``L_i``
    (``statistics``) and of their inverse roots ``R_i`` (``roots``), one per dimension. Inside
    :func:`~functional_bagua.fuse`, per flat buffer, each field is a tuple over its groups of
    equal-shaped tensors: their counts ``(B,)``, and per block its state stacked along a leading
    dimension of ``B``."""

    count: PyTree  # a field named like tuple.count, as in optax
    mu: PyTree
    graft: PyTree
    statistics: PyTree
    roots: PyTree


def blocks_of(shape: tuple, block: int) -> list[tuple]:
    """The blocks of a tensor of ``shape``: per block, a tuple of slices, one per dimension,
    cutting each dimension into runs of at most ``block`` (the last one shorter), in row-major
    order of the blocks.

    Args:
        shape: the (viewed) tensor's shape.
        block: the largest block dimension.
    """
    cuts = [[slice(start, min(start + block, size)) for start in range(0, size, block)] for size in shape]
    return list(itertools.product(*cuts))


def scale_by_shampoo(
    b1: float = 0.9,
    b2: float = 1.0,
    epsilon: float = 1e-12,
    max_preconditioner_dim: int = 1024,
    precondition_frequency: int = 1,
    start_preconditioning_step: Optional[int] = None,
    merge_dims: bool = False,
    grafting: Optional[str] = None,
    grafting_beta2: float = 0.999,
    grafting_epsilon: float = 1e-10,
    use_bias_correction: bool = True,
    matrix_dtype: torch.dtype = torch.float64,
    group: Any = None,
    root_method: str = "eigh",
    newton_iterations: int = 20,
    newton_tolerance: float = 1e-6,
) -> GradientTransformation:
    """Shampoo's direction ``P`` (module docstring); chain it with a learning rate.

    Args:
        b1: the decay of the filtered gradient ``M`` (0: the gradient itself).
        b2: the decay of the statistics (1: their sum, as the paper).
        epsilon: added to the statistics' eigenvalues before the inverse root.
        max_preconditioner_dim: the block size (an int >= 1).
        precondition_frequency: recompute the inverse roots every this many steps (an int >= 1).
        start_preconditioning_step: the first step that uses the roots (``None``:
            ``precondition_frequency``, as the reference); before it, the grafted direction.
        merge_dims: view tensors with small neighbouring dimensions merged (up to the block size).
        grafting: ``None``, ``"sgd"``, ``"adagrad"``, ``"rmsprop"`` or ``"adam"`` (module docstring).
        grafting_beta2: the decay of the grafting second moments (``"rmsprop"``, ``"adam"``).
        grafting_epsilon: added to their square root.
        use_bias_correction: divide ``M`` by ``1 - b1^t`` and the statistics by ``1 - b2^t``.
        matrix_dtype: the precision of ``eigh``, the roots and the preconditioning (``torch.float32``
            for speed, as the reference keeps its roots).
        group: a torch process group whose ranks hold the same gradients (after
            ``allreduce_gradients``): each inverse root is computed by one of its ranks and
            shared (``batched_matrices.owner_computes``, owner-computes as the distributed-Shampoo
            reference; ranks whose statistics differ are refused, each with the same
            ValueError); eager only (a TypeError under torch.compile); ``None``: all here.
        root_method: ``"eigh"`` (the reference's default) or ``"newton"``: the coupled Newton
            iteration, batched matmuls only (``inverse_root_newton``; meant for GPUs, where
            ``eigh`` of many matrices is slow, not yet measured there; on the CPU slower than
            ``eigh``), ``eigh`` for a matrix that has not converged.
        newton_iterations: the most steps of the Newton iteration (an int >= 1; compiled, the
            iteration is unrolled to this many).
        newton_tolerance: it stops where ``max |M_k - I| <= newton_tolerance``.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByShampooState`.

    Example::

        tx = fb.chain(fb.scale_by_shampoo(grafting="adam"), fb.scale_by_learning_rate(1e-2))
    """
    start = precondition_frequency if start_preconditioning_step is None else start_preconditioning_step
    _check_arguments(
        b1, b2, epsilon, max_preconditioner_dim, precondition_frequency, start, grafting, grafting_beta2, matrix_dtype
    )
    _check_root_method(root_method, newton_iterations, newton_tolerance)

    def inverse_root_of(statistic: torch.Tensor, root: int) -> Any:
        """The inverse roots by ``root_method`` (:func:`inverse_roots`)."""
        return inverse_roots(statistic, root, root_method, matrix_dtype, newton_iterations, (epsilon, newton_tolerance))

    owners = Owners(group, NAME, "inverse roots")  # who computes which rows (group=), per update

    @cached_eagerly
    def view_of(shape: tuple) -> tuple:
        view = merge_small_dims(shape, max_preconditioner_dim) if merge_dims and len(shape) > 1 else shape
        return view if len(view) else (1,)

    @cached_eagerly
    def cut(shape: tuple) -> list[tuple]:
        return blocks_of(view_of(shape), max_preconditioner_dim)

    @cached_eagerly
    def block_shapes(shape: tuple) -> list[tuple]:
        return [tuple(piece.stop - piece.start for piece in s) for s in cut(shape)]  # blocks_of's slices

    # M and V, else empty placeholders; a b1 given as a tensor (the factory form's, which may hold
    # 0) keeps M: the state's structure does not depend on a value the step reads as data, and with
    # b1 = 0 the kept M is the gradient itself, the same numbers as without it
    moments_kept = (not is_number(b1) or b1 > 0, grafting in SECOND_MOMENTS)

    def zero_state(like: torch.Tensor, shape: tuple, rows: tuple = ()) -> tuple:
        """The zero state of one block of ``shape`` (``rows``: a batch's leading dimensions):
        ``M``, ``V`` (empty placeholders where not kept), the statistics and the roots."""
        matrix = at_least_float32(like.dtype)  # low-precision roots would not cancel: float32 at least
        statistics = tuple(like.new_zeros(*rows, n, n, dtype=matrix) for n in shape)
        roots = tuple(torch.zeros_like(m, dtype=matrix_dtype) for m in statistics)
        mu, graft = (
            like.new_zeros(*rows, *shape, dtype=matrix) if kept else like.new_zeros(0) for kept in moments_kept
        )
        return mu, graft, statistics, roots

    def init_leaf(p: torch.Tensor) -> tuple:
        per_block = [zero_state(p, shape) for shape in block_shapes(tuple(p.shape))]
        return (zero_count(p), *(tuple(b[f] for b in per_block) for f in range(4)))  # no blocks: empty

    def init(params: PyTree) -> ScaleByShampooState:
        return ScaleByShampooState(*initial_fields(params, NAME, 5, init_leaf, fused_state_of, groups_of))

    def groups_of(key: str) -> tuple:
        return layout_context.shape_groups_of(key, NAME)

    def fused_state_of(flat: torch.Tensor, groups: tuple) -> tuple:
        """The initial state of one flat buffer of :func:`~functional_bagua.fuse`: per field of
        :class:`ScaleByShampooState`, a tuple over the buffer's groups of equal-shaped tensors
        (``groups``: ``(shape, rows)`` each, :meth:`~functional_bagua.FlatLayout.shape_groups`):
        their counts ``(B,)``, and per block of the shape its state stacked over the ``B`` tensors."""
        fields: list[list] = [[] for _ in range(5)]
        for shape, rows in groups:
            fields[0].append(torch.zeros(rows.number, dtype=zero_count(flat).dtype, device=flat.device))
            per_block = [zero_state(flat, block, (rows.number,)) for block in block_shapes(tuple(shape))]
            for f, column in enumerate(zip(*per_block), start=1):
                fields[f].append(tuple(column))
        return tuple(tuple(column) for column in fields)

    def update(grads: PyTree, state: ScaleByShampooState, params: Optional[PyTree] = None) -> tuple:
        check_state_type(NAME, state, ScaleByShampooState)
        owners.begin_update()
        traced = torch.compiler.is_compiling()
        x = LeafLists.of(grads, params, who=NAME, complex_ok=False, grouped=False)
        fields = [
            tree.leaves_up_to(x.spec, field, f"the state's {name!r}", "the gradients")
            for name, field in zip(ScaleByShampooState._fields, state)
        ]
        if not traced:  # with group=: every rank decides alike (else its collectives would wait for ever)
            owners.agree(lambda: decided_by(x.updates, fields[0]), device_of(x.updates, fields[0]))
        if layout_context.active_layout() is not None:
            return fused_update(x, fields, traced)
        present = [i for i, g in enumerate(x.updates) if g is not None and g.numel()]  # an empty one: nothing
        for i in present:
            shapes = block_shapes(tuple(x.updates[i].shape))
            _check_leaf(x.updates[i], [column[i] for column in fields], shapes, moments_kept, matrix_dtype, x, i)
        # traced, the counts are not read: blocks of one shape step together, each at its own count
        steps = None if traced else dict(zip(present, (c + 1 for c in read_counts([fields[0][i] for i in present]))))
        stepped = set(present)
        # a tensor that does not step keeps its state, in storage of its own (not a row of an old batch)
        new_fields = [
            [leaf if i in stepped or traced else own_storage(leaf) for i, leaf in enumerate(column)]
            for column in fields
        ]
        per_block: dict[int, list] = {i: [None] * len(cut(tuple(x.updates[i].shape))) for i in present}
        batches, calls = _block_batches(x.updates, present, steps, block_shapes), []
        for members, t in batches:
            if t is None:
                t = torch.stack([fields[0][i] for i, _ in members]) + 1
            shape = block_shapes(tuple(x.updates[members[0][0]].shape))[members[0][1]]
            mu, graft, statistics, roots = (
                stacked([fields[f][i][k] for i, k in members], shape, kept)
                for f, kept in zip((1, 2, 3, 4), (*moments_kept, True, True))
            )
            # the stacked gradient is made when its batch steps: not every batch's at once
            calls.append((functools.partial(stacked_blocks, x.updates, members), mu, graft, statistics, roots, t))
        for (members, _), (direction, *new) in zip(batches, steps_all(calls)):
            for row, (i, k) in enumerate(members):
                per_block[i][k] = (direction[row], *(unstacked(n, fields[f][i][k], row) for f, n in enumerate(new, 1)))
        updates: list = [None if g is None else torch.zeros_like(g) for g in x.updates]
        for i in present:
            g = x.updates[i]
            blocks = per_block[i]
            shape = tuple(g.shape)
            updates[i] = assembled([b[0] for b in blocks], view_of(shape), cut(shape)).reshape(g.shape)
            new_fields[0][i] = fields[0][i] + 1
            for f in range(1, 5):
                new_fields[f][i] = tuple(b[f] for b in blocks)
        return x.unflatten(updates), ScaleByShampooState(*(x.unflatten(column) for column in new_fields))

    def fused_update(x: LeafLists, fields: list, traced: bool) -> tuple:
        """The update on flat buffers (inside :func:`~functional_bagua.fuse`): per buffer, each
        group of equal-shaped tensors gathered into one batch, stepped block by block, and
        scattered back."""
        updates: list = list(x.updates)
        new_fields = [list(column) for column in fields]
        buffers, calls = list(fused_buffers(x, fields, NAME, fused_state_of, groups_of)), []
        for _, g, groups, buffer_state in buffers:  # every block's step, its roots all at once
            counts = None if traced else read_counts([c[0] for c in buffer_state[0]])
            for j, (shape, rows) in enumerate(groups):
                t = buffer_state[0][j] + 1 if counts is None else counts[j] + 1  # inside fuse all rows step together
                g_rows = gather_rows(g, rows, view_of(tuple(shape)))
                for k, piece in enumerate(cut(tuple(shape))):
                    mu, graft, statistics, roots = (buffer_state[f][j][k] for f in range(1, 5))
                    calls.append(
                        (
                            g_rows[(slice(None),) + piece],
                            mu if moments_kept[0] else None,
                            graft if moments_kept[1] else None,
                            list(statistics),
                            list(roots),
                            t,
                        )
                    )
        stepped = iter(steps_all(calls))
        for i, g, groups, buffer_state in buffers:
            u = torch.zeros_like(g)
            per_group = []
            for j, (shape, rows) in enumerate(groups):
                directions, new_state = [], []
                for k in range(len(cut(tuple(shape)))):
                    mu, graft = buffer_state[1][j][k], buffer_state[2][j][k]
                    direction, m, v, new_statistics, new_roots = next(stepped)
                    directions.append(direction)
                    new_state.append(
                        (mu if m is None else m, graft if v is None else v, tuple(new_statistics), tuple(new_roots))
                    )
                view = view_of(tuple(shape))
                u = scatter_rows(u, assembled(directions, view, cut(tuple(shape)), rows.number), rows)
                per_group.append((buffer_state[0][j] + 1, *(tuple(column) for column in zip(*new_state))))
            updates[i] = u
            for f in range(5):
                new_fields[f][i] = tuple(group_state[f] for group_state in per_group)
        return x.unflatten(updates), ScaleByShampooState(*(x.unflatten(column) for column in new_fields))

    def stacked_blocks(updates: list, members: list) -> torch.Tensor:
        """The blocks ``(tensor index, block index)`` of ``members``, stacked."""
        return torch.stack([_block(updates[i], k, view_of, cut) for i, k in members])

    def steps_all(calls: list) -> list:
        """One step (module docstring) of each batch of same-shape blocks in ``calls`` (per batch:
        ``g``, ``M``, ``V`` (``None`` where not kept), the statistics and roots per dimension,
        stacked, and the count ``t``: an int, or traced per block a 1-D tensor), every refresh of
        the update at once (:func:`refreshed_all`): per batch, the direction and the new ``M``,
        ``V``, statistics and roots."""
        moments = [moments_and_statistics(*call) for call in calls]
        new_roots = refreshed_all([(statistics, call[4], call[5]) for call, (*_, statistics) in zip(calls, moments)])
        return [
            (direction_of(out_dtype, m, g, v, roots, call[5]), m, v, statistics, roots)
            for call, (out_dtype, m, g, v, statistics), roots in zip(calls, moments, new_roots)
        ]

    def moments_and_statistics(
        g: Any,
        mu: Optional[torch.Tensor],
        graft: Optional[torch.Tensor],
        statistics: list,
        roots: list,
        t: Any,
    ) -> tuple:
        """A batch's gradient dtype, new ``M``, the gradient where there is no ``M`` (its
        direction's ``M_hat``; else ``None``: nothing else is kept until the directions), new
        ``V`` and new statistics (``roots`` unused: the arguments of :func:`steps_all`; ``g`` a
        tensor, or a function that makes it)."""
        g = g() if callable(g) else g
        out_dtype, g = g.dtype, g.to(at_least_float32(g.dtype))  # the moments too: float32 at least
        m = torch.lerp(mu, g, 1 - b1) if mu is not None else None
        v = None
        if graft is not None and grafting == "adagrad":
            v = torch.addcmul(graft, g, g)
        elif graft is not None:  # rmsprop, adam
            v = torch.lerp(graft, g.square(), 1 - grafting_beta2)
        statistics = [accumulate(stat, g, d) for d, stat in enumerate(statistics)]
        return out_dtype, m, g if m is None else None, v, statistics

    def direction_of(out_dtype: torch.dtype, m: Any, g: Any, v: Any, roots: list, t: Any) -> torch.Tensor:
        """A batch's direction ``P`` (grafted, or the grafted direction before
        ``start_preconditioning_step``) in ``out_dtype``, from ``M_hat`` (``g`` without ``M``)."""
        m_hat = g if m is None else (m / one_minus_power(b1, t, m) if use_bias_correction else m)
        grafted = graft_direction(m_hat, v, t)
        traced = isinstance(t, torch.Tensor)
        if not traced and t < start:
            return grafted.to(out_dtype)
        # in the roots' precision: their large entries (epsilon^(-1/2k) where a statistic is of
        # less than full rank) cancel only there
        direction = precondition(m_hat.to(matrix_dtype), roots).to(m_hat.dtype)
        if grafting is not None:
            dims = tuple(range(1, direction.dim()))
            grafted_norm = grafted.square().sum(dims, keepdim=True).sqrt()
            direction = direction * (grafted_norm / (direction.square().sum(dims, keepdim=True).sqrt() + NORM_FLOOR))
        if traced:
            direction = torch.where(per_row(t < start, direction), grafted, direction)
        return direction.to(out_dtype)

    def refreshed_all(requests: list) -> list:
        """Per request ``(statistics, roots, t)`` of a batch, its roots, recomputed from the
        statistics where the count ``t`` is a multiple of ``precondition_frequency``: eagerly
        every refreshing batch's roots in one :func:`owner_computes_all` (with ``group=``, one
        all-gather for the update); traced per batch in :func:`refresh_roots_`."""
        if any(isinstance(t, torch.Tensor) for _, _, t in requests):
            return [refreshed(*request) for request in requests]
        fns, batches, places = [], [], []
        for n, (statistics, _, t) in enumerate(requests):
            if not statistics or t % precondition_frequency:
                continue
            correction = statistics_correction(t, statistics[0])
            for d, stat in enumerate(statistics):
                fns.append(functools.partial(inverse_root_of, root=2 * len(statistics)))
                batches.append(stat / correction)
                places.append((n, d))
        new_roots = [list(roots) for _, roots, _ in requests]
        for (n, d), root in zip(places, owner_computes_all(fns, batches, owners, NAME) if batches else []):
            new_roots[n][d] = root
        return new_roots

    def refreshed(statistics: list, roots: list, t: torch.Tensor) -> list:
        """Traced, a batch's roots recomputed from its statistics (:func:`refresh_roots_`, on
        copies of the roots) where some block refreshes (``t`` a multiple of
        ``precondition_frequency``; the others keep theirs)."""
        if not statistics:
            return roots
        correction = statistics_correction(t, statistics[0])
        new = [r.clone() for r in roots]
        # epsilon and the tolerance as a tensor: dynamo may make a float symbolic (dynamic=True)
        constants = float_operands(statistics[0], epsilon, newton_tolerance)
        refreshing = t % precondition_frequency == 0
        # divided by the correction in the operator: only in a step that refreshes
        divisor = correction if isinstance(correction, torch.Tensor) else None  # else 1
        refresh_roots_(
            statistics,
            new,
            refreshing,
            divisor,
            2 * len(statistics),
            root_method,
            matrix_dtype,
            newton_iterations,
            constants,
        )
        return new

    def accumulate(statistic: torch.Tensor, g: torch.Tensor, d: int) -> torch.Tensor:
        """``L_d`` with this step's ``G_(d) G_(d)^T`` (module docstring), per batch element."""
        rows = g.movedim(d + 1, 1).reshape(g.shape[0], g.shape[d + 1], -1)
        beta = number_now(b2)
        if beta is None:  # a b2 held as a tensor, read as data (traced, or on a GPU): 1 sums
            held = torch.as_tensor(b2)
            return statistic * held + (rows @ rows.mT) * torch.where(held == 1, 1.0, 1 - held)
        if beta == 1.0:
            return torch.baddbmm(statistic, rows, rows.mT)
        return torch.baddbmm(statistic, rows, rows.mT, beta=beta, alpha=1 - beta)

    def statistics_correction(t: Any, like: torch.Tensor) -> Any:
        """The statistics' bias correction ``1 - b2^t`` at count ``t`` (:func:`one_minus_power`);
        1 without ``use_bias_correction`` and where ``b2 = 1`` (the statistics are sums)."""
        if not use_bias_correction:
            return 1.0
        if is_number(b2):
            return one_minus_power(b2, t, like) if b2 < 1 else 1.0
        return torch.where(b2 < 1, one_minus_power(b2, t, like), 1.0)  # held: read as data

    def graft_direction(m_hat: torch.Tensor, v: Optional[torch.Tensor], t: Any) -> torch.Tensor:
        """The grafted method's direction ``A`` (module docstring)."""
        if v is None:
            return m_hat
        if grafting == "adam":
            return m_hat / ((v / one_minus_power(grafting_beta2, t, v)).sqrt() + grafting_epsilon)
        return m_hat / (v.sqrt() + grafting_epsilon)

    # a code object per instance: dynamo's compiled graphs of one do not count against another's
    # recompile limit (each configuration, its closure's numbers, would otherwise recompile it)
    return GradientTransformation(init, own_code(update))


def _block_batches(grads: list, present: list, steps: Optional[dict], block_shapes: Callable) -> list:
    """``(members, t)``: the blocks ``(tensor index, block index)`` that step together (one
    shape, dtype, device and step ``t``; traced, ``steps`` is ``None`` and so is each ``t``: one
    shape, dtype and device), in a fixed order (each batch's state rows stay the rows of one
    tensor between steps)."""
    batches: dict[tuple, list[tuple[int, int]]] = {}
    for i in present:
        g = grads[i]
        for k, shape in enumerate(block_shapes(tuple(g.shape))):
            batches.setdefault((shape, g.dtype, g.device, None if steps is None else steps[i]), []).append((i, k))
    return [(members, key[3]) for key, members in batches.items()]


def stacked(values: list, shape: tuple, kept: bool) -> Any:
    """One state field of a batch's blocks (``values``, one per block), stacked
    (:func:`~functional_bagua.transforms.batched_matrices.restack`): a tensor for ``M`` and
    ``V`` (``None`` where the options keep none), a list per dimension for the statistics and
    roots (tuples per block)."""
    if not kept:
        return None
    if isinstance(values[0], tuple):
        return [restack([v[d] for v in values], (n, n)) for d, n in enumerate(shape)]
    return restack(values, shape)


def unstacked(new: Any, old: Any, row: int) -> Any:
    """One block's row of a field a step returned (``new``: a tensor, a list per dimension, or
    ``None``, where the block keeps ``old``, its placeholder)."""
    if new is None:
        return old
    if isinstance(new, list):
        return tuple(m[row] for m in new)
    return new[row]


def assembled(blocks: list, shape: tuple, pieces: list, batch: Optional[int] = None) -> torch.Tensor:
    """A tensor of ``shape`` (a batch of them, ``(batch, *shape)``) from its blocks' values,
    block ``k`` at ``pieces[k]`` (a view where it is one block)."""
    lead = () if batch is None else (batch,)
    if len(blocks) == 1:
        return blocks[0].reshape(*lead, *shape)
    out = blocks[0].new_empty(*lead, *shape)
    for piece, block in zip(pieces, blocks):
        out[(slice(None),) * len(lead) + piece] = block
    return out


def _block(t: torch.Tensor, k: int, view_of: Callable, cut: Callable) -> torch.Tensor:
    """Block ``k`` of ``t`` (viewed as the transform views tensors of its shape)."""
    shape = tuple(t.shape)
    return t.reshape(view_of(shape))[cut(shape)[k]]


def inverse_roots(
    statistic: torch.Tensor, root: int, method: str, matrix_dtype: torch.dtype, iterations: int, constants: Any
) -> torch.Tensor:
    """``(L + epsilon I)^(-1/root)`` per batch element by ``method`` (``"eigh"``:
    :func:`inverse_root`; ``"newton"``: :func:`inverse_root_newton`); ``constants``: epsilon and
    the Newton tolerance (numbers, or a tensor of the two: :func:`float_operands`)."""
    epsilon, tolerance = constants[0], constants[1]
    if method == "newton":
        return inverse_root_newton(statistic, epsilon, root, matrix_dtype, iterations, tolerance)
    return inverse_root(statistic, epsilon, root, matrix_dtype)


# a CUDA graph cannot hold it: it reads its rows (and Newton's convergence) back to the host
@torch.library.custom_op(
    "functional_bagua::shampoo_refresh_roots_", mutates_args=("roots",), tags=(torch.Tag.cudagraph_unsafe,)
)
def refresh_roots_(
    statistics: list[torch.Tensor],
    roots: list[torch.Tensor],
    rows: torch.Tensor,
    correction: Optional[torch.Tensor],
    root: int,
    method: str,
    matrix_dtype: torch.dtype,
    iterations: int,
    constants: torch.Tensor,
) -> None:
    """The refresh of a compiled step, in place, for one batch of same-shape blocks: where
    ``rows``, each root (one per dimension) becomes ``(L + epsilon I)^(-1/root)`` of its
    statistic divided by ``correction`` (the bias correction per row; ``None``: none) by
    ``method`` (:func:`inverse_roots`; ``constants``: epsilon and the Newton tolerance); the
    other rows keep theirs.

    An operator of its own (``functional_bagua::shampoo_refresh_roots_``), so that a compiled
    step calls it rather than compiling it: inductor would generate code for both sides of a
    ``torch.cond`` (with Newton's iteration, every one of its steps, unrolled), and a refresh
    runs one step in ``precondition_frequency``. Run here, Newton's iteration stops once every
    matrix has converged (a device sync per step), as eagerly. It reads ``rows`` (on a GPU, one
    wait for them) and does nothing else in a step without a refresh.
    """
    any_row, every_row = torch.stack([rows.any(), rows.all()]).tolist()  # one read
    if not any_row:
        return
    for statistic, old in zip(statistics, roots):
        scaled = statistic if correction is None else statistic / correction
        new = inverse_roots(scaled, root, method, matrix_dtype, iterations, constants)
        old.copy_(new if every_row else torch.where(per_row(rows, old), new, old))


@refresh_roots_.register_fake
def _refresh_roots_shapes(*args: Any) -> None:
    return None


def inverse_root(statistic: torch.Tensor, epsilon: Any, root: int, matrix_dtype: torch.dtype) -> torch.Tensor:
    """``(L + epsilon I)^(-1/root)`` per batch element, from ``eigh`` in ``matrix_dtype``
    (``(max(lambda, 0) + epsilon)^(-1/root)`` on each eigenvalue), in ``matrix_dtype``.

    Args:
        statistic: a batch of symmetric positive semi-definite matrices.
        epsilon: added to each eigenvalue.
        root: the root (``2k`` for a tensor of ``k`` dimensions).
        matrix_dtype: the precision of the decomposition.
    """
    values, vectors = torch.linalg.eigh(statistic.to(matrix_dtype))
    # a statistic is positive semi-definite: an eigenvalue below 0 is rounding (float32 statistics
    # of less than full rank give some), which epsilon alone would not keep off a negative root
    scaled = vectors * (values.clamp(min=0) + epsilon).pow(-1.0 / root).unsqueeze(-2)
    return scaled @ vectors.mT


def inverse_root_newton(
    statistic: torch.Tensor, epsilon: Any, root: int, matrix_dtype: torch.dtype, iterations: int, tolerance: Any
) -> torch.Tensor:
    """``(L + epsilon I)^(-1/root)`` for each matrix of a batch ``(B, n, n)`` by the coupled Newton
    iteration (Guo and Higham, 2006; the distributed-Shampoo reference's ``CoupledNewtonConfig``),
    matmuls only::

        A = L + epsilon I,   z = (root + 1) / (2 ||A||_F),   X_0 = z^(1/root) I,   M_0 = z A
        T_k = ((root + 1) I - M_k) / root,   X_(k+1) = X_k T_k,   M_(k+1) = T_k^root M_k

    ``X_k -> A^(-1/root)`` as ``M_k -> I``; each matrix stops where ``max |M_k - I| <= tolerance``.
    One that has not after ``iterations`` steps (a statistic too far from full rank for
    ``epsilon``, or one that is not finite) takes :func:`inverse_root`'s, from ``eigh`` (for
    those matrices only). The result is symmetrized, as the root of a symmetric matrix is. A
    ``tolerance`` below what ``matrix_dtype`` resolves (or float32 products in TF32) leaves every
    matrix to ``eigh`` after ``iterations`` wasted steps; unlike :func:`inverse_root`, negative
    eigenvalues of ``L`` (rounding) are not clamped to 0 first. Each step reads whether all have
    converged (a device sync), so it runs eagerly (a compiled step calls it in
    :func:`refresh_roots_`).

    Args:
        statistic: a batch of symmetric positive semi-definite matrices.
        epsilon: added to the diagonal.
        root: the root (``2k`` for a tensor of ``k`` dimensions).
        matrix_dtype: the precision of the iteration.
        iterations: the most steps.
        tolerance: the largest ``|M_k - I|`` entry of a converged matrix.

    Example::

        roots = inverse_root_newton(statistics, 1e-12, 4, torch.float32, 20, 1e-6)
    """
    if statistic.is_meta:  # shapes only (owner_computes): no data to iterate on
        return torch.empty(statistic.shape, dtype=matrix_dtype, device="meta")
    eye = torch.eye(statistic.shape[-1], dtype=matrix_dtype, device=statistic.device)
    a = statistic.to(matrix_dtype) + epsilon * eye
    z = (root + 1) / (2 * torch.linalg.matrix_norm(a))
    x = z.pow(1.0 / root)[:, None, None] * eye
    m = z[:, None, None] * a
    converged = (m - eye).abs().amax(dim=(-2, -1)) <= tolerance
    for _ in range(iterations):
        if bool(converged.all()):
            break
        t = ((root + 1) * eye - m) / root
        stay = converged[:, None, None]
        x = torch.where(stay, x, x @ t)
        m = torch.where(stay, m, torch.linalg.matrix_power(t, root) @ m)
        converged = (m - eye).abs().amax(dim=(-2, -1)) <= tolerance
    x = (x + x.mT) / 2
    if bool(converged.all()):
        return x
    left = (~converged).nonzero().squeeze(-1)
    return x.index_copy(0, left, inverse_root(statistic.index_select(0, left), epsilon, root, matrix_dtype))


def precondition(m: torch.Tensor, roots: list) -> torch.Tensor:
    """``M x_1 R_1 ... x_k R_k`` for a batch ``m`` of shape ``(B, d_1, ..., d_k)`` (the roots are
    symmetric: ``R_1 M R_2`` for matrices)."""
    if len(roots) == 2:
        return roots[0] @ m @ roots[1]
    batch = m.shape[0]
    for r in roots:
        m = m.movedim(1, -1)
        shape = m.shape
        m = torch.matmul(m.reshape(batch, -1, shape[-1]), r).reshape(shape)
    return m


def _check_leaf(
    g: torch.Tensor,
    leaf: list,
    block_shapes: list,
    moments: tuple,
    matrix_dtype: torch.dtype,
    x: LeafLists,
    i: int,
) -> None:
    """Raise a ValueError unless one tensor's state (``leaf``: one value per field) is what
    ``init`` makes for ``g``'s shape with these options (``block_shapes``: its blocks' shapes;
    ``moments``: whether ``M`` and ``V`` are kept, else empty placeholders; ``matrix_dtype``:
    the roots' dtype)."""
    _, mu, graft, statistics, roots = leaf
    expected = tuple(tuple((n, n) for n in shape) for shape in block_shapes)
    got = None
    if isinstance(statistics, tuple) and all(isinstance(b, tuple) for b in statistics):
        got = tuple(tuple(tuple(m.shape) for m in block) for block in statistics)
    name = tree.leaf_name(x.spec, i)
    if got != expected:
        raise ValueError(
            f"{NAME}: the state of {name!r} (statistics {got}) was made for another parameter or other options: a "
            f"parameter of shape {tuple(g.shape)} with these options (max_preconditioner_dim, merge_dims) has "
            f"{expected}; make the state with this transform, tx.init(params)"
        )
    root_dtypes = {m.dtype for block in roots for m in block} if isinstance(roots, tuple) else set()
    if root_dtypes - {matrix_dtype}:
        raise ValueError(
            f"{NAME}: the roots of {name!r} are {sorted(map(str, root_dtypes))}, made with another matrix_dtype than "
            f"this transform's {matrix_dtype}; make the state with this transform, tx.init(params)"
        )
    for held, kept, moment in zip((mu, graft), moments, ("mu", "graft")):
        shapes = [tuple(m.shape) for m in held] if isinstance(held, tuple) else None
        wanted = [tuple(b) if kept else (0,) for b in block_shapes]
        if shapes != wanted:
            raise ValueError(
                f"{NAME}: the state's {moment!r} of {name!r} does not fit these options (b1, grafting, "
                f"max_preconditioner_dim, merge_dims): blocks of shapes {shapes}, expected {wanted}; make the state "
                "with this transform, tx.init(params)"
            )


def _check_root_method(root_method: str, newton_iterations: int, newton_tolerance: float) -> None:
    if root_method not in ROOT_METHODS:
        raise ValueError(f"{NAME}: root_method must be one of {ROOT_METHODS}, got {root_method!r}")
    if isinstance(newton_iterations, bool) or not isinstance(newton_iterations, int) or newton_iterations < 1:
        raise ValueError(f"{NAME}: newton_iterations must be an int >= 1, got {newton_iterations!r}")
    check_number(NAME, "newton_tolerance", newton_tolerance, lambda v: 0.0 < v < math.inf, "> 0")


def _check_arguments(
    b1: float,
    b2: float,
    epsilon: float,
    max_preconditioner_dim: int,
    precondition_frequency: int,
    start: int,
    grafting: Optional[str],
    grafting_beta2: float,
    matrix_dtype: torch.dtype,
) -> None:
    check_number(NAME, "b1", b1, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    check_number(NAME, "b2", b2, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
    check_number(NAME, "grafting_beta2", grafting_beta2, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    check_number(NAME, "epsilon", epsilon, lambda v: 0.0 < v < math.inf, "> 0 (it keeps the inverse roots finite)")
    for name, count in (
        ("max_preconditioner_dim", max_preconditioner_dim),
        ("precondition_frequency", precondition_frequency),
        ("start_preconditioning_step", start),
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{NAME}: {name} must be an int >= 1, got {count!r}")
    if start < precondition_frequency:
        raise ValueError(
            f"{NAME}: start_preconditioning_step={start} comes before the first inverse roots, computed at step "
            f"precondition_frequency={precondition_frequency}; start at or after it"
        )
    if grafting not in GRAFTINGS:
        raise ValueError(f"{NAME}: grafting must be one of {GRAFTINGS}, got {grafting!r}")
    if matrix_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{NAME}: matrix_dtype must be torch.float32 or torch.float64 (eigh), got {matrix_dtype!r}")
