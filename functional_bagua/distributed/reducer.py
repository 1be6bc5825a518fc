"""Gradient averaging that overlaps backward: torch DDP's reducer, on the buckets and codecs of
:mod:`functional_bagua.distributed`.

The parameters are cut into DDP's buckets (:func:`~functional_bagua.distributed.assign_buckets`:
reverse order, DDP's sizes or ``bucket_cap_mb`` each), and each bucket gets one flat gradient buffer. During
``backward()`` a hook on every parameter copies its gradient into its slot (with
``gradient_as_bucket_view`` the ``.grad`` becomes that slot, so later backward passes accumulate
there without a copy) and marks it ready; a bucket whose gradients are all ready is launched at
once, asynchronously, while backward goes on computing the gradients of the earlier layers. So
that every rank issues the same collectives in the same order, bucket ``k`` is launched only after
buckets ``0 .. k-1``. When backward ends, the buckets still open are launched (the slots of
parameters that got no gradient hold zeros), every bucket is awaited, and each ``.grad`` holds::

    g = sum_r (g_r / n)        (average=True, n ranks; torch DDP's rounding: scaled, then summed)

(the sum without ``average``; with a ``compression``, the codec's result, see
:mod:`~functional_bagua.distributed.compression`). So after ``loss.backward()`` the gradients
are those of the global batch, as with torch's DDP, and the optimizer steps as usual.

Parameters that got no gradient on this rank: with ``find_unused_parameters`` their use is
agreed across the ranks (one more small all-reduce), and a parameter no rank used keeps its
``.grad`` as it was (``None`` after ``zero_grad()``), as torch's DDP leaves it; one used elsewhere
gets the averaged gradient. Without it they count as zeros, with a warning naming them (torch's
DDP raises at the next step instead; here no rank waits for a bucket that never fills).

Example (under ``torchrun --nproc-per-node 2``)::

    reducer = fbd.GradientReducer(list(model.named_parameters()), bucket_cap_mb=25)
    loss_fn(model(x), y).backward()          # gradients averaged over the ranks on return
    optimizer.step()
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from functional_bagua.distributed import buckets as bucketing
from functional_bagua.distributed import compression as codecs
from functional_bagua.distributed.process_group import Agreement, Group, resolve

NAME = "GradientReducer"


class _Bucket:
    """One bucket: the indices of its parameters (in launch order), its flat gradient buffer and
    each parameter's view of it; ``ready`` counts the gradients in place this backward."""

    def __init__(self, indices: list[int], params: list[torch.Tensor]) -> None:
        self.indices = indices
        first = params[indices[0]]
        numel = sum(params[i].numel() for i in indices)
        self.buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
        self.views = bucketing.unpack(self.buffer, params, indices)
        self.ready = 0


class GradientReducer:
    """Average the gradients of ``named_params`` over the ranks during each ``backward()`` (module
    docstring). Every rank must construct it with the same parameters (names, shapes and dtypes) and
    settings, at the same point: the constructor checks that across the ranks (a ValueError on
    every rank otherwise).

    Args:
        named_params: ``(name, parameter)`` pairs in the model's order (``model.named_parameters()``);
            parameters that do not require a gradient are left out.
        group: the process group; ``None`` for the default group.
        bucket_cap_mb: the bucket size in MiB, as DDP's; must be positive. ``None`` (default) for
            DDP's defaults: the first bucket 1 MiB, the others 25.
        average: the mean over the ranks (``True``) or the sum.
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"minmax_uint8"``
            (``functional_bagua.distributed.COMPRESSIONS``).
        gradient_as_bucket_view: make each ``.grad`` a view of its bucket's buffer (no copy into
            the bucket after the first backward, nor back into ``.grad`` after the reduction).
        find_unused_parameters: agree across the ranks on which parameters got a gradient (module
            docstring).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        average: bool = True,
        compression: Optional[str] = None,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        first_cap, cap = bucketing.bucket_caps(bucket_cap_mb, NAME)
        codecs.check_compression(compression)
        named = [(name, p) for name, p in named_params if p.requires_grad]
        if not named:
            raise ValueError(f"{NAME}: no parameter requires a gradient; there is nothing to average")
        for name, p in named:
            if p.layout != torch.strided:
                raise TypeError(f"{NAME}: parameter {name!r} is {p.layout}; only dense parameters are supported")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.group: Group = resolve(group, NAME)
        self.average, self.compression = average, compression
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        settings = dict(
            bucket_cap_mb=bucket_cap_mb,
            average=average,
            compression=compression,
            find_unused_parameters=find_unused_parameters,
        )
        detached = [p.detach() for p in self.params]
        Agreement(NAME, settings).init(dict(zip(self.names, detached)), self.group)
        self.buckets = [_Bucket(indices, detached) for indices in bucketing.assign_buckets(detached, cap, first_cap)]
        self._slot: dict[int, tuple[_Bucket, torch.Tensor]] = {}  # parameter index -> its bucket and view
        for bucket in self.buckets:
            for i, view in zip(bucket.indices, bucket.views):  # views in each parameter's shape
                self._slot[i] = (bucket, view)
        self.enabled = True
        self._in_backward = False
        self._received: list[bool] = [False] * len(self.params)
        self._next = 0  # the next bucket to launch
        self._pending: list = []  # (bucket, async work or lazy result), in launch order
        self._warned_unused = False
        self.used_in_last_backward: Optional[list[bool]] = None  # this rank's, per parameter
        self._adopt_existing_grads()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    # ---- public ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the block, backward passes only accumulate the local gradients; the first
        backward after it averages everything accumulated (as DDP's ``no_sync``)."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def bind(self, params: Sequence[torch.Tensor]) -> None:
        """Average the gradients of ``params`` from now on: new tensors in place of the ones the
        reducer was built with (the same shapes and dtypes, in the same order), such as the fresh
        leaves a functional training step differentiates each step. The buckets stay.

        Args:
            params: one tensor per parameter the reducer averages, each requiring a gradient.
        """
        params = list(params)
        if len(params) != len(self.params) or any(
            p.shape != q.shape or p.dtype != q.dtype or p.device != q.device for p, q in zip(params, self.params)
        ):
            raise ValueError(
                f"{NAME}.bind: the tensors must match the parameters the reducer was built with "
                f"({len(self.params)} tensors of the same shapes, dtypes and devices, in order)"
            )
        self.remove()
        self.params = params
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def remove(self) -> None:
        """Remove the gradient hooks: backward no longer averages anything."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def bytes_per_step(self) -> int:
        """The bytes this rank hands to the collectives per synchronized backward (after compression)."""
        n = self.group.world_size
        return sum(
            codecs.payload_bytes(b.buffer.numel(), b.buffer.element_size(), n, self.compression) for b in self.buckets
        )

    # ---- during backward -------------------------------------------------------------------

    @torch.no_grad()
    def _adopt_existing_grads(self) -> None:
        if not self.gradient_as_bucket_view:
            return
        for i, p in enumerate(self.params):
            _, view = self._slot[i]
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = view

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        """Parameter ``i``'s gradient hook. It holds the reducer weakly: the parameter keeps its
        hooks where the garbage collector cannot see them, so a strong reference (parameter ->
        hook -> reducer -> parameter) would keep the reducer, its buffers and its process group
        alive for good. Keep a reference to the reducer while training."""
        reducer = weakref.ref(self)

        def on_gradient(p: torch.Tensor) -> None:
            me = reducer()
            if me is not None and me.enabled:
                me._ready(i, p)

        return on_gradient

    @torch.no_grad()
    def _ready(self, i: int, p: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket, view = self._slot[i]
        grad = p.grad
        if grad is not view:
            if grad is None or grad.layout != torch.strided:
                raise RuntimeError(f"{NAME}: parameter {self.names[i]!r} got a gradient that is not dense")
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                p.grad = view
        if not self._received[i]:
            self._received[i] = True
            bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the buckets that are complete, in order."""
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(
            self.buckets[self._next].indices
        ):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        g = self.group
        if self.compression is None:
            if self.average:
                bucket.buffer.mul_(1.0 / g.world_size)
            work = dist.all_reduce(bucket.buffer, group=g.group, async_op=True)
            self._pending.append((bucket, work))
        else:
            self._pending.append((bucket, codecs.all_reduce([bucket.buffer], g, self.average, self.compression)[0]))

    @torch.no_grad()
    def _finish(self) -> None:
        """At the end of backward: launch what is left, await everything, hand out the gradients."""
        self._in_backward = False
        missing = [i for i, got in enumerate(self._received) if not got]
        for i in missing:
            bucket, view = self._slot[i]
            view.zero_()
            bucket.ready += 1
        if missing and not self.find_unused_parameters and not self._warned_unused:
            self._warned_unused = True
            warnings.warn(
                f"{NAME}: {len(missing)} parameters got no gradient in this backward pass "
                f"({', '.join(repr(self.names[i]) for i in missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                "they count as zeros. Pass find_unused_parameters=True if some of the model is unused on purpose.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._launch_ready()
        used = self._used_anywhere() if self.find_unused_parameters else None  # every rank, every step
        for bucket, pending in self._pending:
            if isinstance(pending, torch.Tensor):
                bucket.buffer.copy_(pending)
            else:
                pending.wait()
        for i, p in enumerate(self.params):
            if not self._received[i] and used is not None and not used[i]:
                continue  # no rank used it: its .grad stays as it was
            _, view = self._slot[i]
            if p.grad is view:
                continue
            if self.gradient_as_bucket_view:
                p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
        self._pending = []
        self._next = 0
        self.used_in_last_backward = self._received
        self._received = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.ready = 0

    @torch.no_grad()
    def shadow(self) -> None:
        """The collectives of one synchronized backward, with zeros for every gradient: what a
        rank that has run out of batches runs while the others still train (torch's ``Join``
        context manager calls it through the compat layer's join hook), so that theirs complete
        and their average counts this rank's share as zero, as torch's DDP does under ``Join``.
        The parameters' gradients are not touched."""
        g = self.group
        pending = []
        for bucket in self.buckets:  # in the order the training ranks launch them
            zeros = torch.zeros_like(bucket.buffer)
            if self.compression is None:
                pending.append(dist.all_reduce(zeros, group=g.group, async_op=True))
            else:
                pending.append(codecs.all_reduce([zeros], g, self.average, self.compression)[0])
        if self.find_unused_parameters:  # the training ranks' _used_anywhere: this rank used none
            flags = torch.zeros(len(self.params), dtype=torch.int32, device=self.buckets[0].buffer.device)
            dist.all_reduce(flags, group=g.group)
        for work in pending:
            if isinstance(work, torch.Tensor):
                work.clone()  # waits for it
            else:
                work.wait()

    def _used_anywhere(self) -> list[bool]:
        """Whether each parameter got a gradient on some rank (one all-reduce of the flags)."""
        flags = torch.tensor(self._received, dtype=torch.int32, device=self.buckets[0].buffer.device)
        dist.all_reduce(flags, group=self.group.group)
        return (flags > 0).tolist()
