"""PSGD-Kron (Li, 2018 and 2024): preconditioned SGD with a Kronecker-factored preconditioner
``P = Q^T Q`` fitted online, as the ``kron-torch`` package (Evan Walters' ``Kron``) computes it.

Per tensor (one with more than two dimensions viewed as a matrix with ``merge_dims``, the
reference's choice of its first or last dimension against the rest), each dimension ``i`` has a
factor ``Q_i``: upper triangular (``d x d``), or diagonal (a vector) where the dimension is 1,
above ``max_size_triangular``, the tensor has fewer than ``min_ndim_triangular`` dimensions, or
``memory_save_mode`` says so. With ``X x_i M`` the product of ``X`` with ``M`` along dimension
``i`` (elementwise for a vector ``M``), ``X_(i) X_(i)^T`` the Gram matrix of ``X`` along ``i``
(its diagonal for a diagonal factor), and ``t`` this tensor's gradients so far::

    m <- b1 m + (1 - b1) g;       G = m / (1 - b1^t)                       (in precond_dtype)
    when the preconditioner updates (every step while the update probability is 1):
        V ~ N(0, I);   G <- G + sqrt(eps_float32) * mean|G| * V            (G itself is perturbed)
        A = G x_1 Q_1 ... x_k Q_k;    B = V x_1 Q_1^-T ... x_k Q_k^-T
        per factor:  T1 = A_(i) A_(i)^T - B_(i) B_(i)^T,   T2 = A_(i) A_(i)^T + B_(i) B_(i)^T
                     triangular:  Q_i <- Q_i - precond_lr * triu(T1) / max(lb(T2), tiny) @ Q_i
                     diagonal:    Q_i <- Q_i - precond_lr * T1 * Q_i / max(max|T2|, tiny)
        (lb: a lower bound of the spectral norm from one power iteration on T2's largest column)
    u = G x_1 Q_1^T Q_1 ... x_k Q_k^T Q_k;   u <- u * min(1, 1.1 / (RMS(u) + 1e-12))

The preconditioner updates with probability ``p(step)``: 1 for ``flat_start`` steps, then
``max(min_prob, exp(-decay (step - flat_start)))``, taken deterministically as the reference
does (an update whenever ``1 / p`` steps have passed since the last). Every ``balance_every``-th
update first rescales the triangular factors to equal infinity norms (their product, the
preconditioner, unchanged); the reference draws that decision with probability 0.01 from a
Python RNG, which a state cannot carry. The probes ``V`` come from torch's global RNG, one draw
per tensor in the parameters' order, as the reference's. Tensors of one shape step as one
batch (batched products and triangular solves), their state kept as the rows of one tensor.

Compiled (``torch.compile``, ``make_train_step``) the schedule is computed from the counters in
the graph, and the fit (with its probe draws) and the balancing run under ``torch.cond``, only
in the steps that take them. The probes come from torch's own ``randn`` through one operator
(:func:`standard_normals`), so a compiled step draws the same numbers as an eager one from the
same seed (inductor's generator would draw others, several times slower on the CPU).
Inside :func:`~functional_bagua.fuse` the state of each flat buffer is kept per group of
equal-shaped tensors, stacked, and the probes are drawn once per buffer (``V`` for the whole
buffer, each tensor's its slice): the same distribution as the unfused draws, other numbers
(the same numbers for a stream whose draws depend only on their order, as a test checks).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from functional_bagua import layout_context, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.compiling import own_code
from functional_bagua.hyperparams import checkable
from functional_bagua.leaf_lists import LeafLists
from functional_bagua.numerics import read_counts, zero_count
from functional_bagua.transforms.batched_matrices import (
    Owners,
    cached_eagerly,
    check_number,
    check_state_type,
    decided_by,
    device_of,
    flat_operand_cond,
    float_operands,
    fused_buffers,
    gather_rows,
    initial_fields,
    one_minus_power,
    own_storage,
    owner_computes_all,
    restack,
    row_index,
    scatter_rows,
)
from functional_bagua.tree import PyTree

NAME = "scale_by_psgd_kron"
MEMORY_SAVE_MODES = (None, "smart_one_diag", "one_diag", "all_diag")
PROBE_SCALE = math.sqrt(torch.finfo(torch.float32).eps)  # the probe's size relative to mean|G|
CLIP_RMS = 1.1


class ScaleByPsgdKronState(NamedTuple):
    """``count``: the transform's steps (one counter, as the reference's, for the update
    schedule); ``updates_skipped``: steps since the preconditioner last updated;
    ``preconditioner_updates``: its updates so far; per tensor ``steps`` (its gradients so far,
    for the momentum's bias correction, as the reference's ``state["step"]``), ``mu`` (the
    momentum ``m``) and ``factors`` (its ``Q_i``, matrices and vectors). Inside
    :func:`~functional_bagua.fuse`, per flat buffer, ``steps``, ``mu`` and ``factors`` are tuples
    over its groups of equal-shaped tensors, each stacked along a leading dimension (``steps``
    of shape ``(B,)``)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    updates_skipped: torch.Tensor
    preconditioner_updates: torch.Tensor
    steps: PyTree
    mu: PyTree
    factors: PyTree


def update_probability(
    step: int, max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001, flat_start: int = 500
) -> float:
    """The reference's schedule: ``max_prob`` for ``flat_start`` steps, then an exponential
    anneal to ``min_prob`` (``step`` counts from 0).

    Args:
        step: the steps before this one.
        max_prob: the probability at the start.
        min_prob: the floor.
        decay: the rate of the anneal.
        flat_start: the steps at ``max_prob``.
    """
    if step <= flat_start:  # (where the exponential would only grow, and may overflow)
        return max_prob
    return min(max_prob, max(min_prob, max_prob * math.exp(-decay * (step - flat_start))))


def merged_shape(shape: tuple) -> tuple:
    """The reference's matrix view of a tensor of more than two dimensions: its first dimension
    against the rest or the rest against its last, whichever is closer to square (by the signed
    difference of the two sides, as the reference compares them)."""
    if len(shape) <= 2:
        return tuple(shape)
    last = (math.prod(shape[:-1]), shape[-1])
    first = (shape[0], math.prod(shape[1:]))
    return last if last[1] - last[0] <= first[1] - first[0] else first


def diagonal_dims(shape: tuple, max_size: int, min_ndim: int, memory_save_mode: Optional[str]) -> list[bool]:
    """Per dimension, whether its factor is diagonal (module docstring)."""
    forced = [False] * len(shape)
    if memory_save_mode == "all_diag":
        forced = [True] * len(shape)
    elif memory_save_mode in ("one_diag", "smart_one_diag") and shape:
        largest = max(range(len(shape)), key=lambda d: (shape[d], d))  # the last of equal sizes, as the reference
        ordered = sorted(shape)
        if memory_save_mode == "one_diag" or (len(shape) > 1 and ordered[-1] > ordered[-2]):
            forced[largest] = True
    return [n == 1 or n > max_size or len(shape) < min_ndim or f for n, f in zip(shape, forced)]


def scale_by_psgd_kron(
    b1: float = 0.9,
    precond_lr: float = 0.1,
    precond_init_scale: float = 1.0,
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: Optional[str] = None,
    momentum_into_precond_update: bool = True,
    merge_dims: bool = True,
    precond_dtype: torch.dtype = torch.float32,
    max_prob: float = 1.0,
    min_prob: float = 0.03,
    decay: float = 0.001,
    flat_start: int = 500,
    balance_every: int = 100,
    group: Any = None,
) -> GradientTransformation:
    """PSGD-Kron's direction ``u`` (module docstring); chain it with a learning rate.

    Args:
        b1: the momentum.
        precond_lr: the preconditioner's step size.
        precond_init_scale: ``Q`` starts as this scale (spread over the factors) times the identity.
        max_size_triangular: dimensions above it get a diagonal factor.
        min_ndim_triangular: tensors with fewer dimensions get diagonal factors only.
        memory_save_mode: ``None``, ``"smart_one_diag"``, ``"one_diag"`` or ``"all_diag"``.
        momentum_into_precond_update: fit the preconditioner to the momentum (else the gradient).
        merge_dims: view tensors of more than two dimensions as matrices.
        precond_dtype: the dtype of the factors and of the preconditioning.
        max_prob: the update probability at the start.
        min_prob: its floor.
        decay: its anneal rate after ``flat_start`` steps.
        flat_start: the steps at ``max_prob``.
        balance_every: rebalance the factors every this many preconditioner updates.
        group: a torch process group whose ranks hold the same gradients (after
            ``allreduce_gradients``): each tensor's factors are fitted by one of its ranks (with
            that rank's probe) and shared, the perturbed momentum with them
            (``batched_matrices.owner_computes``: ranks whose inputs differ are refused, each
            with the same ValueError); eager only (a TypeError under torch.compile); ``None``:
            all here.

    Returns:
        A GradientTransformation whose state is a :class:`ScaleByPsgdKronState`.

    Example::

        tx = fb.chain(fb.scale_by_psgd_kron(), fb.scale_by_learning_rate(3e-4))
    """
    if memory_save_mode not in MEMORY_SAVE_MODES:
        raise ValueError(f"{NAME}: memory_save_mode must be one of {MEMORY_SAVE_MODES}, got {memory_save_mode!r}")
    check_number(NAME, "b1", b1, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    check_number(NAME, "precond_lr", precond_lr, lambda v: v > 0.0, "> 0")
    for name, count in (("max_size_triangular", max_size_triangular), ("balance_every", balance_every)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{NAME}: {name} must be an int >= 1, got {count!r}")
    if precond_dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"{NAME}: precond_dtype must be torch.float32 or torch.float64 (its triangular solves), got {precond_dtype!r}"
        )
    check_number(NAME, "precond_init_scale", precond_init_scale, lambda v: v > 0.0, "> 0")
    if isinstance(min_ndim_triangular, bool) or not isinstance(min_ndim_triangular, int) or min_ndim_triangular < 0:
        raise ValueError(f"{NAME}: min_ndim_triangular must be an int >= 0, got {min_ndim_triangular!r}")
    low, high = checkable(min_prob), checkable(max_prob)  # None: validated already (check_number)
    if low is not None and high is not None and not 0.0 < low <= high <= 1.0:
        raise ValueError(f"{NAME}: need 0 < min_prob <= max_prob <= 1, got {min_prob} and {max_prob}")

    owners = Owners(group, NAME, "fitted factors")  # who computes which rows (group=), per update

    @cached_eagerly
    def view_of(shape: tuple) -> tuple:
        view = merged_shape(shape) if merge_dims else tuple(shape)
        return view if view else (1,)  # a scalar: one dimension of 1, with a diagonal factor

    @cached_eagerly
    def factor_shapes(shape: tuple) -> list[tuple]:
        view = view_of(shape)
        diagonal = diagonal_dims(view, max_size_triangular, min_ndim_triangular, memory_save_mode)
        return [(n,) if diag else (n, n) for n, diag in zip(view, diagonal)]

    def init_factors(p: torch.Tensor, shape: tuple, rows: tuple = ()) -> tuple:
        """The initial factors of a tensor viewed as ``shape`` (``rows``: a batch's leading
        dimensions), in ``p``'s device."""
        scale = precond_init_scale ** (1 / len(shape))
        diagonal = diagonal_dims(shape, max_size_triangular, min_ndim_triangular, memory_save_mode)
        return tuple(
            torch.full((*rows, n), scale, dtype=precond_dtype, device=p.device)
            if diag
            else (scale * torch.eye(n, dtype=precond_dtype, device=p.device)).expand(*rows, n, n).clone()
            for n, diag in zip(shape, diagonal)
        )

    def init(params: PyTree) -> ScaleByPsgdKronState:
        counter = zero_count(params)
        fields = initial_fields(params, NAME, 3, init_leaf, fused_state_of, groups_of)
        return ScaleByPsgdKronState(counter, counter.clone(), counter.clone(), *fields)

    def init_leaf(p: torch.Tensor) -> tuple:
        return zero_count(p), torch.zeros_like(p), init_factors(p, view_of(tuple(p.shape)))

    def groups_of(key: str) -> tuple:
        return layout_context.shape_groups_of(key, NAME)

    def fused_state_of(flat: torch.Tensor, groups: tuple) -> tuple:
        """The initial ``steps``, ``mu`` and ``factors`` of one flat buffer of
        :func:`~functional_bagua.fuse`: each a tuple over the buffer's groups of equal-shaped
        tensors (``groups``: ``(shape, rows)`` each), stacked over the group's ``B`` tensors."""
        steps, mus, factors = [], [], []
        for shape, rows in groups:
            view = view_of(tuple(shape))
            steps.append(torch.zeros(rows.number, dtype=zero_count(flat).dtype, device=flat.device))
            mus.append(flat.new_zeros(rows.number, *view))
            factors.append(init_factors(flat, view, (rows.number,)))
        return tuple(steps), tuple(mus), tuple(factors)

    def update(grads: PyTree, state: ScaleByPsgdKronState, params: Optional[PyTree] = None) -> tuple:
        check_state_type(NAME, state, ScaleByPsgdKronState)
        owners.begin_update()
        x = LeafLists.of(grads, params, who=NAME, complex_ok=False, grouped=False)
        fields = [
            tree.leaves_up_to(x.spec, field, f"the state's {name!r}", "the gradients")
            for name, field in zip(("steps", "mu", "factors"), state[3:])
        ]
        if not torch.compiler.is_compiling():  # with group=: every rank decides alike (else its collectives would wait)
            owners.agree(lambda: decided_by(x.updates, (fields[0], state[:3])), device_of(x.updates, state[:3]))
        fused = layout_context.active_layout() is not None
        batches, probes = fused_batches(x, fields) if fused else tensor_batches(x, fields)
        refit, balance = decisions(state)
        qs = balanced_if(balance, [b.factors for b in batches])
        # traced, a copy of the gradient: inside fuse, the groups' gradients are views of one buffer,
        # and torch.cond takes no operands that alias each other
        traced = torch.compiler.is_compiling()
        fitted = [b.momentum if momentum_into_precond_update else b.g.to(precond_dtype, copy=traced) for b in batches]
        fitted, qs = fitted_if(refit, fitted, qs, probes)
        directions = []
        for b, fitted_b, qs_b in zip(batches, fitted, qs):
            u = precondition(fitted_b if momentum_into_precond_update else b.momentum, qs_b)
            dims = tuple(range(1, u.dim()))
            directions.append(u * (CLIP_RMS / (u.square().mean(dims, keepdim=True).sqrt() + 1e-12)).clamp(max=1.0))
        updates, steps, mus, factors = (fused_written if fused else tensors_written)(x, fields, batches, directions, qs)
        fitted_now = torch.as_tensor(refit, device=state.count.device)  # a bool, or traced a 0-dim tensor
        new_state = ScaleByPsgdKronState(
            count=state.count + 1,
            updates_skipped=torch.where(fitted_now, 0, state.updates_skipped + 1),
            preconditioner_updates=state.preconditioner_updates + fitted_now,
            steps=x.unflatten(steps),
            mu=x.unflatten(mus),
            factors=x.unflatten(factors),
        )
        return x.unflatten(updates), new_state

    def decisions(state: ScaleByPsgdKronState) -> tuple:
        """Whether the preconditioner updates this step, and whether its factors are balanced
        first (module docstring): Python bools eagerly (the counters read at once: one device
        sync), 0-dim bool tensors while traced."""
        if not torch.compiler.is_compiling():
            step, skipped, done = read_counts([state.count, state.updates_skipped, state.preconditioner_updates])
            # a bool also where the probabilities are held as tensors (the factory form's): a
            # tensor here would send the step through torch.cond, which eagerly compiles its branches
            refit = bool(skipped + 1 >= 1 / update_probability(step, max_prob, min_prob, decay, flat_start))
            return refit, refit and done > 0 and done % balance_every == 0
        anneal = torch.exp(-decay * (state.count.to(torch.float64) - flat_start))
        probability = (max_prob * anneal).clamp(min=min_prob).clamp(max=max_prob)
        fits = state.updates_skipped + 1 >= 1 / probability
        updated = state.preconditioner_updates
        return fits, fits & (updated > 0) & (updated % balance_every == 0)

    def tensor_batches(x: LeafLists, fields: list) -> tuple:
        """The batches of the tensors of one view, factor shapes, dtype and device (a
        :class:`_Batch` each), and the function drawing their probes: one per tensor, in the
        parameters' order, as the reference draws them."""
        steps, mus, factors = fields
        present = [i for i, g in enumerate(x.updates) if g is not None and g.numel()]  # an empty one: nothing
        for i in present:
            _check_leaf(
                x.updates[i], mus[i], factors[i], factor_shapes(tuple(x.updates[i].shape)), precond_dtype, x.spec, i
            )
        batches = []
        members_of = _batches(x.updates, present, factors, view_of)
        for members in members_of:
            shape = view_of(tuple(x.updates[members[0]].shape))
            g = torch.stack([x.updates[i].reshape(shape) for i in members])
            counts = torch.stack([steps[i] for i in members]) + 1
            mu = restack([mus[i].reshape(shape) for i in members], shape)
            qs = [
                restack([factors[i][d] for i in members], tuple(factors[members[0]][d].shape))
                for d in range(len(shape))
            ]
            batches.append(batch_of(g, mu, counts, qs, members))

        # Python values only: a tensor the probes' closure reads would enter the traced branch twice
        probe_shapes = {i: (view_of(tuple(x.updates[i].shape)), x.updates[i].device) for i in present}

        def probes() -> list:
            shapes, devices = zip(*probe_shapes.values()) if probe_shapes else ((), ())
            drawn = dict(zip(probe_shapes, draw_probes(list(shapes), precond_dtype, list(devices))))
            return [torch.stack([drawn[i] for i in members]) for members in members_of]

        return batches, probes

    def fused_batches(x: LeafLists, fields: list) -> tuple:
        """The batches of a fused update (inside :func:`~functional_bagua.fuse`): per flat buffer,
        each group of equal-shaped tensors gathered, and the function drawing their probes: one
        draw per buffer, in its order (the tensors' probes one after the other, as the unfused
        update draws them where the buffer holds the tensors in the parameters' order)."""
        batches, where = [], []
        for i, g, groups, buffer_state in fused_buffers(x, fields, NAME, fused_state_of, groups_of):
            for j, (shape, rows) in enumerate(groups):
                view = view_of(tuple(shape))
                counts = buffer_state[0][j] + 1
                batches.append(
                    batch_of(gather_rows(g, rows, view), buffer_state[1][j], counts, list(buffer_state[2][j]), (i, j))
                )
                where.append((i, rows, view, row_index(g, rows)))
        # each buffer once, in order; Python values only (as for the tensors' probes)
        buffers = {i: (tuple(x.updates[i].shape), x.updates[i].device) for i, *_ in where}

        def probes() -> list:
            shapes, devices = zip(*buffers.values()) if buffers else ((), ())
            drawn = dict(zip(buffers, draw_probes(list(shapes), precond_dtype, list(devices))))
            return [gather_rows(drawn[i], rows, view, index) for i, rows, view, index in where]

        return batches, probes

    def batch_of(g: torch.Tensor, mu: torch.Tensor, counts: torch.Tensor, qs: list, members: Any) -> "_Batch":
        """A :class:`_Batch`: its momentum after this gradient, bias-corrected per row."""
        m = mu * b1 + (1 - b1) * g
        momentum = (m / one_minus_power(b1, counts, m)).to(precond_dtype)
        return _Batch(g, m, momentum, counts, qs, members)

    def balanced_if(balance: Any, qs: list) -> list:
        """Each batch's factors, balanced (:func:`balanced`) where ``balance`` (under
        ``torch.cond`` while traced); a batch of one dimension as it is."""
        which = [k for k, q in enumerate(qs) if len(q) > 1]
        if not which or balance is False:
            return qs
        if balance is True:
            return [balanced(q) if k in which else q for k, q in enumerate(qs)]

        def rebalanced(chosen: tuple) -> tuple:
            return tuple(tuple(f.contiguous() for f in balanced(list(q))) for q in chosen)

        def kept(chosen: tuple) -> tuple:
            return tuple(tuple(f.clone() for f in q) for q in chosen)

        done = iter(flat_operand_cond(balance, rebalanced, kept, (tuple(tuple(qs[k]) for k in which),)))
        return [list(next(done)) if k in which else q for k, q in enumerate(qs)]

    def fitted_if(refit: Any, fitted: list, qs: list, probes: Callable[[], list]) -> tuple:
        """Where ``refit``, each batch's factors fitted with new probes (:func:`fit`, under
        ``torch.cond`` while traced: the probes are drawn only in steps that fit) and what they
        were fitted to, perturbed; else both as they are."""
        if refit is False:
            return fitted, qs
        if refit is True:
            inputs = [(f, v, *q) for f, v, q in zip(fitted, probes(), qs)]  # every batch's fits in one all-gather
            done = owner_computes_all(fit_rows, inputs, owners, NAME, agreed=[(f, *q) for f, q in zip(fitted, qs)])
            return [d[0] for d in done], [list(d[1:]) for d in done]

        def fitted_all(fitted: tuple, qs: tuple, constants: torch.Tensor) -> tuple:
            done = [fit(f, v, list(q), constants[0], constants[1]) for f, v, q in zip(fitted, probes(), qs)]
            return tuple(d[0].contiguous() for d in done), tuple(tuple(f.contiguous() for f in d[1]) for d in done)

        def kept(fitted: tuple, qs: tuple, constants: torch.Tensor) -> tuple:
            return tuple(f.clone() for f in fitted), tuple(tuple(f.clone() for f in q) for q in qs)

        # dynamo may make any float a branch reads symbolic, a module's constant too (dynamic=True)
        constants = float_operands(fitted[0], precond_lr, PROBE_SCALE)
        operands = (tuple(fitted), tuple(tuple(q) for q in qs), constants)
        new_fitted, new_qs = flat_operand_cond(refit, fitted_all, kept, operands)
        return list(new_fitted), [list(q) for q in new_qs]

    def tensors_written(x: LeafLists, fields: list, batches: list, directions: list, qs: list) -> tuple:
        """The updates and the new ``steps``, ``mu`` and ``factors`` per tensor (rows of each
        batch's tensors; a tensor that does not step keeps its state, in storage of its own)."""
        steps, mus, factors = fields
        stepped = {i for b in batches for i in b.members}
        traced = torch.compiler.is_compiling()
        updates: list = [None if g is None else torch.zeros_like(g) for g in x.updates]
        new_mus = [m if i in stepped or traced else own_storage(m) for i, m in enumerate(mus)]
        new_factors = [f if i in stepped or traced else own_storage(f) for i, f in enumerate(factors)]
        new_steps = [c + 1 if i in stepped else c for i, c in enumerate(steps)]
        for b, u, qs_b in zip(batches, directions, qs):
            for row, (i, u_i, m_i) in enumerate(zip(b.members, u.unbind(), b.m.unbind())):
                shape_i = x.updates[i].shape
                updates[i] = u_i.reshape(shape_i).to(x.updates[i].dtype)
                new_mus[i] = m_i.view(shape_i) if m_i.shape == shape_i else m_i.reshape(shape_i)
                new_factors[i] = tuple(q[row] for q in qs_b)
        return updates, new_steps, new_mus, new_factors

    def fused_written(x: LeafLists, fields: list, batches: list, directions: list, qs: list) -> tuple:
        """The updates (each group's rows scattered into its flat buffer) and the new stacked
        ``steps``, ``mu`` and ``factors`` per buffer."""
        keys = tree.leaf_names(x.spec)
        updates: list = [None if g is None else torch.zeros_like(g) for g in x.updates]
        new = [[list(column[i]) if column[i] is not None else None for i in range(len(keys))] for column in fields]
        for b, u, qs_b in zip(batches, directions, qs):
            i, j = b.members
            shape, rows = layout_context.shape_groups_of(keys[i], NAME)[j]
            updates[i] = scatter_rows(updates[i], u, rows)
            new[0][i][j], new[1][i][j], new[2][i][j] = b.counts, b.m, tuple(qs_b)
        return updates, *([None if v is None else tuple(v) for v in column] for column in new)

    def fit_rows(g: torch.Tensor, v: torch.Tensor, *qs: torch.Tensor) -> tuple:
        """:func:`fit` as a tuple of rows: the perturbed ``G`` and the new factors."""
        perturbed, new = fit(g, v, list(qs))
        return (perturbed, *new)

    def fit(
        g: torch.Tensor, v: torch.Tensor, qs: list, lr: Any = precond_lr, probe_scale: Any = PROBE_SCALE
    ) -> tuple[torch.Tensor, list]:
        """One update of a batch's factors with the probes ``v``, the step size ``lr``
        (``precond_lr``) and the probes' scale (``PROBE_SCALE``), each a 0-dim tensor under
        ``torch.cond`` (:func:`float_operands`), module docstring; returns the perturbed ``G``
        and the new factors."""
        tiny = torch.finfo(precond_dtype).tiny
        dims = tuple(range(1, g.dim()))
        g = g + probe_scale * g.abs().mean(dims, keepdim=True) * v
        a, b = g, v
        for d, q in enumerate(qs):
            a = along(a, d, q)
            b = along(b, d, q, inverse_transpose=True)
        new = []
        for d, q in enumerate(qs):
            diagonal = q.dim() < 3
            aa, bb = gram(a, d, diagonal), gram(b, d, diagonal)
            difference, total = (aa - bb) * lr, aa + bb
            norm = total.abs().amax(dim=tuple(range(1, total.dim())))
            if diagonal:
                new.append(q - difference * (q / norm.clamp(min=tiny).unsqueeze(-1)))
            else:
                bound = torch.where(norm > 0, spectral_lower_bound(total, norm), norm)
                new.append(q - (torch.triu(difference) / bound.clamp(min=tiny)[:, None, None]) @ q)
        return g, new

    # a code object per instance: dynamo's compiled graphs of one do not count against another's
    # recompile limit (each configuration, its closure's numbers, would otherwise recompile it)
    return GradientTransformation(init, own_code(update))


class _Batch(NamedTuple):
    """The tensors that step together: the gradients ``g`` ``(B, *view)``, the momentum ``m``
    after this gradient and ``momentum``, bias-corrected in ``precond_dtype``, the counts
    (this gradient included), the factors stacked per dimension, and which tensors they are
    (indices; inside fuse, a buffer and a group)."""

    g: torch.Tensor
    m: torch.Tensor
    momentum: torch.Tensor
    counts: torch.Tensor
    factors: list
    members: Any


def draw_probe(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A probe ``V ~ N(0, I)`` of ``shape`` from torch's global RNG (module docstring).

    Args:
        shape: the probe's shape.
        dtype: its dtype (the preconditioner's).
        device: its device.
    """
    return torch.randn(shape, dtype=dtype, device=device)


def draw_probes(shapes: list, dtype: torch.dtype, devices: list) -> list[torch.Tensor]:
    """One probe per ``(shape, device)``, in order (:func:`draw_probe`); traced, one
    :func:`standard_normals` per device, which a compiled step runs as torch's own ``randn``
    calls in this order: the same numbers as eagerly.

    Args:
        shapes: the probes' shapes.
        dtype: their dtype.
        devices: their devices, one per shape.
    """
    if not torch.compiler.is_compiling():
        return [draw_probe(shape, dtype, device) for shape, device in zip(shapes, devices)]
    drawn: list = [None] * len(shapes)
    for device in dict.fromkeys(devices):  # each device's generator in its own order
        mine = [k for k, d in enumerate(devices) if d == device]
        sizes = [n for k in mine for n in shapes[k]]
        for k, probe in zip(mine, standard_normals(sizes, [len(shapes[k]) for k in mine], dtype, device)):
            drawn[k] = probe
    return drawn


def _split_shapes(sizes: list[int], ranks: list[int]) -> list[list[int]]:
    """The shapes laid out one after the other in ``sizes``, of ``ranks`` dimensions each."""
    ends = itertools.accumulate(ranks)
    return [sizes[end - rank : end] for end, rank in zip(ends, ranks)]


@torch.library.custom_op(
    "functional_bagua::standard_normals", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def standard_normals(
    sizes: list[int], ranks: list[int], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """``torch.randn(shape)`` for each shape in order (the shapes' sizes one after the other in
    ``sizes``, of ``ranks`` dimensions each), from the global RNG, as one operator: inductor runs
    it as it is (its own CPU normal generator is several times slower than torch's, and draws
    other numbers), keeps the draws' order, and never merges two calls
    (``nondeterministic_seeded``).

    Args:
        sizes: the draws' shapes, concatenated.
        ranks: the number of dimensions of each.
        dtype: their dtype.
        device: their device.
    """
    return [torch.randn(shape, dtype=dtype, device=device) for shape in _split_shapes(sizes, ranks)]


@standard_normals.register_fake
def _(sizes: list[int], ranks: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype, device=device) for shape in _split_shapes(sizes, ranks)]


def _batches(grads: list, present: list, factors: list, view_of: Callable) -> list[list[int]]:
    """The tensors that step together: one view shape, factor shapes, dtype and device."""
    batches: dict[tuple, list[int]] = {}
    for i in present:
        g = grads[i]
        key = (view_of(tuple(g.shape)), tuple(tuple(q.shape) for q in factors[i]), g.dtype, g.device)
        batches.setdefault(key, []).append(i)
    return list(batches.values())


def along(
    x: torch.Tensor, d: int, q: torch.Tensor, inverse_transpose: bool = False, transpose: bool = False
) -> torch.Tensor:
    """A batch ``x`` (dim 0) times its factors ``q`` along dimension ``d`` of each element:
    ``q x`` for matrices (``q^-T x`` with ``inverse_transpose``, ``q^T x`` with ``transpose``),
    elementwise for vectors (``x / q`` with ``inverse_transpose``)."""
    if q.dim() < 3:
        shape = [q.shape[0]] + [1] * (x.dim() - 1)
        shape[d + 1] = -1
        return x / q.view(shape) if inverse_transpose else x * q.view(shape)
    moved = x.movedim(d + 1, -1)
    flat = moved.reshape(moved.shape[0], -1, moved.shape[-1])
    if inverse_transpose:  # y = x q^-1 along the last dimension: y q = x, solved as q^T y^T = x^T
        # (the same substitution; LAPACK's left-sided batched solve is several times faster here)
        transposed = torch.linalg.solve_triangular(q.transpose(-2, -1), flat.transpose(-2, -1), upper=False)
        out = transposed.transpose(-2, -1)
    else:
        out = flat @ (q if transpose else q.transpose(-2, -1))
    return out.reshape(moved.shape).movedim(-1, d + 1)


def gram(x: torch.Tensor, d: int, diagonal: bool) -> torch.Tensor:
    """Per batch element, ``X_(d) X_(d)^T`` (its diagonal where ``diagonal``)."""
    rows = x.movedim(d + 1, 1).reshape(x.shape[0], x.shape[d + 1], -1)
    return rows.square().sum(dim=-1) if diagonal else rows @ rows.mT


def precondition(g: torch.Tensor, qs: list) -> torch.Tensor:
    """Per batch element ``G x_1 Q_1^T Q_1 ... x_k Q_k^T Q_k`` (``Q_i^2`` elementwise for a vector)."""
    for d, q in enumerate(qs):
        if q.dim() < 3:
            g = along(g, d, q * q)
        else:
            g = along(along(g, d, q), d, q, transpose=True)
    return g


def spectral_lower_bound(a: torch.Tensor, max_abs: torch.Tensor) -> torch.Tensor:
    """Per batch element, a lower bound of ``a``'s spectral norm: one power iteration from its
    largest column (``max_abs``: its largest entry, by which it is scaled first)."""
    scaled = a / max_abs[:, None, None]
    largest = torch.argmax(scaled.square().sum(dim=-2), dim=-1)
    column = scaled.gather(-1, largest[:, None, None].expand(-1, a.shape[-2], 1)).squeeze(-1)
    x = (column.unsqueeze(-2) @ scaled).squeeze(-2)
    x = x / x.norm(dim=-1, keepdim=True)
    return (scaled @ x.unsqueeze(-1)).squeeze(-1).norm(dim=-1) * max_abs


def balanced(qs: list) -> list:
    """Per batch element, the factors rescaled to one infinity norm (their geometric mean): the
    preconditioner, their Kronecker product, unchanged."""
    norms = torch.stack([q.abs().amax(dim=tuple(range(1, q.dim()))) for q in qs])
    target = norms.log().mean(dim=0).exp()
    return [q * (target / n).view(-1, *([1] * (q.dim() - 1))) for q, n in zip(qs, norms)]


def _check_leaf(
    g: torch.Tensor, mu: torch.Tensor, factors: tuple, expected: list, dtype: torch.dtype, spec: object, i: int
) -> None:
    """Raise a ValueError unless one tensor's state is what ``init`` makes for ``g``'s shape
    (``expected``: its factors' shapes, in ``dtype``)."""
    got = [tuple(q.shape) for q in factors] if isinstance(factors, tuple) else None
    if mu.shape != g.shape or got != expected:
        raise ValueError(
            f"{NAME}: the state of {tree.leaf_name(spec, i)!r} was made for another parameter or other options: its "  # type: ignore[arg-type]
            f"momentum has shape {tuple(mu.shape)} and its factors {got}, where a parameter of shape "
            f"{tuple(g.shape)} with these options has {expected}; make the state with this transform, tx.init(params)"
        )
    if any(q.dtype != dtype for q in factors):
        raise ValueError(
            f"{NAME}: the factors of {tree.leaf_name(spec, i)!r} are {factors[0].dtype}, made with another "  # type: ignore[arg-type]
            f"precond_dtype than this transform's {dtype}; make the state with this transform, tx.init(params)"
        )
