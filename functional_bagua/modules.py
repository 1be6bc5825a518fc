"""Bridging ``torch.nn.Module`` and parameter pytrees.

The canonical parameter tree is a flat dict by qualified name, exactly the mapping
``torch.func.functional_call`` takes, so a pure training step reads::

    params = fb.params_of(model)
    loss, grads = torch.func.grad_and_value(
        lambda p: loss_fn(torch.func.functional_call(model, p, (x,)), y))(params)
    updates, state = tx.update(grads, state, params)
    params = fb.apply_updates(params, updates)
    fb.load_params(model, params)       # only when the stateful module needs the new values
"""

from __future__ import annotations

import torch


def params_of(module: torch.nn.Module, *, detach: bool = True) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``module`` as ``{qualified_name: tensor}``.

    Frozen parameters (``requires_grad=False``) are left out; they stay inside the module and
    ``torch.func.functional_call`` takes them from there. With ``detach=True`` (default) the
    tensors are detached aliases of the parameters (no copy), ready for ``torch.func``.

    Args:
        module: the module whose parameters to take (with the names ``named_parameters`` gives).
        detach: with ``True`` each value is ``p.detach()``; with ``False`` it is the
            ``Parameter`` object itself.

    Returns:
        A new dict; changing a tensor in place changes the module's parameter (they share storage).
    """
    return {name: (p.detach() if detach else p) for name, p in module.named_parameters() if p.requires_grad}


def buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of ``module`` (e.g. BatchNorm running statistics) as ``{name: tensor}``.

    Args:
        module: the module whose buffers to take (the buffer tensors themselves, not copies).
    """
    return dict(module.named_buffers())


def load_params(module: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy the values of a params dict into ``module``'s parameters, in place.

    Every key must name a parameter of the module, with the same shape; a mismatch raises a
    ValueError naming it. Parameters of the module that ``params`` leaves out are not touched.

    Args:
        module: the module whose parameters are overwritten (under ``torch.no_grad``, so the
            ``Parameter`` objects keep their identity).
        params: ``{qualified_name: tensor}``, e.g. the result of ``apply_updates`` on
            :func:`params_of`; a value that is the parameter itself is not copied.

    Raises:
        ValueError: for a key that names no parameter of ``module``, or a shape that differs;
            nothing is copied then.
    """
    own = dict(module.named_parameters())
    unknown = [k for k in params if k not in own]
    if unknown:
        raise ValueError(f"load_params: not parameters of {type(module).__name__}: {unknown}")
    for name, value in params.items():
        target = own[name]
        if value.shape != target.shape:
            raise ValueError(
                f"load_params: shape of {name!r} is {tuple(value.shape)}, "
                f"the module's parameter has {tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, value in params.items():
            if own[name] is not value:
                own[name].copy_(value)
