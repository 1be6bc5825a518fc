"""Helpers for the matrix work of the preconditioned optimizers (SOAP, Shampoo), batched over
tensors of one shape: shapes viewed with small dimensions merged, state kept as the rows of one
tensor between steps, and per-matrix calls where rounding must match an unbatched reference."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from functional_bagua.flat import Rows


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


def check_eager_update(name: str, state: object, state_type: type, why: str) -> None:
    """:func:`check_state_type`, and a TypeError under torch.compile, which these transforms do
    not support yet (``why``: the decisions the update takes from values, which a trace cannot).

    Args:
        name: the transform's name.
        state: the state ``update`` got.
        state_type: the state type its ``init`` makes.
        why: what the update decides from values.
    """
    check_state_type(name, state, state_type)
    if torch.compiler.is_compiling():
        raise TypeError(
            f"{name} runs eagerly: {why}, decisions torch.compile cannot trace yet; build the step with "
            "compile=False (make_train_step(..., compile=False)), or keep the optimizer out of the compiled function"
        )


def _row_index(flat: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The indices into ``flat`` of the elements of tensors at ``rows.offsets``, row by row."""
    offsets = torch.tensor(rows.offsets, device=flat.device)
    return (offsets[:, None] + torch.arange(rows.numel, device=flat.device)).reshape(-1)


def gather_rows(flat: torch.Tensor, rows: Rows, shape: tuple) -> torch.Tensor:
    """The tensors at ``rows`` of a flat buffer, stacked as ``(rows.number, *shape)``: a view where
    they lie one after the other, else one gather.

    Args:
        flat: a 1-D flat buffer.
        rows: where its tensors to stack lie.
        shape: the view of each row.
    """
    if rows.offsets is None:
        stacked = flat.narrow(0, rows.start, rows.number * rows.numel)
    else:
        stacked = flat[_row_index(flat, rows)]
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
    return flat.index_copy(0, _row_index(flat, rows), values)


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
    the rows of one tensor (:func:`rows_of`), else a new one."""
    base = rows_of(tensors, shape)
    return base if base is not None else torch.stack([t.reshape(shape) for t in tensors])


def per_element(fn: Callable[..., torch.Tensor], *batches: torch.Tensor) -> torch.Tensor:
    """``fn`` on a batch once per element, stacked: each rounded as the reference's unbatched
    call (torch's batched matmul and ``eigh`` round small products and some decompositions
    otherwise than on a single matrix)."""
    return torch.stack([fn(*elements) for elements in zip(*batches)])


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` where it has 32 bits or more, else float32 (what ``eigh`` and QR take)."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


def owner_computes(fn: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor, group: Any) -> torch.Tensor:
    """``fn`` on a batch of square matrices that every rank of ``group`` holds alike, each
    matrix decomposed by one rank (rank ``r`` of ``W`` takes rows ``r, r + W, ...``: a batch's
    matrices cost alike, so the split is balanced) and the results gathered by all; ``fn`` maps a
    batch of ``n x n`` matrices to one of ``n x n`` matrices, row by row. ``group=None``: this
    process computes all.

    Args:
        fn: the decomposition, batched.
        batch: the matrices, the same on every rank.
        group: a torch process group, or ``None``.
    """
    if group is None:
        return fn(batch)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return fn(batch)
    rows, per_rank = batch.shape[0], math.ceil(batch.shape[0] / world)
    mine = batch[rank::world]
    done = fn(mine) if len(mine) else None
    dtype = done.dtype if done is not None else fn(batch[:1]).dtype  # (fewer rows than ranks)
    padded = batch.new_zeros((per_rank, *batch.shape[1:]), dtype=dtype)
    if done is not None:
        padded[: len(done)] = done
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.stack([gathered[j % world][j // world] for j in range(rows)])
