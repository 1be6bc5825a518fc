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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from functional_bagua.compat.communication import BaguaProcessGroup

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
        """Set up for ``ddp``'s model (reducers, buffers, hooks, threads).

        Args:
            ddp: the engine of the wrapped model.
        """

    def before_forward(self, ddp: "BaguaDistributedDataParallel") -> None:
        """Called before each training forward.

        Args:
            ddp: the engine of the wrapped model.
        """

    def after_backward(self, ddp: "BaguaDistributedDataParallel") -> None:
        """Called at the end of each synchronized backward pass.

        Args:
            ddp: the engine of the wrapped model.
        """

    def after_step(self, ddp: "BaguaDistributedDataParallel", optimizer: torch.optim.Optimizer) -> None:
        """Called after each ``optimizer.step()`` of the wrapped optimizers.

        Args:
            ddp: the engine of the wrapped model.
            optimizer: the optimizer that stepped.
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

    def buckets(self) -> list:
        """What Bagua called the model's buckets (``model.bagua_buckets``)."""
        return []

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
        """The algorithm registered as ``name`` (:data:`GlobalAlgorithmRegistry`), built with ``kwargs``.

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
