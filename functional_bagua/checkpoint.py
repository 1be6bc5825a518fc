"""Optimizer state to a flat ``{key: tensor}`` dict and back.

A key names the tensor's place in the state: the position of the transform in its chain, the
state field, and the parameter name, joined by ``/``::

    >>> tx = fb.adamw(); state = tx.init({"fc.weight": w, "fc.bias": b})
    >>> sorted(fb.state_dict(state))
    ['1/count/fc.bias', '1/count/fc.weight', '1/mu/fc.bias', ..., '1/nu/fc.weight']

The dict is plain (``torch.save``-able, inspectable, editable). Loading needs the structure,
which ``tx.init(params)`` gives; every key, shape and dtype must match::

    torch.save(fb.state_dict(state), "opt.pt")
    state = fb.load_state_dict(tx.init(params), torch.load("opt.pt"))
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from functional_bagua import tree


def _key(accessor) -> str:
    return "/".join(str(getattr(entry, "field", None) or entry.entry) for entry in accessor)


def _keyed_leaves(state: Any):
    accessors, leaves, spec = optree.tree_flatten_with_accessor(state, none_is_leaf=tree.NONE_IS_LEAF)
    return [_key(a) for a in accessors], leaves, spec


def state_dict(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` by key (``None`` leaves are left out)."""
    keys, leaves, _ = _keyed_leaves(state)
    out = {}
    for key, leaf in zip(keys, leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"state_dict: state leaf {key!r} is a {type(leaf).__name__}, not a tensor")
        out[key] = leaf
    return out


def load_state_dict(template: Any, flat: dict[str, torch.Tensor]) -> Any:
    """``template`` (e.g. ``tx.init(params)``) with its tensors replaced by those of ``flat``.

    Raises a ValueError naming the first key that is missing, unexpected, or of another shape or
    dtype. Tensors are moved to the template's devices.
    """
    keys, leaves, spec = _keyed_leaves(template)
    expected = [k for k, leaf in zip(keys, leaves) if leaf is not None]
    missing = [k for k in expected if k not in flat]
    if missing:
        raise ValueError(f"load_state_dict: key {missing[0]!r} is missing from the checkpoint ({len(missing)} missing)")
    unexpected = sorted(set(flat) - set(expected))
    if unexpected:
        raise ValueError(f"load_state_dict: checkpoint key {unexpected[0]!r} is not in this optimizer's state")
    new_leaves = []
    for key, leaf in zip(keys, leaves):
        if leaf is None:
            new_leaves.append(None)
            continue
        value = flat[key]
        if not isinstance(value, torch.Tensor) or value.shape != leaf.shape or value.dtype != leaf.dtype:
            got = f"{type(value).__name__}" if not isinstance(value, torch.Tensor) else f"{value.dtype} {tuple(value.shape)}"
            raise ValueError(f"load_state_dict: {key!r} is {got} in the checkpoint, the state expects {leaf.dtype} {tuple(leaf.shape)}")
        new_leaves.append(value.to(leaf.device))
    return spec.unflatten(new_leaves)
