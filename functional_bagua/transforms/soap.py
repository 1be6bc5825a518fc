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

as the authors' algorithm and pytorch-optimizer's ``SOAP``. The matrix work of tensors of one
shape is batched: one ``eigh``, one QR and one batched matmul per shape, whatever the number of
tensors. Each tensor counts its own gradients (as torch.optim's ``state["step"]``), so a tensor
whose first gradient comes late initializes its preconditioner then.

``matrix_dtype`` is the precision of the eigendecompositions and QRs: ``None`` (the reference's)
takes ``eigh`` in the statistics' dtype (at least float32) and the QR in float32; a dtype takes
both in it (``torch.float64`` for the most exact eigenbases). The statistics keep the gradient's
dtype, as the reference.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import torch

from functional_bagua import tree
from functional_bagua.base import GradientTransformation
from functional_bagua.checks import check_param
from functional_bagua.leaf_lists import LeafLists
from functional_bagua.numerics import zero_count
from functional_bagua.tree import PyTree

NAME = "scale_by_soap"
EIGH_JITTER = 1e-30  # added to the diagonal before eigh, as the reference
NO_MATRIX = (0,)  # the shape of the placeholder of a dimension without a preconditioner


class ScaleBySoapState(NamedTuple):
    """Per tensor: ``count`` (its gradients so far), ``mu`` (``m``) and ``nu`` (``v``, in the
    eigenbasis), both of the tensor's shape, and per dimension of its preconditioned view the
    statistic ``L_i`` (``statistics``) and eigenbasis ``Q_i`` (``eigenbases``), tuples holding an
    empty tensor for a dimension without a preconditioner."""

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


def merge_small_dims(shape: tuple, max_dim: int) -> tuple:
    """``shape`` with runs of neighbouring dimensions merged while their product stays at most
    ``max_dim`` (the authors' rule: ``(64, 3, 3, 3)`` with 100 gives ``(64, 27)``).

    Args:
        shape: a tensor's shape.
        max_dim: the largest merged dimension.
    """
    merged: list[int] = []
    run = 1
    for size in shape:
        if run * size <= max_dim:
            run *= size
        elif run > 1:
            merged.append(run)
            run = size
        else:
            merged.append(size)
    if run > 1 or not merged:
        merged.append(run)
    return tuple(merged)


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

    Returns:
        A GradientTransformation whose state is a :class:`ScaleBySoapState`.

    Example::

        tx = fb.chain(fb.scale_by_soap(), fb.scale_by_learning_rate(3e-3))
    """
    shampoo = b2 if shampoo_beta is None else shampoo_beta
    _check_arguments(b1, b2, shampoo, eps, precondition_frequency, max_precondition_dim, matrix_dtype)

    def layout(shape: tuple) -> Layout:
        return layout_of(tuple(shape), max_precondition_dim, merge_dims, precondition_1d)

    def init_leaf(p: torch.Tensor) -> tuple:
        view = layout(p.shape)
        matrices = tuple(
            p.new_zeros(d, d) if on else p.new_zeros(NO_MATRIX) for d, on in zip(view.shape, view.preconditioned)
        )
        return zero_count(p), torch.zeros_like(p), torch.zeros_like(p), matrices, tuple(m.clone() for m in matrices)

    def init(params: PyTree) -> ScaleBySoapState:
        leaves, spec = tree.flatten(params)
        for i, p in enumerate(leaves):
            if p is not None:
                check_param(p, functools.partial(tree.leaf_name, spec, i), NAME, complex_ok=False)
        per_leaf = [init_leaf(p) if p is not None else (None,) * 5 for p in leaves]
        return ScaleBySoapState(*(spec.unflatten([s[f] for s in per_leaf]) for f in range(5)))

    def update(grads: PyTree, state: ScaleBySoapState, params: Optional[PyTree] = None) -> tuple:
        if not isinstance(state, ScaleBySoapState):
            raise ValueError(
                f"{NAME}: got a state of type {type(state).__name__}, expected ScaleBySoapState; pass the state "
                "this transform's init made"
            )
        x = LeafLists.of(grads, params, who=NAME, complex_ok=False, grouped=False)
        fields = [
            tree.leaves_up_to(x.spec, field, f"the state's {name!r}", "the gradients")
            for name, field in zip(ScaleBySoapState._fields, state)
        ]
        for i, g in enumerate(x.updates):
            if g is not None:
                _check_state(g, [column[i] for column in fields], layout(g.shape), x.spec, i)
        new_fields = [list(column) for column in fields]
        updates: list = [None] * len(x.updates)
        for members in _batches(x.updates, fields[0], layout):
            view = layout(x.updates[members[0]].shape)
            batch = _Batch.stacked(
                [x.updates[i] for i in members], [[column[i] for i in members] for column in fields], view
            )
            u = step(torch.stack([x.updates[i].reshape(view.shape) for i in members]), batch)
            for row, i in enumerate(members):
                updates[i] = u[row].reshape(x.updates[i].shape)
                for column, value in zip(new_fields, batch.row(row, fields[0][i], fields[3][i], x.updates[i].shape)):
                    column[i] = value
        return x.unflatten(updates), ScaleBySoapState(*(x.unflatten(column) for column in new_fields))

    def step(g: torch.Tensor, s: "_Batch") -> torch.Tensor:
        """One step of a batch of same-layout tensors (module docstring): replaces the fields of
        ``s`` by the new state and returns ``u``."""
        if s.count == 0:
            s.statistics = accumulate(s.statistics, g)
            s.bases = [None if stat is None else eigenbasis(stat, matrix_dtype) for stat in s.statistics]
            return torch.zeros_like(g)
        projected = project(g, s.bases)
        s.mu = torch.lerp(s.mu, g, 1 - b1)
        s.nu = torch.lerp(s.nu, projected.square(), 1 - b2)
        u = project(project(s.mu, s.bases) / (s.nu.sqrt() + eps), s.bases, back=True)
        if normalize_gradient:
            u = u / (u.square().mean(dim=tuple(range(1, u.dim())), keepdim=True).sqrt() + eps)
        if correct_bias:
            u = u * (math.sqrt(1 - b2**s.count) / (1 - b1**s.count))
        s.statistics = accumulate(s.statistics, g)
        if s.count % precondition_frequency == 0:
            for d, (stat, basis) in enumerate(zip(s.statistics, s.bases)):
                if stat is not None:
                    s.bases[d], s.nu = power_iteration(stat, basis, s.nu, d, matrix_dtype)
        return u

    def accumulate(statistics: list, g: torch.Tensor) -> list:
        """Each ``L_d <- lerp(L_d, G_(d) G_(d)^T, 1 - shampoo_beta)`` (``None``: no preconditioner)."""
        return [
            None if stat is None else torch.lerp(stat, gram(g, d), 1 - shampoo) for d, stat in enumerate(statistics)
        ]

    return GradientTransformation(init, update)


class _Batch:
    """The state of one batch of same-layout tensors during a step, stacked along a new dim 0
    (``None`` for a dimension without a preconditioner)."""

    def __init__(self, count: int, mu: torch.Tensor, nu: torch.Tensor, statistics: list, bases: list) -> None:
        self.count, self.mu, self.nu, self.statistics, self.bases = count, mu, nu, statistics, bases

    @classmethod
    def stacked(cls, grads: list, fields: list, view: Layout) -> "_Batch":
        """The batch of the tensors with gradients ``grads`` and state ``fields`` (one list per
        field of :class:`ScaleBySoapState`, one entry per tensor)."""
        counts, mus, nus, statistics, bases = fields

        def matrices(per_tensor: list) -> list:
            return [torch.stack([m[d] for m in per_tensor]) if on else None for d, on in enumerate(view.preconditioned)]

        return cls(
            count=int(counts[0]),
            mu=torch.stack([m.reshape(view.shape) for m in mus]),
            nu=torch.stack([v.reshape(view.shape) for v in nus]),
            statistics=matrices(statistics),
            bases=matrices(bases),
        )

    def row(self, row: int, count: torch.Tensor, placeholders: tuple, shape: torch.Size) -> tuple:
        """The new state of the batch's ``row``-th tensor, one value per field, from its old
        ``count``; ``placeholders`` (its old statistics) stand for the dimensions without a
        preconditioner."""
        return (
            count + 1,
            self.mu[row].reshape(shape),
            self.nu[row].reshape(shape),
            tuple(placeholders[d] if m is None else m[row] for d, m in enumerate(self.statistics)),
            tuple(placeholders[d] if m is None else m[row] for d, m in enumerate(self.bases)),
        )


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


def _batches(grads: list, counts: list, layout: Callable[[tuple], Layout]) -> list[list[int]]:
    """The indices of the gradients that step together: one layout, dtype, device and count."""
    batches: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        if g is not None:
            batches.setdefault((layout(g.shape), g.dtype, g.device, int(counts[i])), []).append(i)
    return list(batches.values())


def project(x: torch.Tensor, bases: list, back: bool = False) -> torch.Tensor:
    """``x x_1 Q_1 ... x_k Q_k`` for a batch ``x`` of shape ``(B, d_1, ..., d_k)`` (with ``Q_i^T``
    when ``back``); a ``None`` basis is the identity. Each product contracts the leading
    dimension and appends the new one last, so after all ``k`` the dimensions are in order."""
    batch = x.shape[0]
    for q in bases:
        x = x.movedim(1, -1)
        if q is not None:
            shape = x.shape
            x = torch.matmul(x.reshape(batch, -1, shape[-1]), q.mT if back else q).reshape(shape)
    return x


def gram(g: torch.Tensor, d: int) -> torch.Tensor:
    """``G_(d) G_(d)^T`` per batch element: ``g`` contracted with itself over every dimension but ``d``."""
    rows = g.movedim(d + 1, 1).reshape(g.shape[0], g.shape[d + 1], -1)
    return batched_matmul(rows, rows.mT)


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` per batch element (:func:`per_element`)."""
    return per_element(torch.matmul, a, b)


def per_element(fn: Callable[..., torch.Tensor], *batches: torch.Tensor) -> torch.Tensor:
    """``fn`` on a batch: at once on a GPU; on the CPU once per element, stacked. torch's CPU
    batched matmul, ``eigh`` and QR loop over the batch anyway, and round small products and
    some decompositions otherwise than on a single matrix. The eigenvectors of a statistic of
    less than full rank (one gradient of a non-square matrix) change with any rounding
    difference, so the CPU path rounds as the unbatched reference does."""
    if batches[0].device.type != "cpu":
        return fn(*batches)
    return torch.stack([fn(*elements) for elements in zip(*batches)])


def eigenbasis(statistic: torch.Tensor, matrix_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The eigenvectors of each symmetric ``statistic`` by decreasing eigenvalue, in
    ``statistic``'s dtype (computed in ``matrix_dtype``, or at least float32)."""
    dtype = matrix_dtype or _at_least_float32(statistic.dtype)
    jitter = EIGH_JITTER * torch.eye(statistic.shape[-1], dtype=dtype, device=statistic.device)
    vectors = per_element(lambda m: torch.linalg.eigh(m + jitter).eigenvectors, statistic.to(dtype))
    return vectors.flip(-1).to(statistic.dtype)


def power_iteration(
    statistic: torch.Tensor, basis: torch.Tensor, nu: torch.Tensor, d: int, matrix_dtype: Optional[torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration of the eigenbasis of dimension ``d`` (module docstring): the new
    basis, and ``nu`` with its entries along dimension ``d`` in the new basis's order."""
    product = batched_matmul(statistic, basis)
    estimates = (basis * product).sum(dim=-2)
    order = torch.argsort(estimates, dim=-1, descending=True)
    product = product.gather(-1, order.unsqueeze(-2).expand_as(product))
    index = order.view(order.shape[0], *([1] * d), -1, *([1] * (nu.dim() - d - 2))).expand_as(nu)
    nu = nu.gather(d + 1, index)
    q = per_element(lambda m: torch.linalg.qr(m).Q, product.to(matrix_dtype or torch.float32))
    return q.to(basis.dtype), nu


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


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
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{NAME}: {name} must be in [0, 1), got {value}")
    if not eps >= 0.0:
        raise ValueError(f"{NAME}: eps must be >= 0, got {eps}")
    for name, count in (
        ("precondition_frequency", precondition_frequency),
        ("max_precondition_dim", max_precondition_dim),
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{NAME}: {name} must be an int >= 1, got {count!r}")
    if matrix_dtype is not None and not (isinstance(matrix_dtype, torch.dtype) and matrix_dtype.is_floating_point):
        raise ValueError(f"{NAME}: matrix_dtype must be None or a floating-point torch.dtype, got {matrix_dtype!r}")
