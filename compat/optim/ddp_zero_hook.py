"""torch DDP's ZeRO communication hooks, for :class:`~functional_bagua.compat.optim.zero.ZeroRedundancyOptimizer`
built with ``overlap_with_ddp=True``, on any backend (gloo too):

    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=1e-3)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    loss_fn(ddp(x), y).backward()            # all-reduce, this rank's step, broadcasts: all in here

DDP hands its gradient buckets to the hook in order; ``hook`` (e.g. torch's ``allreduce_hook``)
reduces each one asynchronously. Then, for every bucket ``b`` in order,

    g_b = reduced gradients of b;   this rank steps the parameters of b it owns on g_b;
    each owner broadcasts its updated parameters of b (one flat tensor per owner).

:func:`hook_with_zero_step` does this after the last bucket is handed over, so the steps overlap the
all-reduces still in flight; :func:`hook_with_zero_step_interleaved` steps each bucket as soon as its
all-reduce completes (on the communication thread), while backward goes on. Both issue their
broadcasts from the autograd thread, in bucket order, after the last bucket: every rank issues the
same collectives in the same order, which is what gloo needs (torch's interleaved hook broadcasts from
completion callbacks, whose order differs between ranks, and refuses gloo). The backward returns with
the parameters updated and equal on every rank; ``zero.step()`` is left out of the loop.

Ownership is the optimizer's own partition (torch's sorted-greedy rule over parameters), not DDP's
buckets, so every step updates the parameters from the first one; torch's version skips the first
two or three steps while it learns DDP's buckets, and ``shard_buckets`` changes nothing here (each
parameter's state already lives on one rank, balanced by size).
"""

from typing import Any, Callable  # (no __future__ annotations: DDP checks a hook's annotations as objects)

import torch
import torch.distributed as dist

from functional_bagua.compat.optim.zero import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


class _BucketGradients:
    """Where each parameter's gradient lies in a DDP bucket's flat buffer, to read the gradients out
    of the tensor the communication hook's future returns."""

    def __init__(self, bucket: dist.GradBucket) -> None:
        buffer = bucket.buffer()
        self.numel = buffer.numel()
        self.layout = [
            (g.shape, g.stride(), (g.data_ptr() - buffer.data_ptr()) // g.element_size()) for g in bucket.gradients()
        ]

    def of(self, reduced: Any) -> list[torch.Tensor]:
        tensor = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != self.numel:
            raise RuntimeError(
                f"the DDP communication hook's future must return the bucket's reduced tensor ({self.numel} elements), "
                f"got {type(tensor).__name__} {tuple(getattr(tensor, 'shape', ()))}"
            )
        base = tensor.storage_offset()
        return [tensor.as_strided(shape, stride, base + offset) for shape, stride, offset in self.layout]


class _Round:
    """One backward's buckets, in the order DDP hands them over: their parameters, the future of
    their reduced (and, interleaved, already stepped) gradients and where those lie."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero
        self.buckets: list[tuple[list[torch.Tensor], torch.futures.Future, _BucketGradients]] = []

    def add(self, params: list[torch.Tensor], future: torch.futures.Future, gradients: _BucketGradients) -> None:
        self.buckets.append((params, future, gradients))

    def finish(self, step: bool) -> None:
        """Wait for each bucket in order, step it here if ``step`` (else its future did), launch its
        broadcasts; then wait for every broadcast."""
        buckets, self.buckets = self.buckets, []
        launched = []
        for params, future, gradients in buckets:
            reduced = future.wait()
            if step:
                self.zero._step_owned(params, gradients.of(reduced))
            launched += self.zero._launch_broadcasts(params)
        self.zero._finish_broadcasts(launched)


def _checked(hook: CommHook, ddp: torch.nn.Module, zero: Any) -> _Round:
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(
            f"hook_with_zero_step needs functional_bagua.compat.optim.ZeroRedundancyOptimizer, got {type(zero).__name__}"
        )
    if not zero.overlapping:
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this hook properly"
        )
    if not callable(hook):
        raise TypeError(f"hook must be a DDP communication hook (state, bucket) -> Future, got {hook!r}")
    module = getattr(ddp, "module", ddp)
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in zero._owner]
    if missing:
        raise ValueError(
            f"the DDP model's parameters {missing} are not among the ZeroRedundancyOptimizer's; build it over "
            "ddp.parameters()"
        )
    return _Round(zero)


def hook_with_zero_step(
    hook: CommHook, ddp: torch.nn.Module, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False
) -> CommHook:
    """``hook`` followed, once DDP hands over its last bucket, by ``zero``'s step and broadcasts
    (module docstring); register the result with ``ddp.register_comm_hook(state, ...)``.

    Args:
        hook: the communication hook that reduces each bucket (torch's ``allreduce_hook``, ...);
            its future returns the bucket's reduced flat tensor.
        ddp: the ``DistributedDataParallel`` model (its parameters must be ``zero``'s).
        zero: a ZeroRedundancyOptimizer built with ``overlap_with_ddp=True``.
        shard_buckets: accepted for torch's signature; ownership is already per parameter.
    """
    round_ = _checked(hook, ddp, zero)
    del ddp, shard_buckets

    def hook_with_zero_fn(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        round_.add(bucket.parameters(), future, _BucketGradients(bucket))
        if bucket.is_last():
            round_.finish(step=True)
        return future

    return hook_with_zero_fn


def hook_with_zero_step_interleaved(
    hook: CommHook, ddp: torch.nn.Module, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False
) -> CommHook:
    """``hook`` with each bucket's step chained to its reduction (it runs as soon as the bucket's
    gradients are reduced, while backward goes on), and the broadcasts after the last bucket
    (module docstring); register the result with ``ddp.register_comm_hook(state, ...)``.

    Args:
        hook: the communication hook that reduces each bucket (torch's ``allreduce_hook``, ...).
        ddp: the ``DistributedDataParallel`` model (its parameters must be ``zero``'s).
        zero: a ZeroRedundancyOptimizer built with ``overlap_with_ddp=True``.
        shard_buckets: accepted for torch's signature; ownership is already per parameter.
    """
    round_ = _checked(hook, ddp, zero)
    del ddp, shard_buckets

    def hook_with_zero_interleaved_fn(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        params, gradients = bucket.parameters(), _BucketGradients(bucket)

        def step(reduced: torch.futures.Future) -> Any:
            value = reduced.value()
            zero._step_owned(params, gradients.of(value))
            return value

        stepped = hook(state, bucket).then(step)
        round_.add(params, stepped, gradients)
        if bucket.is_last():
            round_.finish(step=False)
        return stepped

    return hook_with_zero_interleaved_fn
