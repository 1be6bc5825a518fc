"""The core contract: gradient transformations, chaining, applying updates.

A :class:`GradientTransformation` is a pair of pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)          # params + updates, leaf by leaf

``params``, ``grads`` and ``updates`` are pytrees of tensors with the same structure (a flat
``{name: tensor}`` dict is the canonical one); ``state`` is a pytree of tensors too, so it can be
checkpointed, moved and traced. ``update`` never mutates its arguments.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from functional_bagua import checks, foreach, ownership, tree
from functional_bagua.compiling import own_code
from functional_bagua.leaf_lists import LeafLists

Params = Any
Updates = Any
OptState = Any

TransformInitFn = Callable[[Params], OptState]
TransformUpdateFn = Callable[[Updates, OptState, Optional[Params]], "tuple[Updates, OptState]"]


class GradientTransformation(NamedTuple):
    """A pure optimizer (or a piece of one): ``init(params) -> state`` and
    ``update(grads, state, params=None) -> (updates, new_state)``."""

    init: TransformInitFn
    update: TransformUpdateFn


class EmptyState(NamedTuple):
    """State of a transform that keeps none."""


def identity() -> GradientTransformation:
    """The transform that returns the gradients unchanged: ``u = g``."""

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Optional[Params] = None) -> tuple[Updates, EmptyState]:
        del params
        return grads, state

    def on_lists(x: LeafLists, state: EmptyState, overwrite: bool) -> tuple[list, EmptyState]:
        del overwrite
        return x.updates, state

    update.on_lists = on_lists  # type: ignore[attr-defined]  # a chain's link on lists (leaf_lists)
    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transforms left to right: ``u = t_n(... t_2(t_1(g)))``.

    The state is the tuple of the inner states, in order.

    Example::

        tx = chain(add_decayed_weights(1e-4), trace(momentum=0.9), scale_by_learning_rate(0.1))

    Args:
        *transforms: the transforms to compose, in the order they apply; each must be a
            :class:`GradientTransformation` (a TypeError names the first that is not).

    Returns:
        A :class:`GradientTransformation` whose ``init`` checks ``params`` (``check_params``) and
        whose ``update`` passes ``params`` on to every inner ``update``.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation")

    # every link elementwise (on_lists), at least one checking its input: the chain runs them on lists
    names = [getattr(t.update, "input_name", None) for t in transforms]  # who checks its input
    next_names = [next((n for n in names[k + 1 :] if n), None) for k in range(len(transforms))]
    first_name = next((n for n in names if n), "")
    link_runs: list[Any] = [getattr(t.update, "on_lists", None) for t in transforms]
    on_lists = first_name != "" and all(run is not None for run in link_runs)
    needs_params = any(getattr(t.update, "needs_params", False) for t in transforms)
    kept_key = ("chain", transforms)  # where fb.Optimizer keeps its lists for the next step (LeafLists.kept_or_of)

    def init(params: Params) -> tuple[OptState, ...]:
        check_params(params, "init")
        states = tuple(t.init(params) for t in transforms)
        # a distributed transform in the chain: every rank must have built the rest with the same numbers
        agree = [t.update.agree_on_chain for t in transforms if hasattr(t.update, "agree_on_chain")]
        if agree and not torch.compiler.is_compiling():
            agree[0](hyperparameters_of(transforms, states))
        return states

    def update(
        updates: Updates, state: tuple[OptState, ...], params: Optional[Params] = None
    ) -> tuple[Updates, tuple[OptState, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state that is not a tuple of "
                f"{len(transforms)} inner states; was it made by this chain's init?"
            )
        new_state = []
        owned = ownership.granted_to(update)  # the updates given may be overwritten (ownership module)
        given = ownership.state_given_to(update)  # so may the state: then each link's too
        # checked and grouped once (leaf_lists module); without the params a link needs, the links
        # one by one raise (each in its turn, as always)
        if on_lists and foreach.grouped_enabled() and not (needs_params and params is None):
            x = LeafLists.kept_or_of(kept_key, updates, params, who=first_name)
            for t, run, s, next_name in zip(transforms, link_runs, state, next_names):
                with ownership.giving_state(t.update if given else None):
                    leaves, s = run(x, s, owned)
                if leaves is not x.updates:  # a result checked where the next link would check its input
                    x = x.followed_by(leaves, who=next_name) if next_name else x._replace(updates=leaves)
                owned = ownership.returns_fresh_updates(t)
                new_state.append(s)
            return x.unflatten(x.updates), tuple(new_state)
        for t, s in zip(transforms, state):
            with ownership.giving_state(t.update if given else None):
                updates, s = ownership.update_owning(t, owned, updates, s, params)
            owned = ownership.returns_fresh_updates(t)
            new_state.append(s)
        return updates, tuple(new_state)

    update.transforms = transforms  # type: ignore[attr-defined]  # what it chains, for make_train_step
    update.fresh_updates = len(transforms) > 0 and ownership.returns_fresh_updates(transforms[-1])  # type: ignore[attr-defined]
    # a code object per chain: torch.compile(tx.update) of one chain does not count against another's
    # recompile limit (dynamo's compiled code is kept per code object; each chain recompiles it)
    return GradientTransformation(init, own_code(update))


def hyperparameters_of(
    transforms: Sequence[GradientTransformation], states: Sequence[OptState], prefix: str = ""
) -> dict:
    """The numbers a chain was built with, ``{where: value}``: each alias's arguments (as it
    was called) and each injected hyperparameter's value in its state, keyed by the position in
    the (nested) chain and the name (``"1:adamw.lr"``, ``"2:lr"``); schedules by their name.
    Transforms built from other building blocks add nothing (their numbers are in closures).

    Args:
        transforms: the chain's transforms.
        states: their states, from ``init``.
        prefix: the position of this chain inside an outer one (``"1."``).
    """
    found: dict = {}
    for i, (t, s) in enumerate(zip(transforms, states)):
        where = f"{prefix}{i}"
        built = getattr(t.update, "built_from", None)
        if built is not None:
            factory, arguments = built
            found.update({f"{where}:{factory.__name__}.{k}": _plain(v) for k, v in arguments.items()})
        held = getattr(s, "hyperparams", None)  # an InjectHyperparamsState
        if isinstance(held, dict):
            found.update({f"{where}:{k}": _plain(v) for k, v in held.items()})
        inner = getattr(t.update, "transforms", None)
        if inner is not None and isinstance(s, tuple):
            found.update(hyperparameters_of(inner, s, f"{where}."))
    return found


def _plain(value: Any) -> Any:
    """A hyperparameter as a comparable, picklable value: a tensor's numbers, a schedule's name."""
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    return value if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


def check_params(params: Params, who: str) -> None:
    """Raise naming the first leaf of ``params`` that is not a trainable tensor (a dense
    floating-point or complex one; ``None`` leaves stand for no parameter).

    Args:
        params: a pytree of parameters; its ``None`` leaves are skipped.
        who: the caller's name (e.g. ``"init"``), which starts the error message.

    Raises:
        TypeError: for a leaf that is not a tensor, not dense, or neither floating-point nor complex.
    """
    leaves, spec = tree.flatten(params)
    for i, p in enumerate(leaves):
        if p is not None:
            checks.check_param(p, functools.partial(tree.leaf_name, spec, i), who)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates`` leaf by leaf, pure; a ``None`` update leaves its parameter as it is.

    Each result keeps its parameter's dtype (a bf16 parameter stays bf16 whatever the update's
    dtype; the sum is formed in the wider of the two and rounded once). An update must have its
    parameter's shape and be dense and floating-point (``functional_bagua.checks``): a wrong one
    raises a ValueError/TypeError naming the parameter, never broadcasts.

    Args:
        params: a pytree of parameter tensors (not changed).
        updates: a pytree of the structure of ``params`` (a ValueError names the keys that differ),
            e.g. the first result of ``tx.update``; a ``None`` leaf leaves its parameter as it is.

    Returns:
        A new tree of the structure of ``params`` holding the updated parameters.
    """
    param_leaves, spec = tree.flatten(params)
    update_leaves = tree.leaves_matching(spec, updates, "updates", "params")
    checks.check_updates(update_leaves, param_leaves, functools.partial(tree.leaf_name, spec), "apply_updates")
    new_leaves = list(param_leaves)  # a None update leaves its parameter
    pending = [i for i, u in enumerate(update_leaves) if u is not None]
    if foreach.grouped_enabled():  # one multi-tensor add per device and dtypes
        ran, pending = foreach.run_groups(
            _add_keeping_dtype, [param_leaves, update_leaves], pending, key=lambda i: update_leaves[i].dtype
        )
        for members, sums in ran:
            for i, total in zip(members, sums):
                new_leaves[i] = total
    for i in pending:
        new_leaves[i] = _add_keeping_dtype(param_leaves[i], update_leaves[i])
    return spec.unflatten(new_leaves)


def apply_updates_(params: Params, updates: Updates, alpha: float = 1.0) -> None:
    """``params += alpha * updates`` leaf by leaf, in place: with ``alpha = 1`` the numbers of
    :func:`apply_updates` (each sum formed in the wider dtype and rounded once into the
    parameter's), written into the parameters' own tensors: one pass over them instead of a sum
    and a copy. Another ``alpha`` is the factor of a chain's last link (a learning rate) taken
    into the same pass, as torch.optim's ``p.add_(u, alpha=-lr)``: the product is not rounded
    apart, so the bits may differ from adding ``updates * alpha`` by one rounding.

    Args:
        params: a pytree of parameter tensors, overwritten.
        updates: a pytree of the structure of ``params``, checked as :func:`apply_updates` checks
            it; a ``None`` leaf leaves its parameter as it is.
        alpha: the factor of the updates, a number.
    """
    param_leaves, spec = tree.flatten(params)
    update_leaves = tree.leaves_matching(spec, updates, "updates", "params")
    checks.check_updates(update_leaves, param_leaves, functools.partial(tree.leaf_name, spec), "apply_updates_")
    pending = [i for i, u in enumerate(update_leaves) if u is not None]
    # 0-dim ones by an indexed store (tree.copy_into: compiled graphs drop in-place ops on them)
    scalars = [i for i in pending if param_leaves[i].dim() == 0]
    if scalars:
        tree.copy_into(
            [param_leaves[i] for i in scalars],
            [_add_keeping_dtype(param_leaves[i], update_leaves[i], alpha) for i in scalars],
        )
    others = [i for i in pending if param_leaves[i].dim() != 0]
    if others and alpha == 1:
        torch._foreach_add_([param_leaves[i] for i in others], [update_leaves[i] for i in others])
    elif others:
        torch._foreach_add_([param_leaves[i] for i in others], [update_leaves[i] for i in others], alpha=alpha)


def _add_keeping_dtype(p: torch.Tensor, u: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return (torch.add(p, u) if alpha == 1 else torch.add(p, u, alpha=alpha)).to(p.dtype)
