"""Which flat layout the update running now works on, for the rules that need to know.

Inside :func:`~functional_bagua.fuse` (and ``distributed.shard``) a transform sees flat buffers,
``{"float32@cpu": 1-D tensor}``, instead of the parameter tree. Elementwise rules do not care; a
per-tensor rule (a trust ratio, a factored moment) asks :func:`segments_of` where each parameter
lies in a buffer, and rules that cannot run on flat buffers ask :func:`refuse_inside_fuse`.

The layout travels with the thread that runs the fused update (:func:`run_on_flat_buffers` sets
it for the duration of one ``init`` or ``update``), never between threads: an unfused update in
another thread sees none. It is a ``threading.local``, not a ``contextvars.ContextVar``, because
fused updates run inside compiled steps and torch.compile cannot trace ``ContextVar.set``; an
attribute of a thread-local object it traces.

This module sits below the transforms and :mod:`functional_bagua.fusion`, which both import it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Protocol, TypeVar

import torch

from functional_bagua import tree

_T = TypeVar("_T")


class Layout(Protocol):
    """What a fused update's layout gives its rules: the segments of each flat buffer (a
    :class:`~functional_bagua.FlatLayout`, or ``distributed.shard``'s stand-in, which raises)."""

    def segments(self, key: str) -> tuple: ...


class _Running(threading.local):
    """This thread's stack of the layouts of the fused updates running now (innermost last)."""

    def __init__(self) -> None:
        self.layouts: list[Layout] = []
        self.owned_tensors = 0  # inside distributed.shard_by_tensor: each rank its own tensors


def run_on_owned_tensors(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` on the whole tensors one rank owns (inside ``distributed.shard_by_tensor``):
    transforms that reduce across all tensors refuse there (:func:`refuse_on_shards`), as do
    those that share work among ranks themselves (``group=``: :func:`on_owned_tensors`).

    Args:
        fn: the function to call, a transform's ``update``.
        *args: the arguments passed to ``fn``.
    """
    _RUNNING.owned_tensors += 1
    try:
        return fn(*args)
    finally:
        _RUNNING.owned_tensors -= 1


def on_owned_tensors() -> bool:
    """Whether the update running now in this thread holds only the tensors this rank owns."""
    return _RUNNING.owned_tensors > 0


_RUNNING = _Running()


def active_layout() -> Optional[Layout]:
    """The layout of the fused update running now in this thread, or ``None`` outside of one."""
    layouts = _RUNNING.layouts
    return layouts[-1] if layouts else None


def segments_of(key: str) -> Optional[tuple]:
    """The segments of the flat buffer ``key`` in the fused update running now (else ``None``).

    Args:
        key: the group key of a flat buffer (``"float32@cpu"``).
    """
    layout = active_layout()
    return None if layout is None else layout.segments(key)


def segment_lengths_of(key: str) -> list:
    """The number of elements of each segment of the flat buffer ``key`` in the fused update
    running now: for rules that only sum over each segment (:func:`summed_across_shards`), which
    may also run where the buffer holds a part of each tensor (DTensors' local shards).

    Args:
        key: the group key of a flat buffer.
    """
    layout = active_layout()
    assert layout is not None, "no fused update is running"
    lengths = getattr(layout, "segment_lengths", None)
    return lengths(key) if lengths is not None else [seg.numel for seg in layout.segments(key)]


def on_local_shards() -> bool:
    """Whether the fused update running now works on DTensors' local shards."""
    return getattr(active_layout(), "summed_across_shards", None) is not None


def summed_across_shards(key: str, sums: torch.Tensor) -> torch.Tensor:
    """``sums`` (sums over the segments of the flat buffer ``key``, this rank's part of each)
    added up over the ranks that hold the other parts, where the buffer holds DTensors' local
    shards (one all-reduce); else ``sums`` as it is.

    Args:
        key: the group key of a flat buffer.
        sums: a tensor of sums over this rank's part of each segment.
    """
    summed = getattr(active_layout(), "summed_across_shards", None)
    return sums if summed is None else summed(key, sums)


def whole_shapes_of(key: str) -> tuple:
    """The shape of each whole tensor of the flat buffer ``key`` in the fused update running now:
    its segments' shapes, or, where the buffer holds DTensors' local shards, the DTensors' shapes.

    Args:
        key: the group key of a flat buffer.
    """
    layout = active_layout()
    assert layout is not None, "no fused update is running"
    named = getattr(layout, "named_shapes", None)
    return (
        tuple(shape for _, shape in named(key))
        if named is not None
        else tuple(seg.shape for seg in layout.segments(key))
    )


def segment_names_of(key: str) -> list:
    """The name of each tensor of the flat buffer ``key`` in the fused update running now (also
    where the buffer holds DTensors' local shards).

    Args:
        key: the group key of a flat buffer.
    """
    layout = active_layout()
    assert layout is not None, "no fused update is running"
    named = getattr(layout, "named_shapes", None)
    return [name for name, _ in named(key)] if named is not None else [seg.name for seg in layout.segments(key)]


def owner_plan_of(key: str) -> Any:
    """How the whole tensors of the flat buffer ``key`` are gathered to their owner ranks where it
    holds DTensors' local shards (an :class:`~functional_bagua.distributed.whole_tensors.OwnerPlan`),
    ``None`` where it holds whole tensors.

    Args:
        key: the group key of a flat buffer.
    """
    plan = getattr(active_layout(), "owner_plan", None)
    return None if plan is None else plan(key)


def shape_groups_of(key: str, name: str) -> tuple:
    """The tensors of the flat buffer ``key`` in the fused update running now, grouped by shape
    (:meth:`~functional_bagua.FlatLayout.shape_groups`), for rules that batch tensors of one shape.

    Args:
        key: the group key of a flat buffer.
        name: the transform asking, named in the error raised inside ``distributed.shard`` (whose
            shards do not hold whole tensors).
    """
    layout = active_layout()
    assert layout is not None, "no fused update is running"
    groups = getattr(layout, "shape_groups", None)
    if groups is None:
        raise NotImplementedError(
            f"{name} cannot run inside shard(): it needs whole tensors, which a shard of the flat buffers does not "
            "hold. Shard it by whole tensors (fbd.shard_by_tensor(...)), put it before shard(), or run it unsharded."
        )
    return groups(key)


def tensor_shapes(params: tree.PyTree) -> list:
    """``(name, shape)`` of each parameter tensor of ``params``, also when ``params`` are the flat
    buffers of the fused update running now (then the names and shapes are the layout's).

    Args:
        params: a pytree of parameter tensors (``None`` leaves are left out) or, inside a fused
            update, its flat buffers ``{key: 1-D tensor}``.
    """
    leaves, spec = tree.flatten(params)
    names = tree.leaf_names(spec)
    layout = active_layout()
    if layout is None:
        return [(name, tuple(p.shape)) for name, p in zip(names, leaves) if p is not None]
    named = getattr(layout, "named_shapes", None)
    if named is None:
        return [(seg.name, seg.shape) for key in names for seg in layout.segments(key)]
    return [pair for key in names for pair in named(key)]  # DTensors' shards: the DTensors' shapes


def refuse_inside_fuse(name: str, why: str) -> None:
    """Raise if called while a fused update runs: for transforms that cannot be fused faithfully.

    Args:
        name: the transform's name, which starts the message.
        why: why it cannot run on flat buffers, put in the message.

    Raises:
        NotImplementedError: inside :func:`fuse` or ``distributed.shard``.
    """
    if active_layout() is not None:
        raise NotImplementedError(
            f"{name} cannot run inside fuse() or shard(): {why}. Fuse the transforms of each group "
            "separately, or run it unfused."
        )


def refuse_on_shards(name: str, why: str) -> None:
    """Raise if called on one rank's shard of the flat buffers (inside ``distributed.shard``): for
    transforms that reduce across all tensors, which a shard holds only a part of.

    Args:
        name: the transform's name, which starts the message.
        why: why it cannot run on a shard, put in the message.

    Raises:
        NotImplementedError: inside ``distributed.shard`` (the active layout has ``is_shard``) and
            inside ``distributed.shard_by_tensor``.
    """
    layout = active_layout()
    if getattr(layout, "is_shard", False):
        refusal = getattr(layout, "refusal", None)  # a layout over shards may say it its own way
        raise NotImplementedError(
            refusal(name, why)
            if refusal is not None
            else f"{name} cannot run inside shard(): {why}. Put it before shard() (on the whole gradients) "
            "or use an unsharded chain."
        )
    if on_owned_tensors():
        raise NotImplementedError(
            f"{name} cannot run inside shard_by_tensor(): each rank holds only the tensors it owns, so {why}. "
            "Put it before shard_by_tensor() (on the whole gradients) or use an unsharded chain."
        )


def run_on_flat_buffers(layout: Layout, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with ``layout`` as the active layout: per-tensor rules inside ``fn`` ask it for
    the segments of each buffer (``layout.segments(key)``).

    Args:
        layout: the layout made active while ``fn`` runs: a :class:`~functional_bagua.FlatLayout`, or
            any object with a ``segments(key)`` method (``distributed.shard`` passes one that raises).
        fn: the function to call, e.g. a transform's ``init`` or ``update``.
        *args: the arguments passed to ``fn``.

    Returns:
        What ``fn`` returns; ``layout`` stops being active even if ``fn`` raises.
    """
    _RUNNING.layouts.append(layout)
    try:
        return fn(*args)
    finally:
        _RUNNING.layouts.pop()
