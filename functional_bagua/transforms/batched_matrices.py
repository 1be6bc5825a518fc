"""Helpers for the matrix work of the preconditioned optimizers (SOAP, Shampoo, PSGD-Kron), batched over
tensors of one shape: shapes viewed with small dimensions merged, state kept as the rows of one
tensor between steps, and per-matrix calls where rounding must match an unbatched reference."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import optree
import torch
import torch.distributed as dist

from functional_bagua import layout_context, tree
from functional_bagua.checks import check_param
from functional_bagua.flat import Rows
from functional_bagua.hyperparams import check_hyperparameter

_T = TypeVar("_T")


def check_state_type(name: str, state: object, state_type: type) -> None:
    """Raise a ValueError for a state that ``name``'s ``init`` did not make.

    Args:
        name: the transform's name.
        state: the state ``update`` got.
        state_type: the state type its ``init`` makes.
    """
    if not isinstance(state, state_type):
        raise ValueError(
            f"{name}: got a state of type {type(state).__name__}, expected {state_type.__name__}; pass the state "
            "this transform's init made"
        )


def refuse_group_under_compile(name: str, group: Any, shared: str) -> None:
    """Raise a TypeError while traced where ``group`` is set: owner-computes shares its results
    with collectives that run eagerly.

    Args:
        name: the transform's name.
        group: its ``group=`` argument.
        shared: what the ranks share (named in the message).
    """
    if group is not None and torch.compiler.is_compiling():
        raise TypeError(
            f"{name}: group= shares its {shared} with collectives that run eagerly; build the step with "
            "compile=False, or leave group out"
        )


def check_number(who: str, name: str, value: Any, ok: Callable[[float], bool], requirement: str) -> None:
    """Raise ``ValueError("{who}: {name} must be {requirement}, got {value}")`` unless ``ok`` holds
    for ``value`` (:func:`~functional_bagua.hyperparams.check_hyperparameter`: a tensor validated
    already is not read, as inside a traced step or where a factory is rebuilt at each update,
    ``fb.Optimizer(params, fb.shampoo, lr=...)``).

    Args:
        who: the transform named in the message.
        name: the argument's name.
        value: its value.
        ok: whether a number is allowed.
        requirement: what is allowed, for the message ("in [0, 1)").
    """
    check_hyperparameter(value, ok, f"{who}: {name} must be {requirement}, got {{}}")


def cached_eagerly(fn: Callable[[tuple], _T]) -> Callable[[tuple], _T]:
    """``fn`` of a shape, cached when called eagerly and computed afresh while traced (dynamo
    traces through an ``lru_cache`` and warns about it). The cache is a plain dict: a transform
    may be built inside a traced step (a factory rebuilt with new hyperparameters), where dynamo
    cannot make an ``lru_cache`` (it breaks the graph there, and torch 2.13 then mistraces the
    trees the step flattens).

    Args:
        fn: a function of one hashable argument (a shape), whose result depends on nothing else.
    """
    known: dict = {}

    def shaped(shape: tuple) -> _T:
        shape = tuple(shape)
        if torch.compiler.is_compiling():
            return fn(shape)
        if shape not in known:
            known[shape] = fn(shape)
        return known[shape]

    return shaped


def row_index(flat: torch.Tensor, rows: Rows) -> Optional[torch.Tensor]:
    """The indices into ``flat`` of the elements of the tensors at ``rows``, row by row, or
    ``None`` where they lie one after the other (:func:`gather_rows` takes a view).

    Args:
        flat: a 1-D flat buffer (its device).
        rows: where its tensors lie.
    """
    if rows.offsets is None:
        return None
    offsets = torch.tensor(rows.offsets, device=flat.device)
    return (offsets[:, None] + torch.arange(rows.numel, device=flat.device)).reshape(-1)


def gather_rows(flat: torch.Tensor, rows: Rows, shape: tuple, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensors at ``rows`` of a flat buffer, stacked as ``(rows.number, *shape)``: a view where
    they lie one after the other, else one gather.

    Args:
        flat: a 1-D flat buffer.
        rows: where its tensors to stack lie.
        shape: the view of each row.
        index: :func:`row_index` of ``rows``, made ahead (inside a ``torch.cond`` branch, a
            tensor built from constants fails inductor's compile: make it outside and pass it).
    """
    if rows.offsets is None:
        stacked = flat.narrow(0, rows.start, rows.number * rows.numel)
    else:
        stacked = flat[index if index is not None else row_index(flat, rows)]
    return stacked.view(rows.number, *shape)


def scatter_rows(flat: torch.Tensor, values: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``flat`` with ``values`` (one row per tensor, as :func:`gather_rows` stacks them) written
    at ``rows``, out of place.

    Args:
        flat: a 1-D flat buffer.
        values: the rows, ``(rows.number, ...)``.
        rows: where each row goes.
    """
    values = values.reshape(-1).to(flat.dtype)
    if rows.offsets is None:
        return torch.slice_scatter(flat, values, 0, rows.start, rows.start + values.numel())
    return flat.index_copy(0, row_index(flat, rows), values)  # type: ignore[arg-type]


def own_storage(state: object) -> object:
    """A tensor's kept state (or a tuple of them) with each row of a larger batch tensor copied
    out: a tensor that gets no gradient for a while must not keep its last batch alive.

    Args:
        state: a tensor, a tuple of tensors, or ``None``.
    """
    if isinstance(state, tuple):
        return tuple(own_storage(t) for t in state)
    if isinstance(state, torch.Tensor) and state._base is not None:
        return state.clone()
    return state


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


def rows_of(tensors: list, shape: tuple) -> Optional[torch.Tensor]:
    """The contiguous tensor of shape ``(len(tensors), *shape)`` whose rows, in order, the
    tensors are (views of the previous step's batch), or ``None``."""
    first = tensors[0]
    base = first._base
    if base is None or base.shape != (len(tensors), *shape) or not base.is_contiguous():
        return None
    start, step = first.data_ptr(), base.stride(0) * base.element_size()
    if start != base.data_ptr() or any(
        t._base is not base or t.data_ptr() != start + row * step for row, t in enumerate(tensors)
    ):
        return None
    return base


def restack(tensors: list, shape: tuple) -> torch.Tensor:
    """The tensors viewed as ``shape``, stacked along a new dim 0: without a copy where they are
    the rows of one tensor (:func:`rows_of`), else a new one (always while traced, where storage
    cannot be inspected)."""
    base = None if torch.compiler.is_compiling() else rows_of(tensors, shape)
    return base if base is not None else torch.stack([t.reshape(shape) for t in tensors])


class _Leaf(NamedTuple):
    """Where :func:`flat_operand_cond` put an operand, and its shape."""

    place: int
    shape: torch.Size


def flat_operand_cond(pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any], operands: tuple) -> Any:
    """``torch.cond(pred, true_fn, false_fn, operands)`` with every tensor of ``operands`` passed
    as a 1-D view and given back to the branches in its own shape.

    Inductor may lay out an operand that the graph computes with padded strides (its
    comprehensive padding, on by default on CUDA: a stride above 1024 elements rounded up to 128
    bytes, e.g. 5000 -> 5024 for a batch of 50 x 100 matrices), while it compiles each branch for
    the operand's dense strides; the branch's stride check then fails at the first call. A 1-D
    tensor has no stride to pad.

    Args:
        pred: a boolean scalar tensor (or a Python bool), as for ``torch.cond``.
        true_fn, false_fn: the branches, each called with ``operands``' structure.
        operands: a tuple (nested tuples allowed) of tensors.

    Example::

        kept = lambda m: m.clone()
        out = flat_operand_cond(refresh, lambda m: m @ m, kept, (matrices,))
    """
    flat: list = []

    def flattened(node: Any) -> Any:  # the structure, each leaf its place in ``flat`` and shape
        if isinstance(node, tuple):
            return tuple(flattened(child) for child in node)
        if not isinstance(node, torch.Tensor):
            raise TypeError(f"flat_operand_cond: operands must be tensors in nested tuples, got {type(node).__name__}")
        flat.append(node.reshape(-1))
        return _Leaf(len(flat) - 1, node.shape)

    structure = flattened(operands)

    def rebuilt(node: Any, given: tuple) -> Any:
        if not isinstance(node, _Leaf):
            return tuple(rebuilt(child, given) for child in node)
        return given[node.place].view(node.shape)

    def in_shapes(branch: Callable[..., Any]) -> Callable[..., Any]:
        def run(*given: Any) -> Any:
            return branch(*rebuilt(structure, given))

        return run

    return torch.cond(pred, in_shapes(true_fn), in_shapes(false_fn), tuple(flat))


def float_operands(like: torch.Tensor, *values: Any) -> torch.Tensor:
    """``values`` (floats) as a float64 vector on ``like``'s device, to hand the floats that a
    ``torch.cond`` branch or an operator of the library reads to it as an operand: dynamo makes
    a closure's float symbolic (compiled with ``dynamic=True``, or one code object recompiled
    for another value), which ``torch.cond`` cannot take in (it lifts what a branch reads:
    tensors and ints only). Each element, a 0-dim tensor, enters arithmetic as the number
    would: a 0-dim tensor does not widen another tensor's dtype.

    Example::

        constants = float_operands(stat, epsilon)   # in the branch: constants[0]
    """
    return torch.stack([like.new_full((), value, dtype=torch.float64) for value in values])


def per_row(values: Any, like: torch.Tensor) -> Any:
    """``values`` (one per batch element) shaped to broadcast along ``like``'s dimension 0; a
    number as it is.

    Args:
        values: a 1-D tensor of one value per batch element, or a number.
        like: a batch (its dimension 0 the batch).
    """
    if not isinstance(values, torch.Tensor):
        return values
    return values.view(-1, *([1] * (like.dim() - 1)))


def one_minus_power(beta: float, counts: Any, like: torch.Tensor) -> Any:
    """``1 - beta^t`` (a bias correction's divisor): a number for a known count ``t``, else per
    batch element from the counts (a 1-D integer tensor), in float64 and then ``like``'s dtype,
    shaped to broadcast along ``like``'s dimension 0 (:func:`per_row`).

    Args:
        beta: the decay.
        counts: an int, or one count per batch element.
        like: the batch it divides.
    """
    if not isinstance(counts, torch.Tensor):
        return 1 - beta**counts
    return per_row((1 - torch.pow(beta, counts.to(torch.float64))).to(like.dtype), like)


def per_element(fn: Callable[..., torch.Tensor], *batches: torch.Tensor) -> torch.Tensor:
    """``fn`` on a batch once per element, stacked: each rounded as the reference's unbatched
    call (torch's batched matmul and ``eigh`` round small products and some decompositions
    otherwise than on a single matrix)."""
    return torch.stack([fn(*elements) for elements in zip(*batches)])


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` where it has 32 bits or more, else float32 (what ``eigh`` and QR take)."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


class Owners:
    """Which rank of a process group computes each row that :func:`owner_computes` is given
    during one update: the least loaded so far in the update (ties to the lowest rank), a row
    of ``n`` elements costing ``n^1.5`` (``k^3`` for a ``k x k`` matrix, what a decomposition
    costs). Rows of every batch and every dimension are so spread by cost, not batch by batch
    from rank 0. Every rank makes the same choices: it sees the same shapes in the same order
    (:func:`owner_computes` compares the loads too).

    Args:
        group: the torch process group, or ``None`` (this process computes all).
        name: the transform, named in errors.
        shared: what the ranks share (named in the error under torch.compile).

    Example::

        owners = Owners(group, "scale_by_soap", "decompositions")
        owners.begin_update()                      # in each update: loads from zero
        bases = owner_computes(eigenbasis, statistics, owners)
    """

    def __init__(self, group: Any, name: str, shared: str) -> None:
        self.group, self.name, self.shared = group, name, shared
        self.loads: list[float] = []

    def begin_update(self) -> None:
        """Start an update: loads from zero (a TypeError while traced, with a group: the
        results are shared by collectives that run eagerly)."""
        refuse_group_under_compile(self.name, self.group, self.shared)
        if self.group is not None and layout_context.on_owned_tensors():
            raise ValueError(
                f"{self.name}: group= inside shard_by_tensor(): there each rank holds other tensors, and the work "
                "is already split by tensor; leave group out"
            )
        if self.group is not None:  # (without one, nothing is written: a compiled step reads no loads)
            self.loads = [0.0] * dist.get_world_size(self.group)

    def agree(self, decided: Callable[[], list], device: torch.device) -> None:
        """Check that every rank decided alike what it computes in this update (``decided``:
        integers, such as which tensors step at which counts): ranks that differ would call
        :func:`owner_computes` a different number of times and wait in its collectives for
        ever. One all-gather of ``decided``'s length and three weighted sums, compared; where
        they differ, the same ValueError on every rank. Nothing without a group of two ranks
        or more.

        Args:
            decided: gives the integers that decide this update's computations on this rank
                (called only with a group: it may read the device, :func:`decided_by`).
            device: where the collective's tensor lives (the gradients' device).
        """
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        values = [int(v) for v in decided()]
        prime = 2**61 - 1  # the sums kept in int64
        weighted = [sum((k + 1) ** power * v for k, v in enumerate(values)) % prime for power in range(3)]
        mine = torch.tensor([len(values), *weighted], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        differing = [r for r, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
        if differing:
            raise ValueError(
                f"{self.name}: with group=, every rank of the group must step the same tensors (shapes, dtypes) at "
                f"the same counts (the same state: one checkpoint loaded on every rank), but rank {differing[0]}'s "
                "differ from rank 0's"
            )

    def assign(self, rows: int, row_numel: int) -> list[int]:
        """The owner of each of ``rows`` rows of ``row_numel`` elements, its cost added to its
        owner's load."""
        if not self.loads:
            self.begin_update()
        cost, owners = float(row_numel) ** 1.5, []
        for _ in range(rows):
            owner = min(range(len(self.loads)), key=lambda r: (self.loads[r], r))
            self.loads[owner] += cost
            owners.append(owner)
        return owners


def decided_by(updates: list, counts: Any) -> list:
    """What decides which matrices a preconditioner's update computes: the indices, shapes and
    dtypes of the gradients present and every count in ``counts`` (a tree of integer tensors;
    one device sync).

    Args:
        updates: the gradients (``None`` where absent).
        counts: the state's counters.
    """
    present = [i for i, g in enumerate(updates) if g is not None]
    # each shape, then its dtype's name as character codes, each closed by -1
    shapes = [n for i in present for n in (*updates[i].shape, -1, *map(ord, str(updates[i].dtype)), -1)]
    tensors = [t.reshape(-1) for t in optree.tree_leaves(counts) if isinstance(t, torch.Tensor)]
    return present + shapes + (torch.cat(tensors).tolist() if tensors else [])


def device_of(updates: list, state: Any = None) -> torch.device:
    """The device of the first gradient present, else of the first tensor of ``state`` (the
    CPU where there is none)."""
    tensors = [g for g in updates if g is not None] + [
        t for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)
    ]
    return tensors[0].device if tensors else torch.device("cpu")


def owner_computes(
    fn: Callable[..., Any], batch: Any, group: Any, name: str = "owner_computes", agreed: Optional[tuple] = None
) -> Any:
    """``fn`` on a batch that every rank of ``group`` holds alike, each row computed by one rank
    and the results gathered by all: :func:`owner_computes_all` of the one batch.

    Args:
        fn: the computation, batched.
        batch: the rows (a tensor, or a tuple of row-aligned tensors), the same on every rank.
        group: an :class:`Owners`, a torch process group, or ``None`` (this process computes all).
        name: the transform, named in the errors.
        agreed: the tensors that must be equal on every rank (default: ``batch``).
    """
    return owner_computes_all(fn, [batch], group, name, None if agreed is None else [agreed])[0]


def owner_computes_all(
    fn: Any, batches: list, group: Any, name: str = "owner_computes", agreed: Optional[list] = None
) -> list:
    """``fn`` (or the ``fn[i]`` of a list, one per batch) on each of ``batches`` (of any
    shapes), which every rank of ``group`` holds alike,
    each row computed by one rank (:class:`Owners`: the least loaded in the update so far) and
    the results of all the batches gathered by all in one all-gather. A batch is a tensor
    (``fn`` maps it to a tensor) or a tuple of row-aligned tensors (``fn`` takes them as
    arguments and returns a tensor or a tuple), row by row. ``group=None``: this process
    computes all.

    The all-gather carries, before the results (as bytes: no dtype is converted), a fingerprint
    of ``agreed`` (default: the batches; float64 sums of the entries, of the entries weighted by
    row and column, of their squares, and counts of non-finite values), the loads before these batches and whether ``fn`` raised; the sizes
    come from the shapes, the same on every rank (the transforms check first that the ranks
    step alike, :meth:`Owners.agree`; a rank that owns no row of a batch learns its result's
    shapes on the meta device). Where ``fn`` raised on some rank, every rank raises a
    RuntimeError naming it; where the fingerprints differ (gradients not averaged before, say),
    every rank raises the same ValueError instead of mixing rows computed from different
    matrices.

    Args:
        fn: the computation, batched, or a list of one per batch.
        batches: the batches, each the same on every rank.
        group: an :class:`Owners` (its loads carry over from the update's earlier batches), a
            torch process group (these batches alone are balanced), or ``None``.
        name: the transform, named in the errors.
        agreed: per batch, the tensors that must be equal on every rank (default: the batches).

    Returns:
        ``fn``'s result for each batch, all rows.

    Example::

        roots = owner_computes_all(lambda m: inverse_root(m, 1e-12, 4, torch.float64), [left, right], owners)
    """
    inputs = [b if isinstance(b, tuple) else (b,) for b in batches]
    fns = fn if isinstance(fn, list) else [fn] * len(inputs)
    owners = group if isinstance(group, Owners) else Owners(group, name, "results")
    if owners.group is None or dist.get_world_size(owners.group) == 1 or not inputs:
        return [f(*x) for f, x in zip(fns, inputs)]
    world, rank = dist.get_world_size(owners.group), dist.get_rank(owners.group)
    device = inputs[0][0].device
    loads_before = list(owners.loads) or [0.0] * world
    held = []  # per batch, per rank: the rows it computes
    for x in inputs:
        owner_of = owners.assign(x[0].shape[0], math.prod(x[0].shape[1:]))
        held.append([[j for j in range(x[0].shape[0]) if owner_of[j] == r] for r in range(world)])
    # the results' shapes and dtypes first, on every rank alike (the sizes of the all-gather):
    # where they cannot be found, every rank raises here, before any collective
    shaped = [_shapes_only(f, x) for f, x in zip(fns, inputs)]
    outs = [_as_tuple(out) for out in shaped]
    failure: Optional[Exception] = None
    done: list = []
    for f, x, rows, out in zip(fns, inputs, held, outs):
        try:  # every rank must still take part in the all-gather: a failure is flagged in it
            mine = torch.tensor(rows[rank], dtype=torch.long, device=device)
            result = f(*(t.index_select(0, mine) for t in x)) if rows[rank] and failure is None else None
            if result is not None and [(o.shape[1:], o.dtype) for o in _as_tuple(result)] != [
                (o.shape[1:], o.dtype) for o in out
            ]:
                raise RuntimeError(f"{name}: a result's shapes or dtypes differ from those its first row gives")
            done.append(result)
        except Exception as error:
            failure = error
            done.append(None)
    row_bytes = [[math.prod(o.shape[1:]) * o.element_size() for o in out] for out in outs]
    per_rank = [max(len(r) for r in rows) for rows in held]
    payloads = []
    for d, rows, widths, most in zip(done, held, row_bytes, per_rank):
        payload = torch.zeros(most, sum(widths), dtype=torch.uint8, device=device)
        if d is not None:
            owned = len(rows[rank])
            payload[:owned] = torch.cat([o.contiguous().reshape(owned, -1).view(torch.uint8) for o in _as_tuple(d)], 1)
        payloads.append(payload.reshape(-1))
    every_agreed = tuple(t for tensors in (agreed or inputs) for t in _as_tuple(tensors))
    raised = torch.tensor([float(failure is not None)], dtype=torch.float64, device=device)
    loads = torch.tensor(loads_before, dtype=torch.float64, device=device)
    status = torch.cat([_fingerprint(every_agreed), loads, raised])
    message = torch.cat([status.view(torch.uint8), *payloads])
    gathered = [torch.empty_like(message) for _ in range(world)]
    dist.all_gather(gathered, message, group=owners.group)
    _check_statuses([g[: status.numel() * 8].view(torch.float64) for g in gathered], failure, name)
    results = []
    offset = status.numel() * 8
    for x, shape, out, rows, widths, most in zip(inputs, shaped, outs, held, row_bytes, per_rank):
        size = most * sum(widths)
        per_owner = [g[offset : offset + size].view(most, sum(widths)) for g in gathered]
        offset += size
        place = {j: (r, k) for r in range(world) for k, j in enumerate(rows[r])}
        merged = torch.stack([per_owner[place[j][0]][place[j][1]] for j in range(x[0].shape[0])])
        parts = tuple(  # each part copied to storage of its own: its bytes view as its dtype
            part.clone(memory_format=torch.contiguous_format).view(o.dtype).reshape(x[0].shape[0], *o.shape[1:])
            for part, o in zip(merged.split(widths, dim=1), out)
        )
        results.append(parts if isinstance(shape, tuple) else parts[0])
    return results


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _check_statuses(statuses: list, failure: Optional[Exception], name: str) -> None:
    """Raise on every rank where some rank's ``fn`` raised (the last entry of its status), or
    where the ranks' fingerprints and loads differ (compared bit for bit: NaN equals NaN)."""
    failed = [r for r, status in enumerate(statuses) if status[-1]]
    if failed:
        raise RuntimeError(
            f"{name}: the computation of rank {failed[0]}'s rows raised"
            + (f": {failure!r}" if failure is not None else " (its own error says why)")
        ) from failure
    bits = [status[:-1].view(torch.int64) for status in statuses]
    differing = [r for r in range(len(statuses)) if not torch.equal(bits[r], bits[0])]
    if differing:
        raise ValueError(
            f"{name}: with group=, every rank of the group must hold the same gradients and state (chain "
            f"allreduce_gradients before it), but rank {differing[0]}'s differ from rank 0's"
        )


def _shapes_only(fn: Callable[..., Any], inputs: tuple) -> Any:
    """What ``fn`` gives for one row, for its shapes and dtypes only (what every rank learns
    before computing its own rows): computed on the meta device (no data, no time), or on the
    real first row where ``fn`` cannot run there (the same row, and so the same outcome, on
    every rank that holds the same batch)."""
    try:
        return fn(*(x[:1].to("meta") for x in inputs))
    except Exception:  # an operation without a meta kernel: the first row, computed
        return fn(*(x[:1] for x in inputs))


def _fingerprint(tensors: tuple) -> torch.Tensor:
    """Six float64 numbers of ``tensors``, each viewed as a matrix ``M`` (its last dimension
    the columns): the sums over the tensors of the finite parts of ``sum(M)``, of ``r^T M c``
    (``r`` and ``c`` weights by row and column, in (0, 1] plus the tensor's index: a move of
    entries changes it) and of ``sum(M^2)``, and the counts of NaN, +inf and -inf among the row
    sums, the weighted row sums and the sums of squares (so a non-finite value, whose bits may
    differ between ranks, is counted, not summed, and does not hide what differs elsewhere).
    Bit for bit equal on ranks that hold equal tensors, and all but surely not equal for
    generic differences; three reductions per tensor, a fraction of the computations it
    guards."""
    sums = torch.zeros(6, dtype=torch.float64, device=tensors[0].device)
    for i, t in enumerate(tensors):
        if not t.numel():
            continue
        m = t.to(torch.float64).reshape(-1, t.shape[-1] if t.dim() else 1)
        rows = m.sum(1)
        weighted = (m @ _weights(m.shape[1], i, m.device)) * _weights(m.shape[0], i, m.device)
        squares = torch.linalg.vector_norm(m).square().reshape(1)
        parts = (rows, weighted, squares)
        finite = [p.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).sum() for p in parts]
        special = torch.cat(parts)
        counts = [special.isnan().sum(), special.isposinf().sum(), special.isneginf().sum()]
        sums = sums + torch.stack([*finite, *(c.to(torch.float64) for c in counts)])
    return sums.nan_to_num(nan=0.0)  # a NaN of finite parts' overflow (inf - inf), counted above


def _weights(n: int, offset: int, device: torch.device) -> torch.Tensor:
    """``offset`` plus each of ``n`` positions in (0, 1], float64."""
    return torch.arange(1, n + 1, dtype=torch.float64, device=device) / n + offset


def initial_fields(
    params: Any,
    name: str,
    width: int,
    init_leaf: Callable[[torch.Tensor], tuple],
    fused_state_of: Callable[[torch.Tensor, Any], tuple],
    groups_of: Callable[[str], Any],
) -> list:
    """The ``width`` fields of a preconditioner's initial state, each a tree of ``params``'
    structure: every parameter checked (real, dense), then ``init_leaf(p)`` for it or, inside
    :func:`~functional_bagua.fuse`, ``fused_state_of(buffer, groups_of(key))`` for each flat
    buffer (state stacked per shape); ``None`` in every field for a ``None`` parameter.

    Args:
        params: the parameter tree (or, inside fuse, its flat buffers).
        name: the transform, named in the errors.
        width: the number of fields.
        init_leaf: one tensor's fields.
        fused_state_of: one flat buffer's fields, from its groups of equal-shaped tensors.
        groups_of: a buffer's groups, from its key.
    """
    leaves, spec = tree.flatten(params)
    for i, p in enumerate(leaves):
        if p is not None:
            check_param(p, functools.partial(tree.leaf_name, spec, i), name, complex_ok=False)
    fused, keys = layout_context.active_layout() is not None, tree.leaf_names(spec)
    per_leaf = [
        (None,) * width if p is None else fused_state_of(p, groups_of(keys[i])) if fused else init_leaf(p)
        for i, p in enumerate(leaves)
    ]
    return [spec.unflatten([s[f] for s in per_leaf]) for f in range(width)]


def fused_buffers(
    x: Any, fields: list, name: str, fused_state_of: Callable[[torch.Tensor, Any], tuple], groups_of: Callable
) -> Iterator[tuple[int, torch.Tensor, Any, list]]:
    """The flat buffers of a fused update that have a gradient: ``(i, g, groups, state)`` each
    (its index, its gradient, its groups of equal-shaped tensors, its state, one value per
    field), the state checked against what ``fused_state_of`` makes (:func:`check_fused_state`).

    Args:
        x: the update's checked leaves (:class:`~functional_bagua.leaf_lists.LeafLists`).
        fields: the state's fields, each a list with one value per buffer.
        name: the transform, named in the errors.
        fused_state_of: one flat buffer's initial fields, from its groups.
        groups_of: a buffer's groups, from its key.
    """
    keys = tree.leaf_names(x.spec)
    for i, g in enumerate(x.updates):
        if g is None:
            continue
        groups = groups_of(keys[i])
        buffer_state = [column[i] for column in fields]
        check_fused_state(name, buffer_state, fused_state_of(g.new_empty(0, device="meta"), groups), keys[i])
        yield i, g, groups, buffer_state


def check_fused_state(name: str, state: list, expected: Any, key: str) -> None:
    """Raise a ValueError unless one flat buffer's state (one value per field) has the shapes and
    dtypes of ``expected``, what the transform's ``init`` makes inside this fused update.

    Args:
        name: the transform's name.
        state: the buffer's state, one value per field (nests of tuples of tensors).
        expected: the state ``init`` makes (on the meta device will do).
        key: the buffer's key, named in the message.
    """
    got = [_shapes(field) for field in state]
    if got != [_shapes(field) for field in expected]:
        raise ValueError(
            f"{name}: the state of the flat buffer {key!r} was made for another layout or other options (its shapes "
            f"and dtypes {got} differ from {[_shapes(field) for field in expected]}); make it with "
            "fuse(tx, layout).init(flat)"
        )


def _shapes(value: Any) -> Any:
    """The shapes and dtypes of a nest of tuples of tensors (``None`` for anything else)."""
    if isinstance(value, torch.Tensor):
        return (*value.shape, str(value.dtype).replace("torch.", ""))
    if isinstance(value, tuple):
        return tuple(_shapes(v) for v in value)
    return None
