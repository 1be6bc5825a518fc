"""What parameters, gradients and updates must be, checked where every update passes.

A wrong input either works as torch.optim would or raises, naming the tensor and the fix; it is
never broadcast, truncated or dropped:

- a parameter is a dense (strided) tensor of a floating-point or complex dtype. Integer
  parameters cannot move (torch refuses ``requires_grad`` on them); leave them out of the tree.
- a gradient has its parameter's shape and dtype and is dense (sparse COO for the transforms made
  for sparse gradients).
- an update (what :func:`~functional_bagua.apply_updates` adds) has its parameter's shape and is
  floating-point (complex for a complex parameter), dense or sparse COO (the update of
  :func:`~functional_bagua.sparse_adam`); its float dtype may differ, since the sum is rounded to
  the parameter's dtype once (mixed precision).

Every building block runs these checks (:func:`~functional_bagua.leafwise`,
:func:`~functional_bagua.stateless`, ``apply_updates``), so a chain of them, and every optimizer,
checks its input before any math that could broadcast it. A chain of elementwise blocks checks
its input once and then only that each link's result keeps every leaf's shape and dtype
(:mod:`functional_bagua.leaf_lists`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Iterator
from itertools import compress
from typing import Callable, Optional

import torch

STRIDED = torch.strided
_GETTERS: dict[str, operator.attrgetter] = {}


def read_each(name: str, tensors: Iterable) -> list:
    """``[getattr(t, name) for t in tensors]``: eagerly one pass in C (``operator.attrgetter``;
    an eager step reads its tensors' shapes and dtypes at every step), traced the comprehension
    (dynamo does not trace ``attrgetter``).

    Args:
        name: the attribute to read (``"shape"``, ``"dtype"``...).
        tensors: the tensors (or anything with the attribute) to read it of.
    """
    if torch.compiler.is_compiling():
        return [getattr(t, name) for t in tensors]
    getter = _GETTERS.get(name)
    if getter is None:
        getter = _GETTERS[name] = operator.attrgetter(name)
    return list(map(getter, tensors))


def params_instead(x: object) -> str:
    """What to pass instead of ``x`` where a params tree belongs."""
    if isinstance(x, torch.nn.Module):
        return "pass fb.params_of(model), the dict of the module's trainable parameters by name"
    if isinstance(x, Iterator):
        return "pass fb.params_of(model), a dict by name, not model.parameters() (an iterator, used up once read)"
    return "a params tree holds tensors only (fb.params_of(model) gives a module's trainable ones)"


def trainable_dtype(dtype: torch.dtype) -> bool:
    """Floating point or complex: the dtypes whose tensors can have gradients."""
    return dtype.is_floating_point or dtype.is_complex


def check_param(p: object, name: Callable[[], str], who: str, *, complex_ok: bool = True) -> None:
    """Raise naming the parameter (``name()``, computed only on failure) unless ``p`` is a dense
    floating-point (or, with ``complex_ok``, complex) tensor."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{who}: parameter {name()!r} is a {type(p).__name__}, not a tensor; {params_instead(p)}")
    if p.layout != STRIDED:
        raise TypeError(f"{who}: parameter {name()!r} is {_layout_name(p)}; optimizers update dense tensors only")
    if not trainable_dtype(p.dtype):
        raise TypeError(
            f"{who}: parameter {name()!r} is {p.dtype}; only floating-point and complex parameters can be "
            "optimized (torch refuses requires_grad on integer tensors). Leave it out of the params tree, "
            "as fb.params_of does"
        )
    if p.is_complex() and not complex_ok:
        raise TypeError(
            f"{who}: parameter {name()!r} is {p.dtype}; this transform computes per-tensor norms or shapes, "
            "which are not defined for complex tensors here. Use torch.view_as_real(p) as the parameter, "
            "or an elementwise optimizer (sgd, adam, adamw, rmsprop, ...)"
        )


def check_grad(
    g: object,
    p: Optional[torch.Tensor],
    name: Callable[[], str],
    who: str,
    *,
    complex_ok: bool = True,
    layout: torch.layout = STRIDED,
) -> None:
    """Raise naming the parameter unless ``g`` can be its gradient: a tensor of ``layout`` (dense,
    or ``torch.sparse_coo`` for transforms made for sparse gradients) of the shape and dtype of
    ``p``, which is a trainable parameter (a gradient of a trainable dtype when ``p`` is ``None``)."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{who}: gradient of {name()!r} is a {type(g).__name__}, not a tensor")
    if g.layout != layout and layout == STRIDED:
        raise TypeError(
            f"{who}: gradient of {name()!r} is {_layout_name(g)}; sparse gradients are not supported "
            "(convert it with .to_dense(), or use a dense embedding; fb.sparse_adam takes sparse COO gradients)"
        )
    if g.layout != layout:
        raise TypeError(
            f"{who}: gradient of {name()!r} is {_layout_name(g)}; {who} takes sparse COO gradients only (such as "
            "nn.Embedding(sparse=True) makes); use adam for dense ones"
        )
    if p is not None:
        if g.shape != p.shape:
            raise ValueError(
                f"{who}: gradient of {name()!r} has shape {tuple(g.shape)}, parameter has {tuple(p.shape)}; "
                "a gradient must have its parameter's shape (it is never broadcast)"
            )
        if g.dtype != p.dtype:
            raise TypeError(
                f"{who}: gradient of {name()!r} is {g.dtype}, parameter is {p.dtype}; cast the gradient "
                f"(g.to({p.dtype})) or keep the parameter in the gradient's dtype"
            )
    if not trainable_dtype(g.dtype):
        if p is not None:
            check_param(p, name, who)  # the parameter is of g's dtype: say that it cannot be trained
        raise TypeError(f"{who}: gradient of {name()!r} is {g.dtype}; gradients are floating-point or complex")
    if g.is_complex() and not complex_ok:
        check_param(g, name, who, complex_ok=False)


def check_update(u: object, p: torch.Tensor, name: Callable[[], str], who: str) -> None:
    """Raise naming the parameter unless ``p + u`` is an update of ``p`` (module docstring)."""
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"{who}: update of {name()!r} is a {type(u).__name__}, not a tensor")
    check_param(p, name, who)
    if u.layout not in (STRIDED, torch.sparse_coo):
        raise TypeError(f"{who}: update of {name()!r} is {_layout_name(u)}; updates are dense or sparse COO tensors")
    if u.shape != p.shape:
        raise ValueError(
            f"{who}: update of {name()!r} has shape {tuple(u.shape)}, parameter has {tuple(p.shape)}; "
            "an update must have its parameter's shape (it is never broadcast)"
        )
    if not trainable_dtype(u.dtype) or u.is_complex() != p.is_complex():
        raise TypeError(
            f"{who}: update of {name()!r} is {u.dtype} for a {p.dtype} parameter; an update is floating-point "
            "for a real parameter and complex for a complex one (was the gradient an integer tensor?)"
        )


def check_grads(
    grads: list,
    params: list,
    name: Callable[[int], str],
    who: str,
    *,
    complex_ok: bool = True,
    layout: torch.layout = STRIDED,
) -> None:
    """:func:`check_grad` for lists of leaves (``None`` gradients skipped; ``params`` may hold
    ``None`` where there is no reference); ``name(i)`` names leaf ``i``. A few passes over all
    leaves confirm equal shapes and dtypes, dense layouts and trainable dtypes; only when one
    fails are the leaves looked at one by one, to name the first wrong one."""
    present = [g is not None for g in grads]
    if _all_fit(list(compress(grads, present)), list(compress(params, present)), complex_ok, layout):
        return
    for i, (g, p) in enumerate(zip(grads, params)):
        if g is not None:
            check_grad(g, p, functools.partial(name, i), who, complex_ok=complex_ok, layout=layout)


def check_updates(updates: list, params: list, name: Callable[[int], str], who: str) -> None:
    """:func:`check_update` for lists of leaves (``None`` updates skipped), with the same fast path
    as :func:`check_grads` for updates of their parameter's dtype."""
    present = [u is not None for u in updates]
    if _all_fit(list(compress(updates, present)), list(compress(params, present)), True, STRIDED):
        return
    for i, (u, p) in enumerate(zip(updates, params)):
        if u is not None:
            check_update(u, p, functools.partial(name, i), who)


def _all_fit(gs: list, ps: list, complex_ok: bool, layout: torch.layout) -> bool:
    """All tensors of ``layout``, of a trainable dtype, and of their parameter's shape and dtype
    (any shape when no parameters were given at all). Each check is one pass over the leaves
    (an eager step asks at every step)."""
    if not all(isinstance(g, torch.Tensor) for g in gs):
        return False
    dtypes = read_each("dtype", gs)
    if any(p is not None for p in ps) and not _same_shapes_and_dtypes(gs, dtypes, ps):
        return False
    return set(read_each("layout", gs)) <= {layout} and all(
        trainable_dtype(d) and (complex_ok or not d.is_complex) for d in set(dtypes)
    )


def _same_shapes_and_dtypes(gs: list, dtypes: list, ps: list) -> bool:
    return (
        all(isinstance(p, torch.Tensor) for p in ps)
        and read_each("shape", gs) == read_each("shape", ps)
        and dtypes == read_each("dtype", ps)
    )


def _layout_name(t: torch.Tensor) -> str:
    return "dense" if t.layout == STRIDED else str(t.layout).removeprefix("torch.").replace("_", " ")
