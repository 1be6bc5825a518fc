"""Optimizer state to a flat ``{key: tensor}`` dict and back.

A key names the tensor's place in the state: the position of the transform in its chain, the
state field, and the parameter name, joined by ``/``::

    >>> import torch, functional_bagua as fb
    >>> state = fb.adamw().init({"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)})
    >>> sorted(fb.state_dict(state))  # doctest: +NORMALIZE_WHITESPACE
    ['1/count/fc.bias', '1/count/fc.weight', '1/mu/fc.bias', '1/mu/fc.weight',
     '1/nu/fc.bias', '1/nu/fc.weight']

Keys are unambiguous: a ``/`` or ``%`` inside a name is escaped (``%2F``, ``%25``), so
``{"a/b": x}`` and ``{"a": {"b": y}}`` get different keys; names that still coincide (the int
``1`` and the string ``"1"``) raise a ValueError instead of sharing a key.

The dict is plain (``torch.save``-able, inspectable, editable). Loading needs the structure,
which ``tx.init(params)`` gives; every key, shape and dtype must match. The loaded tensors are
copies, so stepping in place never writes into the checkpoint dict::

    torch.save(fb.state_dict(state), "opt.pt")
    state = fb.load_state_dict(tx.init(params), torch.load("opt.pt"))

A state type may name fields that say where the state belongs rather than what it learned, in a
static method ``must_match_on_load()`` (a shard's rank and world size): those are compared with
the template's, and a checkpoint whose values differ is refused. A checkpoint whose tensors are
stored otherwise than the template's (``low_precision_state`` with another codec, or none) is
refused with a message saying so.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import optree
import torch

from functional_bagua import tree


def _escaped(entry: object) -> str:
    return str(entry).replace("%", "%25").replace("/", "%2F")


def _key(accessor: optree.PyTreeAccessor, skip: Callable[[Any], bool] = lambda entry: False) -> str:
    """The leaf's key: the entries of its path joined by ``/`` (those ``skip`` picks left out)."""
    return "/".join(_escaped(getattr(entry, "field", None) or entry.entry) for entry in accessor if not skip(entry))


def _keyed_leaves(state: Any) -> tuple[list[str], list[optree.PyTreeAccessor], list, optree.PyTreeSpec]:
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


def _must_match(accessor: optree.PyTreeAccessor) -> bool:
    """Whether the leaf at ``accessor`` is a field its state type lists in ``must_match_on_load()``."""
    if not len(accessor):
        return False
    last = accessor[-1]
    field = getattr(last, "field", None)
    must_match = getattr(last.type, "must_match_on_load", None)
    return field is not None and must_match is not None and field in must_match()


def state_dict(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` by key (``None`` leaves are left out).

    Args:
        state: an optimizer state, as ``tx.init`` or ``tx.update`` returns it; every leaf must be a
            tensor or ``None`` (a TypeError names another).

    Returns:
        A new dict whose values are the state's tensors themselves (not copies).

    Raises:
        ValueError: when two tensors of the state would get the same key (module docstring).
    """
    keys, _, leaves, _ = _keyed_leaves(state)
    out = {}
    for key, leaf in zip(keys, leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"state_dict: state leaf {key!r} is a {type(leaf).__name__}, not a tensor")
        out[key] = leaf
    return out


def load_state_dict(template: Any, flat: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """``template`` (e.g. ``tx.init(params)``) with its tensors replaced by copies of those of ``flat``.

    Args:
        template: a state of the optimizer to load into, as its ``init`` makes it.
        flat: a dict made by :func:`state_dict` (from ``torch.load``).
        strict: with ``True`` every key must be in both; a key missing from ``flat``, or one that
            ``template`` lacks, raises a ValueError naming it and, where the checkpoint is the state
            of a part of this optimizer (or the other way round; e.g. saved with a constant ``lr``
            and loaded after switching ``lr`` to a schedule, which adds ``inject_hyperparams``' count
            and hyperparameters around the same state), says so. With ``False`` the tensors found
            are loaded (through that part, where one matches), the others keep the template's
            values, and a warning lists both kinds of keys.

    Also raises a ValueError for a tensor of another shape or dtype, and for a
    ``must_match_on_load()`` field whose value differs from the template's (module docstring).
    Tensors are copied to the template's devices.

    Example::

        state = fb.load_state_dict(tx.init(params), torch.load("opt.pt"))
    """
    keys, accessors, leaves, spec = _keyed_leaves(template)
    expected = [k for k, leaf in zip(keys, leaves) if leaf is not None]
    source = _source_keys(expected, flat)  # template key -> checkpoint key
    for key, accessor, leaf in zip(keys, accessors, leaves):  # first: a checkpoint that belongs elsewhere
        if leaf is not None and key in source and _must_match(accessor):
            _refuse_if_elsewhere(key, flat[source[key]], leaf)
    missing = [k for k in expected if k not in source]
    unexpected = sorted(set(flat) - set(source.values()))
    if missing or unexpected:
        problem = _mismatch(missing, unexpected, _nesting(expected, flat))
        stored = _stored_otherwise(expected, list(flat))
        if strict and stored is not None:
            raise ValueError(f"load_state_dict: {problem}; {stored}")
        if strict:
            raise ValueError(
                f"load_state_dict: {problem}; pass strict=False to load the tensors found and keep the rest"
            )
        warnings.warn(f"load_state_dict: {problem}; loaded the rest", UserWarning, stacklevel=2)
    new_leaves = []
    for key, leaf in zip(keys, leaves):
        if leaf is None or key not in source:
            new_leaves.append(leaf)
            continue
        value = flat[source[key]]
        if not isinstance(value, torch.Tensor) or value.shape != leaf.shape or value.dtype != leaf.dtype:
            got = (
                f"{type(value).__name__}"
                if not isinstance(value, torch.Tensor)
                else f"{value.dtype} {tuple(value.shape)}"
            )
            raise ValueError(
                f"load_state_dict: {key!r} is {got} in the checkpoint, the state expects {leaf.dtype} {tuple(leaf.shape)}"
            )
        new_leaves.append(value.detach().to(leaf.device, copy=True))
    return spec.unflatten(new_leaves)


def _refuse_if_elsewhere(key: str, value: Any, leaf: torch.Tensor) -> None:
    """Raise unless a ``must_match_on_load()`` field's saved ``value`` equals the template's."""
    if not isinstance(value, torch.Tensor) or value.shape != leaf.shape or not torch.equal(value.to(leaf.device), leaf):
        shown = value.tolist() if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"load_state_dict: {key!r} is {shown} in the checkpoint, {leaf.tolist()} in this state: the "
            "checkpoint belongs elsewhere (another rank's shard, or another world size); load each rank's own file"
        )


def _nesting(expected: list, flat: dict) -> Optional[tuple[str, str]]:
    """``(prefix, side)`` when one state is a part of the other: every checkpoint key is a template
    key under ``prefix`` (``side = "template"``: the template holds the checkpoint's state inside
    it), or every template key is a checkpoint key under ``prefix`` (``side = "checkpoint"``);
    else ``None``."""
    for outer, inner, side in ((expected, list(flat), "template"), (list(flat), expected, "checkpoint")):
        outer_keys = set(outer)
        for prefix in sorted({k[: k.index("/") + 1] for k in outer if "/" in k}):
            if inner and all(prefix + k in outer_keys for k in inner):
                return prefix, side
    return None


def _source_keys(expected: list, flat: dict) -> dict:
    """Which checkpoint key each template key loads from: the same key, or the same key through a
    :func:`_nesting` prefix."""
    nesting = _nesting(expected, flat) if not set(expected) <= set(flat) else None
    if nesting is None:
        return {k: k for k in expected if k in flat}
    prefix, side = nesting
    if side == "template":
        return {k: k[len(prefix) :] for k in expected if k.startswith(prefix) and k[len(prefix) :] in flat}
    return {k: prefix + k for k in expected if prefix + k in flat}


# the last key parts under which low_precision_state stores an encoded tensor, and how
_STORED_FORMS = {"codes": "8-bit codes", "scales": "8-bit codes", "value": "bfloat16", "correction": "bfloat16"}


def _forms(keys: list) -> set:
    found = {_STORED_FORMS[k.rsplit("/", 1)[-1]] for k in keys if k.rsplit("/", 1)[-1] in _STORED_FORMS}
    if any(k.endswith("/correction") for k in keys):
        found = (found - {"bfloat16"}) | {"bfloat16 with 8-bit corrections"}
    return found


def _stem(key: str) -> str:
    """``key`` without an encoded form's last part and without ``low_precision_state``'s
    ``inner`` level: the same for a tensor stored plain and encoded."""
    parts = key.split("/")
    if parts[-1] in _STORED_FORMS:
        parts = parts[:-1]
    return "/".join(part for part in parts if part != "inner")


def _stored_otherwise(template_keys: list, checkpoint_keys: list) -> Optional[str]:
    """What to say when the two states hold the same tensors stored otherwise (encoded by
    ``low_precision_state`` in one, with another codec or none in the other: the keys agree but
    for the encoded forms' parts and the wrapper's own count); ``None`` otherwise."""
    here, there = _forms(template_keys), _forms(checkpoint_keys)
    differing = {_stem(k) for k in template_keys} ^ {_stem(k) for k in checkpoint_keys}
    if here == there or any(k.rsplit("/", 1)[-1] != "count" for k in differing):
        return None
    described = lambda forms: "as " + " and ".join(sorted(forms)) if forms else "as plain tensors"  # noqa: E731
    return (
        f"the checkpoint stores state tensors {described(there)}, this optimizer {described(here)}: it was saved "
        "with another low_precision_state codec, or with none (or the other way round). Build the optimizer as the "
        "checkpoint was saved to resume it (strict=False would keep this state's fresh values in place of the "
        "saved ones)"
    )


def _mismatch(missing: list, unexpected: list, nesting: Optional[tuple[str, str]]) -> str:
    parts = []
    if nesting is not None:
        prefix, side = nesting
        if side == "template":
            parts.append(
                f"the checkpoint is the state of this optimizer's {prefix!r} part (saved without what surrounds it "
                "here, e.g. with a constant lr where this optimizer has a schedule, which adds inject_hyperparams' "
                "count and hyperparameters); loading puts its tensors there, and the count starts at 0 (set "
                "state.count to resume a schedule)"
            )
        else:
            parts.append(
                f"this optimizer's state is the checkpoint's {prefix!r} part (the checkpoint was saved with more "
                "around it, e.g. with a schedule where this optimizer has a constant lr)"
            )
    if missing:
        parts.append(f"key {missing[0]!r} is missing from the checkpoint ({len(missing)} missing)")
    if unexpected:
        parts.append(f"checkpoint key {unexpected[0]!r} is not in this optimizer's state ({len(unexpected)} not in it)")
    return "; ".join(parts)
