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
semi-definite, so a negative eigenvalue is rounding) in ``matrix_dtype``. Blocks of one shape
are batched: one ``eigh`` and one batched matmul per shape, whatever the number of tensors.
Each tensor counts its own gradients, as torch.optim's ``state["step"]``. The statistics and
the statistics, moments and filtered gradient in float32 at least (bfloat16 and float16
parameters too; the direction is cast back), as the reference's factor matrices, and the roots and the preconditioning in ``matrix_dtype``: where a statistic
is of less than full rank its root has entries near ``epsilon^(-1/(2k))`` that cancel only in
that precision. An empty tensor gets a zero update.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from functional_bagua import layout_context, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.checks import check_param
from functional_bagua.leaf_lists import LeafLists
from functional_bagua.numerics import read_counts, zero_count
from functional_bagua.transforms.batched_matrices import (
    at_least_float32,
    check_eager_update,
    merge_small_dims,
    own_storage,
    owner_computes,
    restack,
)
from functional_bagua.tree import PyTree

NAME = "scale_by_shampoo"
WHY_NOT_FUSED = "its preconditioners act on whole tensors, which it cannot find in a flat buffer yet (fb.soap can)"
GRAFTINGS = (None, "sgd", "adagrad", "rmsprop", "adam")
SECOND_MOMENTS = ("adagrad", "rmsprop", "adam")  # the grafting methods that keep V
NORM_FLOOR = 1e-16  # added to the Shampoo direction's norm before grafting, as the reference


class ScaleByShampooState(NamedTuple):
    """Per tensor: ``count`` (its gradients so far), and per block (in :func:`blocks_of` order):
    ``mu`` (``M``, the filtered gradient; an empty tensor for ``b1 = 0``), ``graft`` (``V``, the
    grafting method's second moments; empty without), and tuples of the statistics ``L_i``
    (``statistics``) and of their inverse roots ``R_i`` (``roots``), one per dimension."""

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
            reference); ``None``: all here.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByShampooState`.

    Example::

        tx = fb.chain(fb.scale_by_shampoo(grafting="adam"), fb.scale_by_learning_rate(1e-2))
    """
    start = precondition_frequency if start_preconditioning_step is None else start_preconditioning_step
    _check_arguments(
        b1, b2, epsilon, max_preconditioner_dim, precondition_frequency, start, grafting, grafting_beta2, matrix_dtype
    )

    @functools.lru_cache(maxsize=None)
    def view_of(shape: tuple) -> tuple:
        view = merge_small_dims(shape, max_preconditioner_dim) if merge_dims and len(shape) > 1 else shape
        return view if len(view) else (1,)

    @functools.lru_cache(maxsize=None)
    def cut(shape: tuple) -> list[tuple]:
        return blocks_of(view_of(shape), max_preconditioner_dim)

    @functools.lru_cache(maxsize=None)
    def block_shapes(shape: tuple) -> list[tuple]:
        return [tuple(len(range(*piece.indices(n))) for piece, n in zip(s, view_of(shape))) for s in cut(shape)]

    def init_leaf(p: torch.Tensor) -> tuple:
        view = p.reshape(view_of(tuple(p.shape)))
        blocks = [view[s] for s in cut(tuple(p.shape))]
        matrix = at_least_float32(p.dtype)  # low-precision roots would not cancel: float32 at least
        statistics = tuple(tuple(p.new_zeros(n, n, dtype=matrix) for n in b.shape) for b in blocks)
        roots = tuple(tuple(torch.zeros_like(m, dtype=matrix_dtype) for m in block) for block in statistics)
        mu = tuple(torch.zeros_like(b, dtype=matrix) if b1 > 0 else p.new_zeros(0) for b in blocks)
        graft = tuple(
            torch.zeros_like(b, dtype=matrix) if grafting in SECOND_MOMENTS else p.new_zeros(0) for b in blocks
        )
        return zero_count(p), mu, graft, statistics, roots

    def init(params: PyTree) -> ScaleByShampooState:
        layout_context.refuse_inside_fuse(NAME, WHY_NOT_FUSED)
        leaves, spec = tree.flatten(params)
        for i, p in enumerate(leaves):
            if p is not None:
                check_param(p, functools.partial(tree.leaf_name, spec, i), NAME, complex_ok=False)
        per_leaf = [init_leaf(p) if p is not None else (None,) * 5 for p in leaves]
        return ScaleByShampooState(*(spec.unflatten([s[f] for s in per_leaf]) for f in range(5)))

    def update(grads: PyTree, state: ScaleByShampooState, params: Optional[PyTree] = None) -> tuple:
        layout_context.refuse_inside_fuse(NAME, WHY_NOT_FUSED)
        check_eager_update(
            NAME,
            state,
            ScaleByShampooState,
            "it batches blocks by their step counts and recomputes its roots every precondition_frequency steps",
        )
        x = LeafLists.of(grads, params, who=NAME, complex_ok=False, grouped=False)
        fields = [
            tree.leaves_up_to(x.spec, field, f"the state's {name!r}", "the gradients")
            for name, field in zip(ScaleByShampooState._fields, state)
        ]
        present = [i for i, g in enumerate(x.updates) if g is not None and g.numel()]  # an empty one: nothing
        for i in present:
            shapes = block_shapes(tuple(x.updates[i].shape))
            _check_state(x.updates[i], fields[3][i], shapes, x.spec, i)
            moments = [(fields[1][i], b1 > 0, "mu"), (fields[2][i], grafting in SECOND_MOMENTS, "graft")]
            for held, kept, name in moments:
                expected = [shape if kept else (0,) for shape in shapes]
                if not isinstance(held, tuple) or [tuple(m.shape) for m in held] != expected:
                    raise ValueError(
                        f"{NAME}: the state's {name!r} of {tree.leaf_name(x.spec, i)!r} does not fit these options "
                        f"(b1, grafting, max_preconditioner_dim, merge_dims): expected blocks of shapes {expected}; "
                        "make the state with this transform, tx.init(params)"
                    )
        steps = dict(zip(present, (c + 1 for c in read_counts([fields[0][i] for i in present]))))
        stepped = set(present)
        # a tensor that does not step keeps its state, in storage of its own (not a row of an old batch)
        new_fields = [
            [leaf if i in stepped else own_storage(leaf) for i, leaf in enumerate(column)] for column in fields
        ]
        per_block: dict[int, list] = {i: [None] * len(cut(tuple(x.updates[i].shape))) for i in present}
        for members, t in _block_batches(x.updates, present, steps, block_shapes):
            state_rows = [[fields[f][i][k] for i, k in members] for f in (1, 2, 3, 4)]
            grads_b = torch.stack([_block(x.updates[i], k, view_of, cut) for i, k in members])
            p_b, new_rows = step(grads_b, state_rows, t)
            for row, (i, k) in enumerate(members):
                per_block[i][k] = (p_b[row], *(column[row] for column in new_rows))
        updates: list = [None if g is None else torch.zeros_like(g) for g in x.updates]
        for i in present:
            g = x.updates[i]
            blocks = per_block[i]
            updates[i] = _assembled([b[0] for b in blocks], g, view_of, cut)
            new_fields[0][i] = fields[0][i] + 1
            for f in range(1, 5):
                new_fields[f][i] = tuple(b[f] for b in blocks)
        return x.unflatten(updates), ScaleByShampooState(*(x.unflatten(column) for column in new_fields))

    def step(g: torch.Tensor, state_rows: list, t: int) -> tuple[torch.Tensor, list]:
        """One step of a batch of same-shape blocks at step ``t`` (module docstring): the
        direction, and per state field (``M``, ``V``, statistics, roots) the new rows."""
        mus, grafts, statistics, roots = state_rows
        shape = tuple(g.shape[1:])
        out_dtype, g = g.dtype, g.to(at_least_float32(g.dtype))  # the moments too: float32 at least
        m = torch.lerp(restack(mus, shape), g, 1 - b1) if b1 > 0 else None
        m_hat = g if m is None else (m / (1 - b1**t) if use_bias_correction else m)
        v = None
        if grafting == "adagrad":
            v = torch.addcmul(restack(grafts, shape), g, g)
        elif grafting in ("rmsprop", "adam"):
            v = torch.lerp(restack(grafts, shape), g.square(), 1 - grafting_beta2)
        stats = [accumulate(restack([s[d] for s in statistics], (n, n)), g, d) for d, n in enumerate(shape)]
        if t % precondition_frequency == 0:
            correction = 1 - b2**t if use_bias_correction and b2 < 1 else 1.0
            root = 2 * len(shape)
            new_roots = [
                owner_computes(lambda m: inverse_root(m, epsilon, root, matrix_dtype), stat / correction, group)
                for stat in stats
            ]
        else:
            new_roots = [restack([r[d] for r in roots], (n, n)) for d, n in enumerate(shape)]
        grafted = graft_direction(m_hat, v, t)
        if t < start:
            direction = grafted
        else:
            # in the roots' precision: their large entries (epsilon^(-1/2k) where a statistic
            # is of less than full rank) cancel only there
            direction = precondition(m_hat.to(matrix_dtype), new_roots).to(g.dtype)
            if grafting is not None:
                dims = tuple(range(1, direction.dim()))
                grafted_norm = grafted.square().sum(dims, keepdim=True).sqrt()
                direction = direction * (
                    grafted_norm / (direction.square().sum(dims, keepdim=True).sqrt() + NORM_FLOOR)
                )
        rows = len(g)
        new_rows = [
            m.unbind() if m is not None else list(mus),  # b1 = 0, no grafting moments: placeholders kept
            v.unbind() if v is not None else list(grafts),
            list(zip(*(s.unbind() for s in stats))) if stats else [()] * rows,
            list(zip(*(r.unbind() for r in new_roots))) if new_roots else [()] * rows,
        ]
        return direction.to(out_dtype), new_rows

    def accumulate(statistic: torch.Tensor, g: torch.Tensor, d: int) -> torch.Tensor:
        """``L_d`` with this step's ``G_(d) G_(d)^T`` (module docstring), per batch element."""
        rows = g.movedim(d + 1, 1).reshape(g.shape[0], g.shape[d + 1], -1)
        if b2 == 1.0:
            return torch.baddbmm(statistic, rows, rows.mT)
        return torch.baddbmm(statistic, rows, rows.mT, beta=b2, alpha=1 - b2)

    def graft_direction(m_hat: torch.Tensor, v: Optional[torch.Tensor], t: int) -> torch.Tensor:
        """The grafted method's direction ``A`` (module docstring)."""
        if v is None:
            return m_hat
        if grafting == "adam":
            return m_hat / ((v / (1 - grafting_beta2**t)).sqrt() + grafting_epsilon)
        return m_hat / (v.sqrt() + grafting_epsilon)

    return GradientTransformation(init, update)


def _block_batches(grads: list, present: list, steps: dict, block_shapes: Callable) -> list:
    """``(members, t)``: the blocks ``(tensor index, block index)`` that step together (one
    shape, dtype, device and step ``t``), in a fixed order (each batch's state rows stay the
    rows of one tensor between steps)."""
    batches: dict[tuple, list[tuple[int, int]]] = {}
    for i in present:
        g = grads[i]
        for k, shape in enumerate(block_shapes(tuple(g.shape))):
            batches.setdefault((shape, g.dtype, g.device, steps[i]), []).append((i, k))
    return [(members, key[3]) for key, members in batches.items()]


def _assembled(blocks: list, g: torch.Tensor, view_of: Callable, cut: Callable) -> torch.Tensor:
    """A tensor of ``g``'s shape from its blocks' values (a view where it is one block)."""
    if len(blocks) == 1:
        return blocks[0].reshape(g.shape)
    out = torch.empty(view_of(tuple(g.shape)), dtype=blocks[0].dtype, device=g.device)
    for s, block in zip(cut(tuple(g.shape)), blocks):
        out[s] = block
    return out.reshape(g.shape)


def _block(t: torch.Tensor, k: int, view_of: Callable, cut: Callable) -> torch.Tensor:
    """Block ``k`` of ``t`` (viewed as the transform views tensors of its shape)."""
    shape = tuple(t.shape)
    return t.reshape(view_of(shape))[cut(shape)[k]]


def inverse_root(statistic: torch.Tensor, epsilon: float, root: int, matrix_dtype: torch.dtype) -> torch.Tensor:
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


def _check_state(g: torch.Tensor, statistics: object, block_shapes: list, spec: object, i: int) -> None:
    """Raise a ValueError unless a tensor's statistics are what ``init`` makes for ``g``'s shape
    (``block_shapes``: its blocks' shapes)."""
    expected = tuple(tuple((n, n) for n in shape) for shape in block_shapes)
    got = None
    if isinstance(statistics, tuple) and all(isinstance(b, tuple) for b in statistics):
        got = tuple(tuple(tuple(m.shape) for m in block) for block in statistics)
    if got != expected:
        raise ValueError(
            f"{NAME}: the state of {tree.leaf_name(spec, i)!r} (statistics {got}) was made for another parameter "  # type: ignore[arg-type]
            f"or other options: a parameter of shape {tuple(g.shape)} with these options (max_preconditioner_dim, "
            f"merge_dims) has {expected}; make the state with this transform, tx.init(params)"
        )


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
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"{NAME}: b1 must be in [0, 1), got {b1}")
    if not 0.0 < b2 <= 1.0:
        raise ValueError(f"{NAME}: b2 must be in (0, 1], got {b2}")
    if not 0.0 <= grafting_beta2 < 1.0:
        raise ValueError(f"{NAME}: grafting_beta2 must be in [0, 1), got {grafting_beta2}")
    if not epsilon > 0.0 or not math.isfinite(epsilon):
        raise ValueError(f"{NAME}: epsilon must be > 0 (it keeps the inverse roots finite), got {epsilon}")
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
