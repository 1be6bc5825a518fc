"""A chain's input flattened, checked and grouped once, for links that work on lists of leaves.

Each building block (:func:`~functional_bagua.leafwise`, :func:`~functional_bagua.stateless`)
takes trees: it flattens its input, checks each gradient against its parameter, groups the
tensors by device and dtype, runs its rule once per group, and builds a tree of its result. In a
:func:`~functional_bagua.chain` of such blocks, the next link would flatten that tree again, check
it again and group it again, though only the values changed. The chain does this work once
instead: it makes a :class:`LeafLists` of its input, and each elementwise link takes the lists and
returns its updates as a list in the same order, shapes and dtypes, the next link's input::

    x = LeafLists.of(grads, params, who="scale_by_adam")   # flatten, check, group: once
    u, s1 = on_lists_1(x, s1, False)                       # each link: its rule per group
    x = x.followed_by(u, who="add_decayed_weights")        # the shapes compared, nothing regrouped

The links run the same rules on the same groups as one by one, so the numbers are the same bits.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, NamedTuple, Optional

import optree
import torch

from functional_bagua import accepted, checks, foreach, tree
from functional_bagua.tree import PyTree


class LeafLists(NamedTuple):
    """An update's leaves with their parameters, checked and grouped.

    Attributes:
        updates: the gradients or updates, one per leaf (``None`` where there is none).
        params: the parameters, one per leaf (all ``None`` when ``update`` got no ``params``).
        spec: the tree structure the leaves came from.
        groups: the indices of the leaves that run together (one device, dtype, and whether a
            parameter is given), as :func:`functional_bagua.foreach.groups` makes them.
        singles: the indices of the other leaves with an update (complex tensors, or all of them
            when the grouped path is off), which run one tensor at a time.
        params_given: whether ``update`` got ``params``.
        kinds: each update's ``(shape, dtype)`` (``None`` where there is no update), which every
            link's result keeps.
    """

    updates: list
    params: list
    spec: optree.PyTreeSpec
    groups: list
    singles: list
    params_given: bool
    kinds: list

    @classmethod
    def of(
        cls,
        updates: PyTree,
        params: Optional[PyTree],
        *,
        who: str,
        complex_ok: bool = True,
        layout: torch.layout = checks.STRIDED,
        grouped: bool = True,
    ) -> "LeafLists":
        """``updates`` (and ``params``) flattened, checked as ``who``'s input
        (:func:`functional_bagua.checks.check_grads`) and, with ``grouped``, grouped.

        Args:
            updates: a tree of gradients or updates.
            params: the parameter tree, the reference structure; ``None`` when not given.
            who: the transform named in error messages.
            complex_ok: whether complex tensors are accepted.
            layout: the layout gradients must have (``torch.strided``, or ``torch.sparse_coo``).
            grouped: whether to group the leaves; ``False`` puts every leaf in ``singles``.
        """
        if params is None:
            update_leaves, spec = tree.flatten(updates)
            param_leaves: list = [None] * len(update_leaves)
        else:
            update_leaves, param_leaves, spec = tree.leaves_with_params(updates, params)
        checks.check_grads(
            update_leaves,
            param_leaves,
            functools.partial(tree.leaf_name, spec),
            who,
            complex_ok=complex_ok,
            layout=layout,
        )
        present = [i for i, u in enumerate(update_leaves) if u is not None]
        groups = foreach.groups(update_leaves, present, key=lambda i: param_leaves[i] is None) if grouped else []
        singles = _outside(present, groups)
        return cls(update_leaves, param_leaves, spec, groups, singles, params is not None, _kinds(update_leaves))

    @classmethod
    def kept_or_of(
        cls, key: Any, updates: PyTree, params: Optional[PyTree], *, who: str, **options: Any
    ) -> "LeafLists":
        """:meth:`of` (``who`` and ``options`` its keywords); within ``fb.Optimizer``'s step
        (:func:`~functional_bagua.accepted.records_now`), the lists its last step made (kept under
        ``key``, the caller's own) with this step's tensors, where its checks would find the same:
        the same parameter objects (the optimizer's kept views), gradients with a gradient where
        there was one, of the same shapes, dtypes, devices and layouts (:class:`KeptLists`)."""
        arguments = (who, tuple(sorted(options.items())), params is not None)
        records = accepted.records_now()
        kept = records.get(key) if records is not None else None
        if kept is not None:
            x = kept.lists_for(updates, params, arguments)
            if x is not None:
                return x
        x = cls.of(updates, params, who=who, **options)
        if records is not None:
            records.pop(key, None)
            made = KeptLists.after(x, arguments)
            if made is not None:
                records[key] = made
        return x

    def followed_by(self, updates: list, *, who: str) -> "LeafLists":
        """These lists with the next link's input ``updates`` (the previous link's result, which
        keeps each leaf's shape and dtype): a ValueError/TypeError names a leaf that does not,
        as ``who``'s own input check would.

        Args:
            updates: the new updates, one per leaf, ``None`` where these have ``None``.
            who: the link that takes them, named in error messages.
        """
        try:
            kept = _kinds(updates) == self.kinds
        except AttributeError:  # a leaf that is not a tensor: check_grads names it
            kept = False
        if not kept:
            self._refuse(updates, who)
        return self._replace(updates=updates)

    def _refuse(self, updates: list, who: str) -> None:
        """Raise, naming the first leaf of ``updates`` that is not its predecessor's shape and
        dtype (as ``who``'s own input check: against the parameter where there is one)."""
        name = functools.partial(tree.leaf_name, self.spec)
        if self.params_given:
            checks.check_grads(updates, self.params, name, who)
        for i, (new, old) in enumerate(zip(updates, self.updates)):
            if new is None or old is None:
                if new is not old:
                    raise ValueError(f"{who}: the update of {name(i)!r} is {new!r} where its input was {old!r}")
                continue
            checks.check_grad(new, None, functools.partial(name, i), who)
            if (new.shape, new.dtype) != (old.shape, old.dtype):
                raise ValueError(
                    f"{who}: the update of {name(i)!r} is {new.dtype} of shape {tuple(new.shape)}, where the link "
                    f"before it was given {old.dtype} of shape {tuple(old.shape)}; a link of a chain keeps each "
                    "update's shape and dtype (its rule is elementwise)"
                )

    def unflatten(self, leaves: list) -> Any:
        """``leaves`` (one per leaf) in the tree structure these came from."""
        return self.spec.unflatten(leaves)


class KeptLists(NamedTuple):
    """The lists a checked step made (:meth:`LeafLists.kept_or_of`), for the next step on the
    same parameters: ``lists``, made with ``arguments`` (``of``'s, and whether parameters were
    given), whose updates at ``given`` (where there was one) had ``signatures``
    (:func:`~functional_bagua.accepted.signatures_of`); the updates themselves are not kept."""

    lists: LeafLists
    arguments: tuple
    given: list
    signatures: list

    @classmethod
    def after(cls, x: LeafLists, arguments: tuple) -> Optional["KeptLists"]:
        """What to keep of ``x`` (``None`` unless its updates are torch.Tensor objects)."""
        given = [u is not None for u in x.updates]
        signatures = accepted.signatures_of(list(itertools.compress(x.updates, given)))
        if signatures is None:
            return None
        # without this step's gradients (each step puts its own in): kept, they would outlive it
        return cls(x._replace(updates=[None] * len(x.updates)), arguments, given, signatures)

    def lists_for(self, updates: PyTree, params: Optional[PyTree], arguments: tuple) -> Optional[LeafLists]:
        """The kept lists with ``updates`` and ``params`` where :meth:`LeafLists.of` would make
        the same of them (:meth:`LeafLists.kept_or_of`); else ``None``."""
        x = self.lists
        if arguments != self.arguments:
            return None
        update_leaves, spec = tree.flatten_like(updates, x.spec)
        if spec != x.spec:
            return None
        param_leaves = [None] * len(update_leaves) if params is None else tree.one_pass_leaves(spec, params)
        if param_leaves is None or not all(map(operator.is_, param_leaves, x.params)):
            return None  # other parameter objects: checked anew
        if [u is not None for u in update_leaves] != self.given:
            return None
        present = list(itertools.compress(update_leaves, self.given))
        if accepted.signatures_of(present) != self.signatures:
            return None
        accepted.note_checked(present, self.signatures)
        return x._replace(updates=update_leaves, params=param_leaves)


def _kinds(updates: list) -> list:
    """Each update's ``(shape, dtype)``, ``None`` where there is none (one pass where every leaf
    has one)."""
    if any(u is None for u in updates):
        return [None if u is None else (u.shape, u.dtype) for u in updates]
    return list(zip(checks.read_each("shape", updates), checks.read_each("dtype", updates)))


def _outside(indices: list, groups: list) -> list:
    """The ``indices`` in none of the ``groups`` (which hold only some of them)."""
    if sum(len(members) for members in groups) == len(indices):
        return []
    grouped = {i for members in groups for i in members}
    return [i for i in indices if i not in grouped]
