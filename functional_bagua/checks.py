"""What parameters, gradients and updates must be, checked where every update passes.

A wrong input either works as torch.optim would or raises, naming the tensor and the fix; it is
never broadcast, truncated or dropped:

- a parameter is a dense (strided) tensor of a floating-point or complex dtype. Integer
  parameters cannot move (torch refuses ``requires_grad`` on them); leave them out of the tree.
- a gradient has its parameter's shape and dtype and is dense.
- an update (what :func:`~functional_bagua.apply_updates` adds) has its parameter's shape and is
  dense and floating-point (complex for a complex parameter); its float dtype may differ, since
  the sum is rounded to the parameter's dtype once (mixed precision).

Every building block runs these checks (:func:`~functional_bagua.leafwise`,
:func:`~functional_bagua.stateless`, ``apply_updates``), so a chain of them, and every optimizer,
checks its input before any math that could broadcast it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

STRIDED = torch.strided


def trainable_dtype(dtype: torch.dtype) -> bool:
    """Floating point or complex: the dtypes whose tensors can have gradients."""
    return dtype.is_floating_point or dtype.is_complex


def check_param(p, name: Callable[[], str], who: str, *, complex_ok: bool = True) -> None:
    """Raise naming the parameter (``name()``, computed only on failure) unless ``p`` is a dense
    floating-point (or, with ``complex_ok``, complex) tensor."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(
            f"{who}: parameter {name()!r} is a {type(p).__name__}, not a tensor; a params tree holds tensors "
            "only (fb.params_of(model) gives the trainable ones)"
        )
    if p.layout is not STRIDED:
        raise TypeError(f"{who}: parameter {name()!r} is {_layout(p)}; optimizers update dense tensors only")
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


def check_grad(g, p: Optional[torch.Tensor], name: Callable[[], str], who: str, *, complex_ok: bool = True) -> None:
    """Raise naming the parameter unless ``g`` can be its gradient: a dense tensor of the shape
    and dtype of ``p``, which is a trainable parameter (a gradient of a trainable dtype when
    ``p`` is ``None``)."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{who}: gradient of {name()!r} is a {type(g).__name__}, not a tensor")
    if g.layout is not STRIDED:
        raise TypeError(
            f"{who}: gradient of {name()!r} is {_layout(g)}; sparse gradients are not supported "
            "(convert it with .to_dense(), or use a dense embedding)"
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
    if not trainable_dtype(g.dtype) or (g.is_complex() and not complex_ok):
        if p is not None:
            check_param(p, name, who, complex_ok=complex_ok)
        if not trainable_dtype(g.dtype):
            raise TypeError(f"{who}: gradient of {name()!r} is {g.dtype}; gradients are floating-point or complex")
        check_param(g, name, who, complex_ok=False)


def check_update(u, p: torch.Tensor, name: Callable[[], str], who: str) -> None:
    """Raise naming the parameter unless ``p + u`` is an update of ``p`` (module docstring)."""
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"{who}: update of {name()!r} is a {type(u).__name__}, not a tensor")
    check_param(p, name, who)
    if u.layout is not STRIDED:
        raise TypeError(f"{who}: update of {name()!r} is {_layout(u)}; updates are dense tensors")
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


def _layout(t: torch.Tensor) -> str:
    return str(t.layout).removeprefix("torch.").replace("_", " ")
