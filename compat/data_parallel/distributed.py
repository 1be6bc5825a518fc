"""Bagua's ``DistributedDataParallel``: a torch-DDP-like wrapper module around the with_bagua engine.

    net = DistributedDataParallel(model, optimizers=[optimizer], algorithm=GradientAllReduceAlgorithm())
    loss_fn(net(x), y).backward()            # gradients synchronized as the algorithm says
    optimizer.step()

``net.module`` is the model, ``net.state_dict()`` has torch DDP's keys (``module.`` + the model's),
``net.no_sync()`` accumulates local gradients. Beyond Bagua, ``bucket_cap_mb``,
``find_unused_parameters`` and ``broadcast_buffers`` (rank 0's buffers before every forward, as
torch's DDP) are honoured, on the CPU (gloo) too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
from torch.distributed.algorithms.join import Join, JoinHook
from torch.distributed.distributed_c10d import _get_default_group  # noqa: F401  # Bagua's module imports it

from functional_bagua.compat.algorithms.base import Algorithm
from functional_bagua.compat.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from functional_bagua.compat.bagua_module import ENGINE_ATTRIBUTE, BaguaDistributedDataParallel
from functional_bagua.compat.communication import BaguaProcessGroup, to_bagua_process_group  # noqa: F401  # as Bagua's
from functional_bagua.distributed.process_group import broadcast_params

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0", "DistributedDataParallel_V1_9_0_Interface"]


class DistributedDataParallel_V1_9_0_Interface(torch.nn.Module):  # noqa: N801 - Bagua's name
    """Bagua's interface of torch 1.9's ``DistributedDataParallel``: the methods a wrapper module
    offers, each raising ``NotImplementedError`` where a subclass does not implement it (as
    Bagua's; :class:`DistributedDataParallel_V1_9_0` implements ``forward`` and ``no_sync``)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        raise NotImplementedError
        yield  # a generator, as Bagua's context manager

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        raise NotImplementedError

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: Any) -> Any:
        raise NotImplementedError

    def gather(self, outputs: Any, output_device: Any) -> Any:
        raise NotImplementedError

    def train(self, mode: bool = True) -> "DistributedDataParallel_V1_9_0_Interface":
        super().train(mode)
        return self

    @contextlib.contextmanager
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Iterator[None]:
        """Not implemented (as in Bagua): use ``torch.distributed.algorithms.join.Join([net])``."""
        raise NotImplementedError
        yield

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise NotImplementedError

    def will_sync_module_buffers(self) -> bool:
        raise NotImplementedError


class DistributedDataParallel_V1_9_0(DistributedDataParallel_V1_9_0_Interface):  # noqa: N801 - Bagua's name
    """The wrapper module (module docstring). Arguments as :func:`DistributedDataParallel`, in
    Bagua's order: torch DDP's first, then ``optimizers`` (default: none) and ``algorithm``
    (default: ``None``, for ``GradientAllReduceAlgorithm()``), so that Bagua's own tests, which
    build it directly, run."""

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: object = None,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        algorithm: Optional[Algorithm] = None,
    ) -> None:
        super().__init__()
        if isinstance(output_device, Algorithm) or any(isinstance(d, torch.optim.Optimizer) for d in device_ids or ()):
            raise TypeError(
                "DistributedDataParallel_V1_9_0 takes Bagua's order: (module, device_ids, ..., optimizers=..., "
                "algorithm=...); pass optimizers and algorithm by keyword"
            )
        algorithm = GradientAllReduceAlgorithm() if algorithm is None else algorithm
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("DistributedDataParallel: the module has no parameter that requires a gradient")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"DistributedDataParallel: one device per process, got device_ids={list(device_ids)}")
        devices = {p.device.type for p in module.parameters()}
        if len(devices) > 1:
            raise ValueError(f"DistributedDataParallel: parameters on several device types {sorted(devices)}")
        self.module = module
        self.device_ids, self.output_device, self.dim = device_ids, output_device, dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.inner = BaguaDistributedDataParallel(
            module,
            optimizers,
            algorithm,
            process_group,
            vars(module).get("_bagua_module_name"),
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            bucket_cap_mb=bucket_cap_mb,
        )
        vars(module)[ENGINE_ATTRIBUTE] = self.inner

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's ``Join`` (uneven inputs), as for torch's DDP: a rank without batches shadows each
        step's buffer broadcast and gradient all-reduce (gradient algorithms only)."""
        before = self._broadcast_buffers if self.broadcast_buffers else None
        return self.inner.join_hook(before)

    @property
    def join_device(self) -> torch.device:
        return self.inner.join_device

    @property
    def join_process_group(self) -> Any:
        return self.inner.join_process_group

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        synced = self.module.training and torch.is_grad_enabled() and self.inner.require_backward_grad_sync
        joined_context = "_join_config" in vars(self)
        if synced and joined_context:
            Join.notify_join_context(self)  # type: ignore[arg-type]  # a Joinable by duck typing
        # under Join a joined rank shadows one broadcast per synchronized step: none in between
        if self.broadcast_buffers and self.module.training and (synced or not joined_context):
            self._broadcast_buffers()
        return self.module(*inputs, **kwargs)

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank, one broadcast per dtype (as DDP coalesces them)."""
        buffers = [b for name, b in self.module.named_buffers() if not self.inner.ignored(name, name)]
        if buffers:
            received = broadcast_params([b.detach() for b in buffers], self.inner._group().group)
            for buffer, value in zip(buffers, received):
                buffer.copy_(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the block, backward passes only accumulate local gradients."""
        with self.inner.no_sync():
            yield

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.inner.require_backward_grad_sync

    @property
    def parameters_to_ignore(self) -> list:
        return self.inner.parameters_to_ignore

    @property
    def bagua_algorithm(self) -> Any:
        return self.inner.bagua_algorithm

    @property
    def bagua_optimizers(self) -> list:
        return self.inner.bagua_optimizers

    @property
    def bagua_buckets(self) -> list:
        return self.inner.bagua_algorithm.buckets()


def DistributedDataParallel(  # noqa: N802 - Bagua's name
    module: torch.nn.Module,
    device_ids: Optional[Sequence[Any]] = None,
    output_device: Any = None,
    dim: int = 0,
    broadcast_buffers: bool = True,
    process_group: object = None,
    bucket_cap_mb: float = 25,
    find_unused_parameters: bool = False,
    check_reduction: bool = False,
    gradient_as_bucket_view: bool = True,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    algorithm: Optional[Algorithm] = None,
) -> DistributedDataParallel_V1_9_0:
    """Bagua's data-parallel wrapper (module docstring), with torch DDP's arguments plus Bagua's.

    Args:
        module: the model.
        device_ids: ``None`` on the CPU, or this process's one device.
        output_device: kept for torch DDP's signature (outputs stay where the module puts them).
        dim: kept for torch DDP's signature (inputs are not scattered: each process feeds its own batch).
        broadcast_buffers: rank 0's buffers on every rank before each training forward.
        process_group: ``None`` (the default group), a torch process group or a ``BaguaProcessGroup``.
        bucket_cap_mb: the gradient bucket size in MiB.
        find_unused_parameters: agree across ranks on which parameters got no gradient.
        check_reduction: kept for torch DDP's signature (deprecated there).
        gradient_as_bucket_view: let gradients live in the communication buckets.
        optimizers: the optimizers that step the module's parameters.
        algorithm: an :class:`~functional_bagua.compat.algorithms.base.Algorithm`; ``None`` for
            ``GradientAllReduceAlgorithm()``.
    """
    return DistributedDataParallel_V1_9_0(
        module,
        optimizers=optimizers,
        algorithm=algorithm,
        device_ids=device_ids,
        output_device=output_device,
        dim=dim,
        broadcast_buffers=broadcast_buffers,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        check_reduction=check_reduction,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
