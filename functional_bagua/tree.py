"""Pytree helpers on optree.

Every tree here is flattened with ``none_is_leaf=True``: a ``None`` gradient or update is a leaf
that stands for "nothing for this parameter", so trees with ``None`` holes keep the structure of
the parameter tree they belong to.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import optree
import torch

from functional_bagua import checks

NONE_IS_LEAF = True

PyTree = Any  # a nested container (dict, list, tuple, NamedTuple...) of tensors and None leaves


def flatten(tree: PyTree) -> tuple[list, optree.PyTreeSpec]:
    """Leaves and structure of ``tree`` (``None`` counts as a leaf)."""
    return optree.tree_flatten(tree, none_is_leaf=NONE_IS_LEAF)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """optree's ``tree_map`` with ``None`` as a leaf."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=NONE_IS_LEAF)


def clone(tree: PyTree) -> PyTree:
    """A copy of every tensor leaf of ``tree`` (``None`` leaves stay ``None``)."""
    return tree_map(lambda x: None if x is None else x.clone(), tree)


def where(condition: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where the 0-dim bool ``condition`` holds, else ``old``, tensor leaf by tensor leaf
    (branch-free, so it traces into one graph); non-tensor leaves are taken from ``new``."""
    return tree_map(lambda n, o: torch.where(condition, n, o) if isinstance(n, torch.Tensor) else n, new, old)


def replaced(state: Any, **fields: Any) -> Any:
    """``state`` (a NamedTuple) with ``fields`` changed, built by its constructor: NamedTuple's
    ``_replace`` traced by dynamo in torch 2.11 returns an empty tuple of the state's type."""
    unknown = set(fields) - set(state._fields)
    if unknown:  # as _replace refuses them
        raise ValueError(f"{type(state).__name__} has no fields {sorted(unknown)}")
    return type(state)(*(fields.get(name, value) for name, value in zip(state._fields, state)))


def copy_into(targets: PyTree, values: PyTree) -> None:
    """Write each tensor leaf of ``values`` into the same leaf of ``targets`` (a tree of the same
    structure), in place; leaves that already are the target tensor are skipped. Traceable: in a
    compiled graph the writes become stores of the generated kernels into the input buffers."""
    for target, value in zip(flatten(targets)[0], flatten(values)[0]):
        if isinstance(target, torch.Tensor) and value is not target:
            if target.dim() == 0:
                # torch 2.13's compiled graphs drop in-place writes (copy_, mul_, ...) to 0-dim float64
                # CPU inputs (a scheduled lr, NAdam's momentum product); an indexed store is kept.
                target[()] = value
            else:
                target.copy_(value)


def zeros_unless(condition: torch.Tensor, updates: PyTree) -> PyTree:
    """``updates`` where the 0-dim bool ``condition`` holds, else zeros (``None`` stays ``None``)."""
    return tree_map(lambda u: None if u is None else torch.where(condition, u, torch.zeros_like(u)), updates)


def device_of(tree: PyTree) -> Optional[torch.device]:
    """The device of the first leaf of ``tree`` that is not ``None`` (``None`` if there is none);
    a TypeError naming the leaf if it is not a tensor."""
    leaves, spec = flatten(tree)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
        if leaf is not None:
            raise TypeError(
                f"leaf {leaf_names(spec)[i]!r} is a {type(leaf).__name__}, not a tensor; {checks.params_instead(leaf)}"
            )
    return None


def leaf_names(spec: optree.PyTreeSpec) -> list[str]:
    """A readable name per leaf: dict keys and sequence indices joined by ``/``."""
    return ["/".join(str(k) for k in path) or "<root>" for path in optree.treespec_paths(spec)]


def leaf_name(spec: optree.PyTreeSpec, i: int) -> str:
    """The readable name of leaf ``i`` of ``spec`` (see :func:`leaf_names`), for messages:
    ``functools.partial(leaf_name, spec, i)`` names a leaf only when an error needs it."""
    return leaf_names(spec)[i]


def leaves_matching(spec: optree.PyTreeSpec, tree: PyTree, name: str, reference: str) -> list:
    """Leaves of ``tree``, which must have structure ``spec``; else a ValueError naming the keys.

    ``name`` and ``reference`` are what the two trees are called in the message, e.g.
    ``leaves_matching(params_spec, grads, "grads", "params")``.
    """
    if torch.compiler.is_compiling():
        # dynamo cannot compare two specs (torch 2.11 fails on their unflatten functions' __eq__):
        # flatten_up_to checks the same structure node by node, leaves must then be leaves
        leaves = leaves_up_to(spec, tree, name, reference)
        if not all(optree.tree_is_leaf(leaf, none_is_leaf=NONE_IS_LEAF) for leaf in leaves):
            raise ValueError(describe_mismatch(spec, flatten(tree)[1], name, reference))
        return leaves
    read = one_pass_leaves(spec, tree)
    if read is not None:
        return read
    leaves, tree_spec = flatten(tree)
    if tree_spec != spec:
        raise ValueError(describe_mismatch(spec, tree_spec, name, reference))
    return leaves


def flatten_like(tree: PyTree, spec: Optional[optree.PyTreeSpec]) -> tuple[list, optree.PyTreeSpec]:
    """:func:`flatten`, in one pass where ``tree`` has the structure ``spec`` (a step's tree seen
    at the step before) as one container of tensors or ``None`` (``fb.Optimizer``'s group
    dicts): optree's flatten looks at each leaf's type, ``flatten_up_to`` does not.

    Args:
        tree: the tree to flatten.
        spec: the structure it is expected to have, or ``None`` (then flattened as it is).
    """
    if spec is not None and not torch.compiler.is_compiling():
        leaves = one_pass_leaves(spec, tree)
        if leaves is not None:
            return leaves, spec
    return flatten(tree)


def one_pass_leaves(spec: optree.PyTreeSpec, tree: PyTree) -> Optional[list]:
    """The leaves of ``tree`` where it is one container of ``spec``'s type and keys holding
    tensors or ``None`` (the usual case, a dict of tensors: ``flatten_up_to`` reads it in one
    pass); else ``None``.

    Args:
        spec: the structure ``tree`` is expected to have.
        tree: the tree whose leaves to read.
    """
    one_container = spec.num_nodes == spec.num_leaves + 1 and type(tree) is spec.type  # of the spec's type
    if not one_container:
        return None
    try:
        leaves: list = spec.flatten_up_to(tree)
    except (ValueError, TypeError):
        return None
    return leaves if tensors_or_none(leaves) else None


def tensors_or_none(leaves: list) -> bool:
    """Whether every leaf is a tensor or ``None`` (one check per distinct type, not per leaf)."""
    return all(kind is type(None) or issubclass(kind, torch.Tensor) for kind in set(map(type, leaves)))


def leaves_up_to(spec: optree.PyTreeSpec, tree: PyTree, name: str, reference: str) -> list:
    """Leaves of ``tree`` cut at the leaves of ``spec`` (a mask or label tree, a tree of ``None``):
    like :func:`leaves_matching`, but it also traces under torch.compile for trees that hold no
    tensors, which optree's flatten does not. A mismatch raises a ValueError naming the keys."""
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError):
        raise ValueError(describe_mismatch(spec, flatten(tree)[1], name, reference)) from None


def leaves_with_params(updates: PyTree, params: PyTree) -> tuple[list, list, optree.PyTreeSpec]:
    """Leaves of ``updates`` and of ``params`` and their common structure.

    ``params`` is the reference: a gradient/update tree of another structure raises a ValueError
    naming the keys missing from it and the keys it has in excess.
    """
    param_leaves, spec = flatten(params)
    return leaves_matching(spec, updates, "grads", "params"), param_leaves, spec


def describe_mismatch(expected: optree.PyTreeSpec, got: optree.PyTreeSpec, name: str, reference: str) -> str:
    """A message naming the keys in which two tree structures differ."""
    want, have = leaf_names(expected), leaf_names(got)
    missing = [k for k in want if k not in set(have)]
    extra = [k for k in have if k not in set(want)]
    parts = [f"{name} do not match the structure of {reference}"]
    if missing:
        parts.append(f"missing from {name}: {_some(missing)}")
    if extra:
        parts.append(f"in {name} but not in {reference}: {_some(extra)}")
    if not missing and not extra:
        parts.append(f"same keys, different containers: {got} vs {expected}")
    return "; ".join(parts)


def _some(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")
