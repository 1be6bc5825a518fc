"""torch's ``DistributedOptimizer`` (RPC): an optimizer over parameters that live on other workers.

    with dist_autograd.context() as context_id:
        loss = model_parallel_forward(...)
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)        # every owner steps its parameters with the context's gradients

The parameters (``RRef`` s) are grouped by owner; each owner gets one local optimizer per
``DistributedOptimizer``. ``step(context_id)`` asks every owner, in parallel, to read the gradients
of the distributed autograd context (``dist_autograd.get_gradients``) and step; a parameter without a
gradient in that context is left as it is (its state too). Steps on one worker are serialized (one
lock per worker process, as torch's), and an error on any owner is raised to the caller after all
owners have answered.

The local optimizer is functional_bagua's alias of ``optimizer_class`` where one exists
(``torch.optim.SGD`` -> :func:`functional_bagua.sgd`, ``Adam`` -> ``adam``, ...; torch's
implementation flags ``foreach``/``fused``/``capturable``/``differentiable`` dropped), run by the
fastest kernel it has, as :func:`functional_bagua.fuse_inplace` picks it: torch's fused kernel
(:mod:`functional_bagua.kernels`) for SGD, Adam and AdamW, over the parameters that have a
gradient; for the other aliases, the pure ``tx.update`` compiled with ``torch.compile`` (one graph
per pattern of missing gradients) and written back in place. Any other class (or arguments the
alias does not take) runs as the class itself. No TorchScript (torch deprecates it for this class).
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

import functional_bagua as fb
from functional_bagua import kernels

__all__ = ["DistributedOptimizer", "functional_alias"]

ALIASES: dict[type, Callable[..., fb.GradientTransformation]] = {
    torch.optim.SGD: fb.sgd,
    torch.optim.Adam: fb.adam,
    torch.optim.AdamW: fb.adamw,
    torch.optim.Adagrad: fb.adagrad,
    torch.optim.RMSprop: fb.rmsprop,
    torch.optim.Adamax: fb.adamax,
    torch.optim.Adadelta: fb.adadelta,
    torch.optim.NAdam: fb.nadam,
    torch.optim.RAdam: fb.radam,
    torch.optim.Rprop: fb.rprop,
}
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")

_WORKER_LOCK = threading.Lock()  # steps of all local optimizers of this worker, one at a time (torch's rule)


def functional_alias(
    optimizer_class: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> Optional[fb.GradientTransformation]:
    """functional_bagua's transform for ``optimizer_class(params, *args, **kwargs)``, or ``None``
    when there is no alias or it does not take these arguments.

    Args:
        optimizer_class: a torch optimizer class.
        args: the class's arguments after ``params``, by position.
        kwargs: the class's arguments by name.
    """
    alias = ALIASES.get(optimizer_class)
    if alias is None:
        return None
    try:
        bound = inspect.signature(optimizer_class).bind(None, *args, **kwargs)
    except TypeError:
        return None
    named = {k: v for k, v in list(bound.arguments.items())[1:] if k not in IMPLEMENTATION_FLAGS}
    accepted = inspect.signature(alias).parameters
    if any(k not in accepted for k in named):
        return None
    return alias(**named)


class _LocalOptimizer:
    """One owner's part of a :class:`DistributedOptimizer`: its parameters and their optimizer."""

    def __init__(self, optimizer_class: Any, param_rrefs: list, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        self.params = [rref.local_value() for rref in param_rrefs]
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor) or not p.requires_grad:
                raise ValueError(
                    f"DistributedOptimizer: parameter {i} on {rpc.get_worker_info().name} is "
                    f"{'a tensor that does not require grad' if isinstance(p, torch.Tensor) else type(p).__name__}; "
                    "pass RRefs of tensors with requires_grad=True"
                )
        self.tx = functional_alias(optimizer_class, args, kwargs)
        if self.tx is not None:
            self.state = self.tx.init({i: p.detach() for i, p in enumerate(self.params)})
            self.kernel = kernels.spec_of(self.tx)
            self.compiled_step = None if self.kernel is not None else torch.compile(self._pure_step, fullgraph=True)
        else:
            self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with _WORKER_LOCK:
            if self.tx is None:
                for p in self.params:
                    p.grad = grads.get(p)  # None: the class skips it
                self.optim.step()
            elif self.kernel is not None:
                present = {i: p.detach() for i, p in enumerate(self.params) if p in grads}
                if present:
                    kernels.run(self.kernel, {i: grads[self.params[i]] for i in present}, self.state, present)
            else:
                assert self.compiled_step is not None
                self.state = self.compiled_step(
                    {i: grads.get(p) for i, p in enumerate(self.params)},
                    self.state,
                    {i: p.detach() for i, p in enumerate(self.params)},
                )

    def _pure_step(self, grads: dict, state: Any, params: dict) -> Any:
        """The alias's pure update, its result written into ``params``: the new state."""
        assert self.tx is not None
        updates, new_state = self.tx.update(grads, state, params)
        for i, u in updates.items():
            if u is None:
                continue
            if params[i].dim() == 0:  # torch 2.13's compiled graphs drop in-place ops on 0-dim float64 inputs
                params[i][()] = params[i] + u
            else:
                params[i].add_(u)
        return new_state


def _new_local_optimizer(optimizer_class: Any, param_rrefs: list, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return rpc.RRef(_LocalOptimizer(optimizer_class, param_rrefs, args, kwargs))


def _local_step(local_rref: Any, context_id: int) -> None:
    local_rref.local_value().step(context_id)


def _wait_all(futures: list) -> list:
    """Every future's value; the last error is raised once all have finished."""
    results, error = [], None
    for future in futures:
        try:
            results.append(future.wait())
        except Exception as e:  # raised below, after every owner answered
            results.append(e)
            error = e
    if error is not None:
        raise error
    return results


class DistributedOptimizer:
    """An optimizer over remote parameters (module docstring; torch's signature).

    Args:
        optimizer_class: the optimizer class each owner runs (or its functional_bagua alias).
        params_rref: ``RRef`` s of the parameters, local or remote.
        args: ``optimizer_class``'s arguments after ``params``.
        kwargs: ``optimizer_class``'s arguments by name.

    Example::

        optimizer = DistributedOptimizer(torch.optim.SGD, [rref1, rref2], lr=0.05)
        optimizer.step(context_id)
    """

    def __init__(self, optimizer_class: Any, params_rref: Sequence[Any], *args: Any, **kwargs: Any) -> None:
        if not callable(optimizer_class):
            raise TypeError(
                f"DistributedOptimizer: optimizer_class must be an optimizer class, got {optimizer_class!r}"
            )
        per_owner: dict[Any, list] = defaultdict(list)
        for i, rref in enumerate(params_rref):
            if not (callable(getattr(rref, "owner", None)) and callable(getattr(rref, "local_value", None))):
                raise TypeError(f"DistributedOptimizer: params_rref[{i}] is {type(rref).__name__}, not an RRef")
            per_owner[rref.owner()].append(rref)
        futures = [
            rpc.rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in per_owner.items()
        ]
        self.remote_optimizers = _wait_all(futures)

    def step(self, context_id: int) -> None:
        """Step every owner's parameters with the gradients of the distributed autograd context.

        Args:
            context_id: the ``dist_autograd.context()`` whose backward produced the gradients.
        """
        dist_autograd._is_valid_context(context_id)
        _wait_all(
            [rpc.rpc_async(rref.owner(), _local_step, args=(rref, context_id)) for rref in self.remote_optimizers]
        )
