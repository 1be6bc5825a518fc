"""torch's ``DistributedOptimizer`` (RPC): an optimizer over parameters that live on other workers.

    with dist_autograd.context() as context_id:
        loss = model_parallel_forward(...)
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)        # every owner steps its parameters with the context's gradients

The parameters (``RRef`` s) are grouped by owner; each owner gets one local optimizer per
``DistributedOptimizer``. ``step(context_id)`` asks every owner, in parallel, to read the gradients
of the distributed autograd context (``dist_autograd.get_gradients``) and step; a parameter without a
gradient in that context (a frozen one, ``requires_grad=False``, never has one) is left as it is
(its state too). Steps on one worker are serialized (one
lock per worker process, as torch's), and an error on any owner is raised to the caller after all
owners have answered.

The local optimizer is functional_bagua's alias of ``optimizer_class`` where one exists
(``torch.optim.SGD`` -> :func:`functional_bagua.sgd`, ``Adam`` -> ``adam``, ...; torch's
implementation flags ``foreach``/``fused``/``capturable``/``differentiable`` dropped), run by the
fastest kernel it has, as :func:`functional_bagua.fuse_inplace` picks it: torch's fused kernel
(``functional_bagua.kernels``) for SGD, Adam and AdamW, over the parameters that have a
gradient; for the other aliases, the pure ``tx.update`` compiled with ``torch.compile`` (one graph
per pattern of missing gradients) and written back in place. Any other class (or arguments the
alias does not take) runs as the class itself. No TorchScript (torch deprecates it for this class).
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

import functional_bagua as fb
from functional_bagua import kernels
from functional_bagua.compiling import own_code
from functional_bagua.tree import copy_into

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
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"DistributedOptimizer: parameter {i} on {rpc.get_worker_info().name} is "
                    f"{type(p).__name__}; pass RRefs of tensors"
                )
        self.tx = functional_alias(optimizer_class, args, kwargs)
        if self.tx is not None:
            self.state = self.tx.init({i: p.detach() for i, p in enumerate(self.params)})
            self.kernel = kernels.spec_of(self.tx)
            self.pure_step = (
                _compiled_pure_step(self.tx, optimizer_class, args, kwargs) if self.kernel is None else None
            )
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
            elif any(p in grads for p in self.params):
                self._pure_step({i: grads.get(p) for i, p in enumerate(self.params)})

    def _pure_step(self, grads: dict) -> None:
        """The compiled pure update; eager (with a warning, once) where dynamo gives up on it."""
        assert self.tx is not None and self.pure_step is not None
        params = {i: p.detach() for i, p in enumerate(self.params)}
        try:
            self.state = self.pure_step(grads, self.state, params)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            warnings.warn(
                f"DistributedOptimizer: the compiled update failed ({type(e).__name__}); stepping eagerly", stacklevel=2
            )
            self.pure_step = functools.partial(_update_in_place, self.tx)
            self.state = self.pure_step(grads, self.state, params)


def _update_in_place(tx: fb.GradientTransformation, grads: dict, state: Any, params: dict) -> Any:
    """``tx``'s pure update, its result written into ``params``: the new state."""
    updates, new_state = tx.update(grads, state, params)
    copy_into(params, fb.apply_updates(params, updates))
    return new_state


# One compiled update per configuration and worker process: the graphs are shared by the local
# optimizers of equal configuration (a fresh one per instance would recompile each time, and
# dynamo stops compiling a function after a few recompilations).
_COMPILED_STEPS: dict[tuple, Callable[..., Any]] = {}


def _compiled_pure_step(
    tx: fb.GradientTransformation, optimizer_class: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    key = (optimizer_class, repr(tuple(args)), repr(sorted(kwargs.items())))
    with _WORKER_LOCK:
        if key not in _COMPILED_STEPS:
            # a code object per configuration: each its own dynamo cache and recompile limit
            _COMPILED_STEPS[key] = torch.compile(functools.partial(own_code(_update_in_place), tx), fullgraph=True)
        return _COMPILED_STEPS[key]


def _new_local_optimizer(
    optimizer_class: Any, param_rrefs: list, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Any, list[int]]:
    """The owner's local optimizer, and the positions of its parameters that do not require grad."""
    local = _LocalOptimizer(optimizer_class, param_rrefs, args, kwargs)
    return rpc.RRef(local), [i for i, p in enumerate(local.params) if not p.requires_grad]


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
        positions: dict[Any, list] = defaultdict(list)
        for i, rref in enumerate(params_rref):
            if not (callable(getattr(rref, "owner", None)) and callable(getattr(rref, "local_value", None))):
                raise TypeError(f"DistributedOptimizer: params_rref[{i}] is {type(rref).__name__}, not an RRef")
            per_owner[rref.owner()].append(rref)
            positions[rref.owner()].append(i)
        owners = list(per_owner)
        futures = [
            rpc.rpc_async(owner, _new_local_optimizer, args=(optimizer_class, per_owner[owner], args, kwargs))
            for owner in owners
        ]
        built = _wait_all(futures)
        self.remote_optimizers = [rref for rref, _ in built]
        frozen = sorted(positions[owner][j] for owner, (_, local) in zip(owners, built) for j in local)
        if frozen:
            warnings.warn(
                f"DistributedOptimizer: params_rref{frozen} hold tensors that do not require grad; they never get a "
                "gradient and are never stepped (as with torch's)",
                stacklevel=2,
            )

    def step(self, context_id: int) -> None:
        """Step every owner's parameters with the gradients of the distributed autograd context.

        Args:
            context_id: the ``dist_autograd.context()`` whose backward produced the gradients.
        """
        dist_autograd._is_valid_context(context_id)
        _wait_all(
            [rpc.rpc_async(rref.owner(), _local_step, args=(rref, context_id)) for rref in self.remote_optimizers]
        )
