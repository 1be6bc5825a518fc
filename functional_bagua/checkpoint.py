"""Optimizer state to a flat ``{key: tensor}`` dict and back.

A key names the tensor's place in the state: the position of the transform in its chain, the
state field, and the parameter name, joined by ``/``::

    >>> tx = fb.adamw(); state = tx.init({"fc.weight": w, "fc.bias": b})
    >>> sorted(fb.state_dict(state))
    ['1/count/fc.bias', '1/count/fc.weight', '1/mu/fc.bias', ..., '1/nu/fc.weight']

Keys are unambiguous: a ``/`` or ``%`` inside a name is escaped (``%2F``, ``%25``), so
``{"a/b": x}`` and ``{"a": {"b": y}}`` get different keys; names that still coincide (the int
``1`` and the string ``"1"``) raise a ValueError instead of sharing a key.

The dict is plain (``torch.save``-able, inspectable, editable). Loading needs the structure,
which ``tx.init(params)`` gives; every key, shape and dtype must match. The loaded tensors are
copies, so stepping in place never writes into the checkpoint dict::

    torch.save(fb.state_dict(state), "opt.pt")
    state = fb.load_state_dict(tx.init(params), torch.load("opt.pt"))

A state type may name fields that say where the state belongs rather than what it learned, in a
class attribute ``MUST_MATCH_ON_LOAD`` (a shard's rank and world size): those are compared with
the template's, and a checkpoint whose values differ is refused.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from functional_bagua import tree


def _escaped(entry) -> str:
    return str(entry).replace("%", "%25").replace("/", "%2F")


def _key(accessor) -> str:
    return "/".join(_escaped(getattr(entry, "field", None) or entry.entry) for entry in accessor)


def _keyed_leaves(state: Any):
    accessors, leaves, spec = optree.tree_flatten_with_accessor(state, none_is_leaf=tree.NONE_IS_LEAF)
    keys = [_key(a) for a in accessors]
    seen: dict = {}
    for key, accessor in zip(keys, accessors):
        if key in seen:
            raise ValueError(
                f"state_dict: two tensors of the state would share the key {key!r} ({seen[key].codify('state')} and {accessor.codify('state')}); "
                "give the parameters names that differ as strings (not both 1 and '1')"
            )
        seen[key] = accessor
    return keys, accessors, leaves, spec


def _must_match(accessor) -> bool:
    """Whether the leaf at ``accessor`` is a field its state type lists in ``MUST_MATCH_ON_LOAD``."""
    last = accessor[-1] if len(accessor) else None
    field = getattr(last, "field", None)
    return field is not None and field in getattr(last.type, "MUST_MATCH_ON_LOAD", ())


def state_dict(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` by key (``None`` leaves are left out)."""
    keys, _, leaves, _ = _keyed_leaves(state)
    out = {}
    for key, leaf in zip(keys, leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"state_dict: state leaf {key!r} is a {type(leaf).__name__}, not a tensor")
        out[key] = leaf
    return out


def load_state_dict(template: Any, flat: dict[str, torch.Tensor]) -> Any:
    """``template`` (e.g. ``tx.init(params)``) with its tensors replaced by copies of those of ``flat``.

    Raises a ValueError naming the first key that is missing, unexpected, or of another shape or
    dtype, or a ``MUST_MATCH_ON_LOAD`` field whose value differs from the template's (module
    docstring). Tensors are copied to the template's devices.
    """
    keys, accessors, leaves, spec = _keyed_leaves(template)
    expected = [k for k, leaf in zip(keys, leaves) if leaf is not None]
    missing = [k for k in expected if k not in flat]
    if missing:
        raise ValueError(f"load_state_dict: key {missing[0]!r} is missing from the checkpoint ({len(missing)} missing)")
    unexpected = sorted(set(flat) - set(expected))
    if unexpected:
        raise ValueError(f"load_state_dict: checkpoint key {unexpected[0]!r} is not in this optimizer's state")
    new_leaves = []
    for key, accessor, leaf in zip(keys, accessors, leaves):
        if leaf is None:
            new_leaves.append(None)
            continue
        value = flat[key]
        if not isinstance(value, torch.Tensor) or value.shape != leaf.shape or value.dtype != leaf.dtype:
            got = f"{type(value).__name__}" if not isinstance(value, torch.Tensor) else f"{value.dtype} {tuple(value.shape)}"
            raise ValueError(f"load_state_dict: {key!r} is {got} in the checkpoint, the state expects {leaf.dtype} {tuple(leaf.shape)}")
        if _must_match(accessor) and not torch.equal(value.to(leaf.device), leaf):
            raise ValueError(
                f"load_state_dict: {key!r} is {value.tolist()} in the checkpoint, {leaf.tolist()} in this state: the "
                "checkpoint belongs elsewhere (another rank's shard, or another world size); load each rank's own file"
            )
        new_leaves.append(value.detach().to(leaf.device, copy=True))
    return spec.unflatten(new_leaves)
