"""The training step of a model whose parameters are DTensors (FSDP2's ``fully_shard``).

FSDP2 owns its parameters: each rank keeps its row shard of each one, all-gathers the whole
parameters before a module's forward (and backward) and reduce-scatters the gradients after it,
from hooks on the module. A pure step that swaps other tensors in for the parameters
(``functional_call``) would bypass them, so on such a model
:func:`~functional_bagua.make_train_step` builds this step instead::

    loss = loss_fn(model(inputs), targets);  loss.backward()    # FSDP2's collectives, as it schedules them
    updates, state = tx.update(grads, state, params)           # this rank's shards (below)
    params <- apply_updates(params, updates)                    # written into the model's shards

``params`` is either the model's parameter tree (``fb.params_of(model)``: DTensors sharing the
model's storage; the update runs on DTensors: elementwise math on the local shards, norms
summed across the ranks by DTensor, Muon's orthogonalization gathered whole to an owner rank),
or, with ``layout = FlatLayout.of(fb.params_of(model))``, the flat buffers of the local shards
(``layout.flatten(params)``; the update runs fused over them, :func:`~functional_bagua.fuse`,
and the new values are copied into the model's shards after each step). The gradients FSDP2
reduce-scattered are the update's gradients, so ``tx`` must not all-reduce them again.

On flat buffers the update runs in place (:func:`~functional_bagua.fuse_inplace`): torch's
fused kernel wherever one computes ``tx``, else compiled (``compile``) or eager; on the tree,
compiled or eager. ``compile`` covers the update, not the forward and backward, whose
collectives FSDP2's hooks issue (compile the model's blocks yourself, as FSDP2's documentation
shows). The step always writes the new values into the model's parameters, as
``optimizer.step()`` would, and, with a layout, into the flat buffers and state it is given (as
``donate=True``): those buffers are the parameters from then on, so a change made to the
model's shards between steps (a checkpoint loaded into the model) must be flattened into them
too. ``donate``, ``overlap`` and ``graph_warmup`` do not apply.

Example (under torchrun)::

    fully_shard(model)
    layout = fb.FlatLayout.of(fb.params_of(model))
    step = fb.make_train_step(model, torch.nn.functional.cross_entropy, fb.adamw(1e-3), layout=layout)
    params = layout.flatten(fb.params_of(model))
    state = fb.fuse(fb.adamw(1e-3), layout).init(params)
    for batch in loader:
        params, state, loss = step(params, state, batch)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from functional_bagua import kernels, tree
from functional_bagua.base import GradientTransformation, OptState, apply_updates
from functional_bagua.compiling import compile_own
from functional_bagua.flat import FlatLayout, is_dtensor, local_part
from functional_bagua.fusion import fuse_inplace
from functional_bagua.tree import PyTree

NAME = "make_train_step"


def has_dtensor_parameters(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor (FSDP2's ``fully_shard`` made it one)."""
    return any(is_dtensor(p) for p in model.parameters())


def sharded_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tx: GradientTransformation,
    compile: Union[bool, dict],
    layout: Optional[FlatLayout],
    model_arguments: Callable[[Any], tuple],
    check_batch: Callable[[object], None],
) -> Callable:
    """``step(params, state, batch) -> (params, state, loss)`` on a model with DTensor
    parameters (module docstring); ``make_train_step``'s arguments, checked there.

    Args:
        model: the module, its parameters DTensors (FSDP2's).
        loss_fn: ``loss_fn(outputs, targets)``.
        tx: the optimizer; it must not start with ``allreduce_gradients`` (FSDP2 reduces).
        compile: ``True``, ``False`` or ``torch.compile``'s keyword arguments, for the update.
        layout: ``FlatLayout.of(fb.params_of(model))``, or ``None`` for the parameter tree.
        model_arguments: splits a batch's inputs into the model's ``(args, kwargs)``.
        check_batch: raises unless the batch is ``(inputs, targets)``.
    """
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    compile_kwargs = dict(compile) if isinstance(compile, dict) else {}
    if layout is not None:
        update_into = _flat_update(tx, layout, compile, compile_kwargs)
    else:
        update = _tree_update(tx)
        update = compile_own(update, fullgraph=True, **compile_kwargs) if compile else update

    def step(params: PyTree, state: OptState, batch: Any) -> tuple[PyTree, OptState, torch.Tensor]:
        check_batch(batch)
        if layout is None:
            _check_aliases(params, named)
        else:
            layout.check(params)
        inputs, targets = batch
        args, kwargs = model_arguments(inputs)
        loss = loss_fn(model(*args, **kwargs), targets)
        loss.backward()  # FSDP2 all-gathers, and reduce-scatters the gradients into p.grad
        grads = _gradients(named)
        with torch.no_grad():
            if layout is not None:
                update_into(layout.flatten(grads), state, params)  # params and state stepped in place
                tree.copy_into({name: local_part(p) for name, p in named.items()}, layout.unflatten(params))
            else:
                new_params, state = update(grads, state, params)
                tree.copy_into(params, new_params)  # params alias the model's parameters
        model.zero_grad(set_to_none=True)
        return params, state, loss.detach()

    return step


def _tree_update(tx: GradientTransformation) -> Callable:
    def update(grads: PyTree, state: OptState, params: PyTree) -> tuple[PyTree, OptState]:
        updates, state = tx.update(grads, state, params)
        return apply_updates(params, updates), state

    return update


def _flat_update(tx: GradientTransformation, layout: FlatLayout, compile: Union[bool, dict], kwargs: dict) -> Callable:
    """The fused update over the local shards' flat buffers, in place: torch's fused kernel where
    one computes ``tx``, else compiled (``compile``) or eager."""
    if kernels.spec_of(tx) is not None:
        return fuse_inplace(tx, layout, kernel="torch")
    if not compile:
        return fuse_inplace(tx, layout, kernel="eager")
    return fuse_inplace(tx, layout, kernel="compiled", compile_options=kwargs)


def _gradients(named: dict) -> dict:
    """``p.grad`` of each parameter; a ValueError naming those without one."""
    missing = [name for name, p in named.items() if p.grad is None]
    if missing:
        raise ValueError(
            f"{NAME}: no gradient for {missing[:5]} after backward: every trainable parameter of an FSDP2 model "
            "needs one (freeze the others with requires_grad_(False) before fully_shard)"
        )
    return {name: p.grad for name, p in named.items()}


def _check_aliases(params: PyTree, named: dict) -> None:
    """Raise unless ``params`` are the model's parameters (``fb.params_of(model)``): the step writes
    the new values into them, which FSDP2 then gathers."""
    if not isinstance(params, dict) or list(params) != list(named):
        got = sorted(params)[:5] if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"{NAME}: params must be fb.params_of(model) (the model's DTensor parameters, by name), got {got}; "
            "or pass layout= and its flat buffers"
        )
    for name, p in params.items():
        mine = local_part(named[name])
        if not is_dtensor(p) or (mine.numel() and local_part(p).data_ptr() != mine.data_ptr()):
            raise ValueError(
                f"{NAME}: params[{name!r}] is not the model's parameter (FSDP2 trains the parameters it holds): "
                "pass fb.params_of(model), which aliases them"
            )
