"""Bagua's algorithm interface: an :class:`Algorithm` is what a user passes to ``with_bagua``; its
``reify(process_group)`` makes the :class:`AlgorithmImpl` that one wrapped model runs.

An implementation takes part in a training step at four points, each a method the engine
(:class:`~functional_bagua.compat.bagua_module.BaguaDistributedDataParallel`) calls::

    init(ddp)                        at wrap time, after rank 0's state was broadcast (and after each reset)
    before_forward(ddp)              each training forward, after the step counter moved
    after_backward(ddp)              once at the end of each synchronized backward pass
    after_step(ddp, optimizer)       after each optimizer.step()

``need_reset()`` (checked before each training forward) asks the engine to broadcast rank 0's
state again and call ``init`` anew (QAdam's switch from warmup to compressed momentum); ``detach(ddp)``
undoes what ``init`` set up (hooks, threads) when the model is wrapped again.

The communication itself is :mod:`functional_bagua.distributed`'s: gradient algorithms hand the
gradients to a :class:`~functional_bagua.distributed.GradientReducer` (bucketed, overlapped with
backward), weight-averaging algorithms use its averaging rules.

Bagua's own interface runs too, so that a user's Bagua algorithm works unchanged: an implementation
that keeps the four points above as the base class has them runs Bagua's hooks through them::

    init:            tensors = init_tensors(ddp); buckets = tensors_to_buckets(suggested, flatten)
                     init_operations(ddp, bucket) for each bucket; the buckets registered in order
    before_forward:  init_forward_pre_hook(ddp)(inputs)
    each gradient:   init_backward_hook(ddp)(name, param)     (name: Bagua's "{module}.{param}")
    after_backward:  init_post_backward_hook(ddp)()
    after_step:      init_post_optimizer_step_hook(ddp)(optimizer)

with Bagua's defaults (gradients as the tensors, marked ready as they arrive; the backend waited
for after backward, and the gradients that never arrived named in a RuntimeError). The post-step
hook is made once per ``init``, the others on each call, as Bagua's engine does. The suggested
buckets group the tensors in the order ``init_tensors`` gives them, by dtype and device, up to
``bucket_cap_mb`` each (:func:`~functional_bagua.compat.autotune.in_order_buckets`; Bagua's
autotuning service sorted them by dtype name first). ``find_unused_parameters=True`` is refused
with these hooks. The buckets' operations are those of :mod:`functional_bagua.compat.bucket`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from functional_bagua.compat.autotune import in_order_buckets
from functional_bagua.compat.bucket import BaguaBucket
from functional_bagua.compat.communication import BaguaProcessGroup
from functional_bagua.compat.tensor import BaguaTensor  # noqa: F401  # Bagua's module exports it
from functional_bagua.distributed.buckets import MIB

if TYPE_CHECKING:
    from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel


class AlgorithmImpl:
    """One wrapped model's running algorithm (module docstring); the base class does nothing.

    Args:
        process_group: the group the algorithm communicates in.
    """

    def __init__(self, process_group: BaguaProcessGroup) -> None:
        self.process_group = process_group

    def need_reset(self) -> bool:
        """Whether the engine must broadcast rank 0's state and call :meth:`init` again before this forward."""
        return False

    def init(self, ddp: "BaguaDistributedDataParallel") -> None:
        """Set up for ``ddp``'s model (reducers, buffers, hooks, threads); here: Bagua's hooks
        (module docstring).

        Args:
            ddp: the engine of the wrapped model.
        """
        if ddp.find_unused_parameters:
            raise ValueError(
                f"{type(self).__name__} runs Bagua's hooks, which mark each parameter as its gradient arrives: "
                "find_unused_parameters=True is not supported with them (a parameter without a gradient leaves "
                "its bucket waiting); give every parameter a gradient in each backward, or use "
                "GradientAllReduceAlgorithm, which supports it"
            )
        tensors = self.init_tensors(ddp)
        buckets = self.tensors_to_buckets(suggested_buckets(tensors, ddp.bucket_cap_mb), ddp.gradient_as_bucket_view)
        for bucket in buckets:
            self.init_operations(ddp, bucket)
        ddp._bagua_backend.register_ordered_buckets([b.backend_bucket for b in buckets])
        self._bagua_buckets: Optional[list] = buckets
        self._gradient_hooks = _gradient_hooks(self, ddp)
        self._post_step_hook = self.init_post_optimizer_step_hook(ddp)  # made once, as Bagua's engine does
        check_no_shadowed_methods(self)

    def before_forward(self, ddp: "BaguaDistributedDataParallel") -> None:
        """Called before each training forward; here: Bagua's forward pre-hook.

        Args:
            ddp: the engine of the wrapped model.
        """
        if self._runs_bagua_hooks():
            self.init_forward_pre_hook(ddp)(ddp.forward_inputs)

    def after_backward(self, ddp: "BaguaDistributedDataParallel") -> None:
        """Called at the end of each synchronized backward pass; here: Bagua's post-backward hook.

        Args:
            ddp: the engine of the wrapped model.
        """
        if self._runs_bagua_hooks():
            self.init_post_backward_hook(ddp)()

    def after_step(self, ddp: "BaguaDistributedDataParallel", optimizer: torch.optim.Optimizer) -> None:
        """Called after each ``optimizer.step()`` of the wrapped optimizers; here: Bagua's
        post-step hook.

        Args:
            ddp: the engine of the wrapped model.
            optimizer: the optimizer that stepped.
        """
        if self._runs_bagua_hooks():
            self._post_step_hook(optimizer)

    def _runs_bagua_hooks(self) -> bool:
        return getattr(self, "_bagua_buckets", None) is not None

    # ---- Bagua's hooks, with Bagua's defaults (module docstring) --------------------------------

    def init_tensors(self, bagua_ddp: "BaguaDistributedDataParallel") -> list:
        """The tensors to communicate: by default every synchronized parameter, last first, as a
        proxy of its gradient.

        Args:
            bagua_ddp: the engine of the wrapped model.
        """
        parameters = bagua_ddp.bagua_build_params()
        tensors = [
            p.bagua_ensure_grad().ensure_bagua_tensor(  # type: ignore[attr-defined]
                name, bagua_ddp.bagua_module_name, getter_closure=_gradient_of, setter_closure=_set_gradient
            )
            for name, p in reversed(parameters)
        ]
        self._communication_tensor_names = {name for name, _ in parameters}
        return tensors

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list:
        """The buckets, from the suggested grouping: by default one bucket per suggested group.

        Args:
            tensors: the proxies, grouped as suggested (a list of lists).
            do_flatten: flatten each bucket (``gradient_as_bucket_view``).
        """
        return [BaguaBucket(group, flatten=do_flatten, name=str(i)) for i, group in enumerate(tensors)]

    def init_forward_pre_hook(self, bagua_ddp: "BaguaDistributedDataParallel") -> Callable[[Any], None]:
        """A function of the forward's inputs, run before each training forward (by default nothing).

        Args:
            bagua_ddp: the engine of the wrapped model.
        """
        return lambda inputs: None

    def init_backward_hook(self, bagua_ddp: "BaguaDistributedDataParallel") -> Callable[[str, torch.Tensor], None]:
        """A function of ``(name, parameter)``, run as each parameter's gradient is accumulated
        (by default: mark the parameter ready if it is communicated).

        Args:
            bagua_ddp: the engine of the wrapped model.
        """

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            if parameter_name in getattr(self, "_communication_tensor_names", ()):
                parameter.bagua_mark_communication_ready()  # type: ignore[attr-defined]

        return hook

    def init_post_backward_hook(self, bagua_ddp: "BaguaDistributedDataParallel") -> Callable[[], None]:
        """A function of nothing, run at the end of each synchronized backward (by default: wait
        for the backend's operations, and raise a RuntimeError naming the gradients that never
        arrived, whose buckets did not run).

        Args:
            bagua_ddp: the engine of the wrapped model.
        """
        backend = bagua_ddp._bagua_backend

        def hook() -> None:
            backend.wait_pending_comm_ops()
            waiting = backend.incomplete()
            if waiting:
                backend.start_round()
                raise RuntimeError(
                    f"model {backend.model_name!r}: these gradients did not arrive in this backward, so their "
                    f"buckets were not averaged: {'; '.join(waiting)}. Give every parameter a gradient in each "
                    "backward (a parameter the loss does not use gets none)"
                )

        return hook

    def init_post_optimizer_step_hook(
        self, bagua_ddp: "BaguaDistributedDataParallel"
    ) -> Callable[[torch.optim.Optimizer], None]:
        """A function of the optimizer, run after each of its steps (by default nothing).

        Args:
            bagua_ddp: the engine of the wrapped model.
        """
        return lambda optimizer: None

    def init_operations(self, bagua_ddp: "BaguaDistributedDataParallel", bucket: BaguaBucket) -> None:
        """Append the operations of one bucket (``bucket.append_*_op``; by default none).

        Args:
            bagua_ddp: the engine of the wrapped model.
            bucket: the bucket.
        """

    # whether a rank without batches can shadow this algorithm's steps (torch's Join): only the
    # gradient algorithms can (shadow(ddp) then runs one step's collectives with zero gradients)
    supports_join = False

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether backward passes synchronize gradients (``False`` inside ``no_sync()``).

        Args:
            enabled: the engine's ``require_backward_grad_sync``.
        """

    def detach(self, ddp: "BaguaDistributedDataParallel") -> None:
        """Undo :meth:`init` (the model is wrapped again, or the algorithm reset).

        Args:
            ddp: the engine of the wrapped model.
        """
        if self._runs_bagua_hooks():
            for handle in self._gradient_hooks:
                handle.remove()
            ddp._bagua_backend.register_ordered_buckets([])
            self._bagua_buckets = None

    def buckets(self) -> list:
        """What Bagua called the model's buckets (``model.bagua_buckets``)."""
        return list(getattr(self, "_bagua_buckets", None) or [])

    def used_in_last_backward(self) -> Optional[list[bool]]:
        """Per synchronized parameter, whether it got a gradient in the last backward on this rank
        (``None`` where the algorithm does not track it)."""
        return None

    def bytes_per_step(self, ddp: "BaguaDistributedDataParallel") -> int:
        """The bytes this rank hands to the collectives in one training step (before compression).

        Args:
            ddp: the engine of the wrapped model.
        """
        return 0


BAGUA_HOOKS = (
    "init_tensors",
    "tensors_to_buckets",
    "init_forward_pre_hook",
    "init_backward_hook",
    "init_post_backward_hook",
    "init_post_optimizer_step_hook",
    "init_operations",
)


def _gradient_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    return param.grad


def _set_gradient(param: torch.Tensor, gradient: torch.Tensor) -> None:
    param.grad = gradient


def suggested_buckets(tensors: list, bucket_cap_mb: float) -> list[list]:
    """The proxies grouped in their order, by dtype and device, up to ``bucket_cap_mb`` MiB of
    effective tensors each (:func:`~functional_bagua.compat.autotune.in_order_buckets`).

    Args:
        tensors: the proxies ``init_tensors`` gave.
        bucket_cap_mb: the bucket size in MiB.
    """
    effective = [t.bagua_getter_closure() for t in tensors]
    return [[tensors[i] for i in group] for group in in_order_buckets(effective, bucket_cap_mb * MIB)]


def _gradient_hooks(impl: AlgorithmImpl, ddp: "BaguaDistributedDataParallel") -> list:
    """A hook on each trainable parameter that runs ``impl``'s backward hook as the parameter's
    gradient is accumulated in a synchronized backward (the engine and ``impl`` held weakly: a
    parameter's hooks must not keep its model's algorithm alive)."""
    engine, algorithm = weakref.ref(ddp), weakref.ref(impl)

    def hook_of(name: str) -> Callable[[torch.Tensor], None]:
        def on_gradient(param: torch.Tensor) -> None:
            held, running = engine(), algorithm()
            if held is not None and running is not None and held.require_backward_grad_sync:
                running.init_backward_hook(held)(name, param)

        return on_gradient

    return [p.register_post_accumulate_grad_hook(hook_of(name)) for name, p in ddp.named_parameters_for_hooks()]


ENGINE_METHODS = (
    "init",
    "before_forward",
    "after_backward",
    "after_step",
    "detach",
    "buckets",
    "set_gradient_sync",
    "used_in_last_backward",
    "bytes_per_step",
    "need_reset",
    "supports_join",
)


def check_no_shadowed_methods(impl: AlgorithmImpl) -> None:
    """Raise a TypeError where ``impl`` set an attribute named as a method the engine calls
    (``self.buckets = [...]``), which would hide that method.

    Args:
        impl: an implementation after its ``init``.
    """
    shadowed = sorted(set(vars(impl)) & set(ENGINE_METHODS))
    if shadowed:
        raise TypeError(
            f"{type(impl).__name__} sets the attributes {shadowed}, which hide the methods of the same names that "
            "the engine calls on every AlgorithmImpl; rename them (e.g. self._buckets)"
        )


def check_hooks_run(impl: AlgorithmImpl) -> None:
    """Raise a TypeError where ``impl`` overrides Bagua's hooks but inherits a step of this layer's
    own (a subclass of a built-in implementation), which would not call them.

    Args:
        impl: the implementation about to run.
    """
    owner = next(c for c in type(impl).__mro__ if "init" in vars(c))
    overridden = [n for n in BAGUA_HOOKS if getattr(type(impl), n) is not getattr(AlgorithmImpl, n)]
    if owner is not AlgorithmImpl and overridden:
        raise TypeError(
            f"{type(impl).__name__} overrides Bagua's hooks {overridden} but runs the step of "
            f"{owner.__name__}, which does not call them: subclass "
            "functional_bagua.compat.algorithms.AlgorithmImpl (which runs them) instead"
        )


class Algorithm:
    """A data-parallel algorithm, as users pass it to ``with_bagua``; one object may serve several
    models (each gets its own :class:`AlgorithmImpl` from :meth:`reify`)."""

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        """The implementation that runs on one model.

        Args:
            process_group: the group to communicate in.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement reify(process_group)")

    @classmethod
    def init(cls, name: str, **kwargs: Any) -> "Algorithm":
        """The algorithm registered as ``name`` (``GlobalAlgorithmRegistry``), built with ``kwargs``.

        Args:
            name: a registry name, e.g. ``"gradient_allreduce"``.
            kwargs: the algorithm's arguments.
        """
        return GlobalAlgorithmRegistry.get(name)(**kwargs)


class AlgorithmRegistry:
    """Names for algorithm classes (Bagua's ``GlobalAlgorithmRegistry``)."""

    def __init__(self) -> None:
        self._classes: dict[str, Callable[..., Algorithm]] = {}

    def register(self, name: str, cls: Callable[..., Algorithm], description: Optional[str] = None) -> None:
        """Register ``cls`` under ``name``.

        Args:
            name: a string not registered yet (a ValueError otherwise).
            cls: the algorithm class (or a factory of algorithms).
            description: kept for Bagua's signature.
        """
        if not isinstance(name, str):
            raise TypeError(f"an algorithm name must be a string, got {type(name).__name__}")
        if name in self._classes:
            raise ValueError(f"an algorithm is registered as {name!r} already")
        self._classes[name] = cls

    def get(self, name: str) -> Callable[..., Algorithm]:
        """The algorithm class registered as ``name`` (a KeyError naming the known ones otherwise).

        Args:
            name: a registered name.
        """
        if name not in self._classes:
            raise KeyError(f"no algorithm is registered as {name!r}; known: {sorted(self._classes)}")
        return self._classes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def names(self) -> list[str]:
        """The registered names."""
        return sorted(self._classes)

    def available_algorithms(self) -> list[str]:
        """The registered names, in the order they were registered (Bagua's method)."""
        return list(self._classes)

    def __str__(self) -> str:
        return "Registered Algorithms: {}".format(", ".join(self._classes))


_AlgorithmRegistry = AlgorithmRegistry  # Bagua's name of the class
GlobalAlgorithmRegistry = AlgorithmRegistry()


def engine_on_demand(module: str) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``module``: Bagua's algorithm modules also export
    ``BaguaDistributedDataParallel``, imported when asked for (the engine's module imports these)."""

    def module_getattr(name: str) -> object:
        if name == "BaguaDistributedDataParallel":
            from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel

            return BaguaDistributedDataParallel
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return module_getattr


__getattr__ = engine_on_demand(__name__)
