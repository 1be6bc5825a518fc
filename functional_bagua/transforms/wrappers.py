"""Transforms that route, freeze or guard other transforms.

- ``masked(inner, mask)``: ``inner`` updates the leaves where ``mask`` is True; the others pass
  through unchanged, and ``inner`` keeps no state for them.
- ``partition(transforms, labels)``: parameter groups; leaf ``k`` is updated by
  ``transforms[labels[k]]`` (``labels`` a tree of labels or a function of the params).
- ``set_to_zero()``: a zero update, represented as ``None``: no tensor is made, and
  ``apply_updates`` leaves the parameter as it is. ``freeze(mask)`` = ``masked(set_to_zero(), mask)``.
- ``apply_if_finite(inner, max_consecutive_errors)``: skip (zero update, state kept) any step whose
  gradients hold NaN or inf; after ``max_consecutive_errors`` such steps in a row, apply anyway.

A leaf that a transform does not own reaches it as a ``None`` gradient, and ``None`` gradients
leave parameters and state untouched: that is all the routing there is.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import torch

from functional_bagua import layout_context, tree
from functional_bagua.base import EmptyState, GradientTransformation
from functional_bagua.numerics import zero_count
from functional_bagua.tree import PyTree


def _resolve(tree_or_fn: Union[PyTree, Callable[[PyTree], PyTree]], params: PyTree) -> PyTree:
    return tree_or_fn(params) if callable(tree_or_fn) else tree_or_fn


def _keep_where(updates: PyTree, keep_leaves: list[bool]) -> PyTree:
    leaves, spec = tree.flatten(updates)
    return spec.unflatten([u if keep else None for u, keep in zip(leaves, keep_leaves)])


def _mask_leaves(mask: Union[PyTree, Callable[[PyTree], PyTree]], params: PyTree) -> list[bool]:
    layout_context.refuse_inside_fuse("masked", "a flat buffer has no parameter names to mask")
    _, spec = tree.flatten(params)
    return [bool(m) for m in tree.leaves_up_to(spec, _resolve(mask, params), "mask", "params")]


class MaskedState(NamedTuple):
    """``inner_state``: the masked transform's state (``None`` where the mask is False)."""

    inner_state: Any


def masked(inner: GradientTransformation, mask: Union[Any, Callable[[Any], Any]]) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` (a tree of bools like params, or a function of the
    params returning one) is True. Example: no weight decay on biases::

        tx = fb.chain(fb.scale_by_adam(),
                      fb.masked(fb.add_decayed_weights(0.01), lambda p: {k: v.dim() > 1 for k, v in p.items()}),
                      fb.scale_by_learning_rate(1e-3))

    Args:
        inner: the transform for the leaves where ``mask`` is True; it sees the other leaves as
            ``None`` (no gradient, no state).
        mask: a tree of bools with the structure of the params, or a function of the params that
            returns one (then ``update`` needs the parameters).

    Returns:
        A GradientTransformation whose state is a :class:`MaskedState`; it cannot run inside a
        fused update.
    """

    def init(params: PyTree) -> MaskedState:
        return MaskedState(inner.init(_keep_where(params, _mask_leaves(mask, params))))

    def update(updates: PyTree, state: MaskedState, params: Optional[PyTree] = None) -> tuple[PyTree, MaskedState]:
        if callable(mask) and params is None:
            raise ValueError("masked: a mask given as a function needs the parameters")
        keep = _mask_leaves(mask, params if params is not None else updates)
        inner_params = None if params is None else _keep_where(params, keep)
        inner_updates, inner_state = inner.update(_keep_where(updates, keep), state.inner_state, inner_params)
        leaves, spec = tree.flatten(updates)
        new_leaves = spec.flatten_up_to(inner_updates)
        return spec.unflatten([n if k else u for u, n, k in zip(leaves, new_leaves, keep)]), MaskedState(inner_state)

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    """``inner_states``: label -> that group's state."""

    inner_states: dict


def partition(
    transforms: Mapping[Any, GradientTransformation], labels: Union[Any, Callable[[Any], Any]]
) -> GradientTransformation:
    """Parameter groups: each leaf is updated by the transform its label names. Example (AdamW
    without decay on biases and norms, a 10x learning rate for the head)::

        labels = lambda p: {k: "head" if k.startswith("head") else "no_decay" if v.dim() < 2 else "decay"
                            for k, v in p.items()}
        tx = fb.partition({"decay": fb.adamw(1e-3, weight_decay=0.01),
                           "no_decay": fb.adamw(1e-3, weight_decay=0.0),
                           "head": fb.adamw(1e-2, weight_decay=0.01)}, labels)

    Args:
        transforms: label -> the transform for the leaves with that label; each transform sees
            the other leaves as ``None`` and keeps no state for them.
        labels: a tree of labels with the structure of the params, or a function of the params
            that returns one; a label with no entry in ``transforms`` raises a ValueError.

    Returns:
        A GradientTransformation whose state is a :class:`PartitionState`; its ``update`` needs
        the parameters, and it cannot run inside a fused update.
    """

    groups = Partitioned(transforms, labels)

    def masks(params: PyTree) -> dict[Any, list[bool]]:
        layout_context.refuse_inside_fuse("partition", "a flat buffer has no parameter names to label")
        found = groups.leaf_labels(params)
        return {name: [label == name for label in found] for name in transforms}

    def init(params: PyTree) -> PartitionState:
        return PartitionState(
            {name: tx.init(_keep_where(params, m)) for (name, tx), m in zip(transforms.items(), masks(params).values())}
        )

    def update(
        updates: PyTree, state: PartitionState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, PartitionState]:
        if params is None:
            raise ValueError("partition needs the parameters: call update(grads, state, params)")
        leaves, spec = tree.flatten(updates)
        merged = list(leaves)
        new_states = {}
        for name, keep in masks(params).items():
            group_updates, new_states[name] = transforms[name].update(
                _keep_where(updates, keep), state.inner_states[name], _keep_where(params, keep)
            )
            for i, (u, k) in enumerate(zip(spec.flatten_up_to(group_updates), keep)):
                if k:
                    merged[i] = u
        return spec.unflatten(merged), PartitionState(new_states)

    update.partitioned = groups  # type: ignore[attr-defined]  # read by partitioned()
    return GradientTransformation(init, update)


class Partitioned(NamedTuple):
    """What a :func:`partition` routes: ``transforms`` (label -> transform) and ``labels`` (a tree
    of labels, or a function of the params returning one)."""

    transforms: Mapping[Any, GradientTransformation]
    labels: Any

    def leaf_labels(self, params: PyTree) -> list:
        """The label of each leaf of ``params`` (in ``tree.flatten`` order); a ValueError for a
        label without a transform."""
        _, spec = tree.flatten(params)
        found = tree.leaves_up_to(spec, _resolve(self.labels, params), "labels", "params")
        unknown = sorted({str(label) for label in found if label not in self.transforms})
        if unknown:
            raise ValueError(
                f"partition: labels without a transform: {unknown}; transforms are for {list(self.transforms)}"
            )
        return found


def partitioned(tx: GradientTransformation) -> Optional[Partitioned]:
    """The transforms and labels of ``tx`` if :func:`partition` built it, else ``None``
    (``fb.Optimizer`` makes one param group per label from them)."""
    return getattr(tx.update, "partitioned", None)


def set_to_zero() -> GradientTransformation:
    """A zero update for every leaf, as ``None`` (module docstring): no work, no memory.

    Returns:
        A stateless GradientTransformation whose updates are all ``None``.

    Example::

        tx = fb.partition({"train": fb.adamw(1e-3), "frozen": fb.set_to_zero()}, labels)
    """

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: Optional[PyTree] = None) -> tuple[PyTree, EmptyState]:
        return tree.tree_map(lambda u: None, updates), state

    return GradientTransformation(init, update)


def freeze(mask: Union[Any, Callable[[Any], Any]]) -> GradientTransformation:
    """Freeze the leaves where ``mask`` is True: their updates are ``None``, so the transforms
    chained after this one skip them (no work; their state stays as initialised). To allocate no
    optimizer state at all for frozen leaves, use ``partition({..., "frozen": set_to_zero()}, labels)``.

    Args:
        mask: the leaves to freeze: a tree of bools with the structure of the params, or a
            function of the params that returns one (as in :func:`masked`).

    Returns:
        A GradientTransformation whose state is a :class:`MaskedState`.

    Example::

        tx = fb.chain(fb.freeze(lambda p: {k: k.startswith("encoder.") for k in p}), fb.adamw(1e-3))
    """
    return masked(set_to_zero(), mask)


class ApplyIfFiniteState(NamedTuple):
    """``notfinite_count``: non-finite steps in a row; ``last_finite``: whether the last step was
    finite; ``total_notfinite``: non-finite steps in all; ``inner_state``."""

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Run ``inner`` only on steps whose gradients are all finite (module docstring).

    Branch-free (``torch.where``), so it traces into one graph: on a skipped step the updates are
    zeros and every state tensor keeps its old value, bit for bit. ``max_consecutive_errors`` is
    an int >= 0.

    Args:
        inner: the transform to guard (a TypeError if it is not a GradientTransformation); it
            runs on every step, and its new state is kept only on the steps that are applied.
        max_consecutive_errors: how many non-finite steps in a row are skipped; the next one is
            applied anyway (and the count starts again). ``0`` applies every step.

    Returns:
        A GradientTransformation whose state is an :class:`ApplyIfFiniteState`; it refuses to run
        on the shards of a distributed update.

    Example::

        tx = fb.apply_if_finite(fb.adam(1e-3), max_consecutive_errors=5)
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"apply_if_finite: inner is {type(inner).__name__}, not a GradientTransformation")
    if (
        isinstance(max_consecutive_errors, bool)
        or not isinstance(max_consecutive_errors, int)
        or max_consecutive_errors < 0
    ):
        raise ValueError(f"apply_if_finite: max_consecutive_errors must be an int >= 0, got {max_consecutive_errors!r}")

    def init(params: PyTree) -> ApplyIfFiniteState:
        finite = torch.ones((), dtype=torch.bool, device=tree.device_of(params))
        return ApplyIfFiniteState(zero_count(params), finite, zero_count(params), inner.init(params))

    def update(
        updates: PyTree, state: ApplyIfFiniteState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, ApplyIfFiniteState]:
        layout_context.refuse_on_shards(
            "apply_if_finite", "each rank would see only its shard, and ranks could disagree on skipping"
        )
        leaves = [u for u in tree.flatten(updates)[0] if u is not None]
        finite = torch.stack([torch.isfinite(u).all() for u in leaves]).all() if leaves else torch.tensor(True)
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        notfinite_count = torch.where(finite, 0, state.notfinite_count + 1)
        apply = finite | (notfinite_count > max_consecutive_errors)
        return tree.zeros_unless(apply, new_updates), ApplyIfFiniteState(
            torch.where(apply & ~finite, 0, notfinite_count),
            finite,
            state.total_notfinite + (~finite).long(),
            tree.where(apply, new_inner, state.inner_state),
        )

    return GradientTransformation(init, update)
