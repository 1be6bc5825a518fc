"""Whole training steps: forward, backward and the optimizer update as one pure function.

``make_train_step(model, loss_fn, tx)`` builds::

    step(params, state, batch) -> (params, state, loss)

    (loss, buffers'), grads = grad_and_value(loss_of)(params)     # torch.func, w.r.t. params only
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

with ``loss_of(params) = loss_fn(functional_call(model, (params, buffers), inputs), targets)``
for ``batch = (inputs, targets)``: ``loss_fn(outputs, targets)`` gets the model's output and the
batch's targets, as ``torch.nn.functional.cross_entropy`` takes them. ``inputs`` is one tensor
(``model(inputs)``), a tuple of positional arguments (``model(*inputs)``) or a dict of keyword
arguments (``model(**inputs)``). Compiled (``compile=True``, the default) the step is one
``torch.compile(fullgraph=True)`` graph: forward, backward and update fused together;
hyperparameters and schedules are tensors in ``state``, so changing them never recompiles.

Buffers (BatchNorm running statistics) are read from ``model`` and written back into it after
each step, as eager training would leave them. With ``layout`` (a :class:`~functional_bagua.FlatLayout`)
``params`` are flat buffers and ``tx`` runs fused over them (:func:`~functional_bagua.fuse`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from functional_bagua.base import GradientTransformation, OptState, apply_updates
from functional_bagua.flat import FlatLayout
from functional_bagua.fusion import fuse
from functional_bagua.tree import PyTree


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tx: GradientTransformation,
    *,
    compile: Union[bool, dict] = True,
    layout: Optional[FlatLayout] = None,
) -> Callable:
    """``step(params, state, batch) -> (params, state, loss)`` (module docstring).

    ``compile``: ``True`` for ``torch.compile(fullgraph=True)``, ``False`` for eager, or a dict
    of ``torch.compile`` keyword arguments (``{"backend": "eager"}``, ``{"mode": "max-autotune"}``).
    ``state`` comes from ``tx.init(params)`` (``fuse(tx, layout).init(flat)`` with a layout).

    Example::

        step = fb.make_train_step(model, torch.nn.functional.cross_entropy, fb.adamw(1e-3))
        params = fb.params_of(model)
        state = fb.adamw(1e-3).init(params)
        for batch in loader:
            params, state, loss = step(params, state, batch)

    Args:
        model: the module whose forward the step runs (``torch.func.functional_call`` with ``params``
            and its buffers); its buffers are read before each step and written back after it.
        loss_fn: ``loss_fn(outputs, targets)``, the loss as a 0-dim tensor; it gets the model's
            output and the batch's targets.
        tx: the optimizer whose ``update`` the step applies (fused over ``layout`` when one is given).
        compile: ``True``, ``False`` or a dict of ``torch.compile`` keyword arguments (above).
        layout: a :class:`~functional_bagua.FlatLayout`: ``params`` are then its flat buffers and ``tx``
            runs as ``fuse(tx, layout)``; ``None`` (default) for a parameter tree.
    """
    update = (fuse(tx, layout) if layout is not None else tx).update
    to_tree = layout.unflatten if layout is not None else (lambda params: params)

    def loss_of(
        params: PyTree, buffers: dict[str, torch.Tensor], inputs: Any, targets: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        buffers = {k: b.clone() for k, b in buffers.items()}  # the forward may update them in place
        args, kwargs = model_arguments(inputs)
        out = torch.func.functional_call(model, (to_tree(params), buffers), args, kwargs)
        return loss_fn(out, targets), buffers

    value_and_grad = torch.func.grad_and_value(loss_of, has_aux=True)

    def pure_step(
        params: PyTree, state: OptState, batch: Any, buffers: dict[str, torch.Tensor]
    ) -> tuple[PyTree, OptState, torch.Tensor, dict[str, torch.Tensor]]:
        inputs, targets = batch
        grads, (loss, new_buffers) = value_and_grad(params, buffers, inputs, targets)
        updates, state = update(grads, state, params)
        return apply_updates(params, updates), state, loss.detach(), new_buffers

    if compile:
        pure_step = torch.compile(pure_step, fullgraph=True, **(compile if isinstance(compile, dict) else {}))

    def step(params: PyTree, state: OptState, batch: Any) -> tuple[PyTree, OptState, torch.Tensor]:
        check_batch(batch)
        buffers = dict(model.named_buffers())
        params, state, loss, new_buffers = pure_step(params, state, batch, buffers)
        with torch.no_grad():
            for name, value in new_buffers.items():
                buffers[name].copy_(value)
        return params, state, loss

    return step


def model_arguments(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for the model: a tuple is positional arguments, a dict keyword arguments,
    anything else the single argument.

    Args:
        inputs: the first item of a batch: a tuple, a dict, or a single value (e.g. a tensor).
    """
    if isinstance(inputs, dict):
        return (), inputs
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def check_batch(batch: object) -> None:
    """Raise naming the fix unless ``batch`` is a pair ``(inputs, targets)``.

    Args:
        batch: what the step was given as its batch: a tuple or list of two items passes.

    Raises:
        TypeError: for a dict, for anything that is not a tuple or list, or for one of another length.
    """
    if isinstance(batch, dict) or not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a dict with keys {sorted(batch)}" if isinstance(batch, dict) else f"a {type(batch).__name__}"
        if isinstance(batch, (tuple, list)):
            got += f" of {len(batch)} items"
        raise TypeError(
            f"make_train_step: batch is {got}; pass (inputs, targets), where inputs is a tensor, a tuple of the "
            "model's positional arguments or a dict of its keyword arguments, and loss_fn(outputs, targets) "
            "computes the loss"
        )
