"""Bagua's asynchronous model averaging: a background thread averages the weights over the ranks
every ``sync_interval_ms`` while training goes on.

For the first ``warmup_steps`` training steps the gradients are averaged as by GradientAllReduce.
Then (after a reset that broadcasts rank 0's weights and optimizer state) each rank starts a
thread that loops::

    stop?       rank 0's decision, broadcast (so that every rank stops after the same round)
    s = w                              a snapshot, taken under the weight lock
    a = sum_r s[r]                     all-reduce on a process group of the thread's own
    w <- w + (a / n - s)               under the lock: the average, plus what training changed meanwhile
    sleep sync_interval_ms

The training step holds the weight lock from its forward to the end of its optimizer step (Bagua
held it for forward and backward only, so that the thread could write weights while the optimizer
did). On CUDA the thread runs on a stream of its own, ordered against training by events rather
than by sharing the default stream: the training step records an event as it releases the lock
and the thread's stream waits for it before reading or writing the weights; the thread records
one after its write and the next training step waits for it after taking the lock. Training's
kernels and the thread's copies and all-reduce then overlap wherever they touch different memory.

``abort(model)`` stops the thread (every rank calls it: a barrier first) and ``resume(model)``
starts it again; both may be called twice in a row. A thread left running stops when the process
exits, before the process group is destroyed.
"""

from __future__ import annotations

import atexit
import enum
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, engine_on_demand
from functional_bagua.compat.algorithms.gradient_allreduce import GradientAllReduceAlgorithmImpl
from functional_bagua.compat.bucket import BaguaBucket  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.communication import (  # noqa: F401  # Bagua's module exports them
    BaguaProcessGroup,
    _pg_group_ranks,
    barrier,
    get_rank,
    new_group,
)
from functional_bagua.compat.tensor import BaguaTensor  # noqa: F401  # Bagua's module exports it
from functional_bagua.flat import FlatLayout

if TYPE_CHECKING:
    from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]

JOIN_TIMEOUT_S = 60.0


class _AsyncInternalState(enum.IntEnum):
    """Where an implementation's averaging thread stands (Bagua's names): ``NEW`` before it first
    starts, ``STARTED`` while it runs, ``STOPPED`` after ``abort``. ``SCHEDULED`` is Bagua's state
    between submitting its loop and its running; a thread here runs once started, so it is never
    reported."""

    NEW = 0
    SCHEDULED = 1
    STARTED = 2
    STOPPED = 3


class _AveragingThread:
    """The background loop (module docstring) over ``weights``, on ``group`` (a process group of its own)."""

    def __init__(self, weights: list, group: dist.ProcessGroup, lock: threading.Lock, interval_s: float) -> None:
        self.weights, self.group, self.lock, self.interval_s = weights, group, lock, interval_s
        self.layout = FlatLayout.of([w.detach() for w in weights])
        device = weights[0].device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.trained: Optional[torch.cuda.Event] = None  # the training step's last write (CUDA)
        self.averaged: Optional[torch.cuda.Event] = None  # this thread's last write (CUDA)
        self.stop = threading.Event()
        self.rounds = 0
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="bagua-async-average", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.stream is not None:  # the current device and stream are per thread
                torch.cuda.set_device(self.stream.device)
                torch.cuda.set_stream(self.stream)
            while not self._agreed_to_stop():
                self._average_once()
                self.rounds += 1
                time.sleep(self.interval_s)
        except BaseException as e:  # kept for abort() to raise on the training thread
            self.error = e

    def _agreed_to_stop(self) -> bool:
        flag = torch.tensor([1 if self.stop.is_set() else 0], dtype=torch.int32, device=self.weights[0].device)
        dist.broadcast(flag, dist.get_global_rank(self.group, 0), group=self.group)
        return bool(flag.item())

    @torch.no_grad()
    def _average_once(self) -> None:
        with self.lock:
            self._after(self.trained)
            snapshot = self.layout.flatten([w.detach() for w in self.weights])
        sums = {key: buffer.clone() for key, buffer in snapshot.items()}
        n = dist.get_world_size(self.group)
        for key in sorted(sums):
            dist.all_reduce(sums[key], group=self.group)
        change = {key: sums[key] / n - snapshot[key] for key in sums}
        with self.lock:
            self._after(self.trained)  # a training step may have written since the snapshot
            for w, delta in zip(self.weights, self.layout.unflatten(change)):
                w.add_(delta)
            self.averaged = _recorded_event(self.stream)

    def _after(self, event: Optional[torch.cuda.Event]) -> None:
        """This thread's stream waits for ``event`` (CUDA; nothing to order on the CPU)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def training_step_begins(self) -> None:
        """Called by the training thread once it holds the lock: its stream waits for this
        thread's last write of the weights."""
        if self.stream is not None and self.averaged is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.averaged)

    def training_step_ends(self) -> None:
        """Called by the training thread before it releases the lock: an event after its writes."""
        if self.stream is not None:
            self.trained = _recorded_event(torch.cuda.current_stream(self.stream.device))

    def join(self) -> None:
        self.stop.set()
        self.thread.join(JOIN_TIMEOUT_S)
        if self.thread.is_alive():
            raise RuntimeError(f"the averaging thread did not stop within {JOIN_TIMEOUT_S} s (did every rank abort?)")
        if self.error is not None:
            raise RuntimeError(f"the averaging thread failed: {self.error!r}") from self.error


class AsyncModelAverageAlgorithmImpl(AlgorithmImpl):
    """Asynchronous model averaging (module docstring).

    Args:
        process_group: the group to average over.
        peer_selection_mode: ``"all"`` (the only mode Bagua implemented).
        sync_interval_ms: the pause between two averages, in milliseconds.
        warmup_steps: training steps with synchronous gradient averaging first.
    """

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        peer_selection_mode: str = "all",
        sync_interval_ms: int = 500,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(process_group)
        if peer_selection_mode != "all":
            raise ValueError(
                f"AsyncModelAverageAlgorithm supports peer_selection_mode='all' only, got {peer_selection_mode!r}"
            )
        if sync_interval_ms < 0 or warmup_steps < 0:
            raise ValueError(f"sync_interval_ms and warmup_steps must be >= 0, got {sync_interval_ms}, {warmup_steps}")
        self.sync_interval_ms, self.warmup_steps = sync_interval_ms, warmup_steps
        self.step_id = 0
        self.warmup = GradientAllReduceAlgorithmImpl(process_group)
        self.lock = threading.Lock()
        self.thread_group: Optional[dist.ProcessGroup] = None
        self.averager: Optional[_AveragingThread] = None
        self.weights: list = []
        self._holding = False  # whether the training thread holds the lock (a step is under way)
        self._exit_hook = False
        self._stopped = False  # aborted (or detached) since the thread last ran

    @property
    def status(self) -> _AsyncInternalState:
        """The averaging thread's state (``_AsyncInternalState``)."""
        if self.averager is not None:
            return _AsyncInternalState.STARTED
        return _AsyncInternalState.STOPPED if self._stopped else _AsyncInternalState.NEW

    @property
    def averaging(self) -> bool:
        """Whether the warmup is over (weights, not gradients, are averaged)."""
        return self.step_id > self.warmup_steps

    def need_reset(self) -> bool:
        self.step_id += 1
        return self.warmup_steps > 0 and self.step_id == self.warmup_steps + 1

    def init(self, ddp: "BaguaDistributedDataParallel") -> None:
        self.weights = [p for _, p in ddp.named_parameters_to_sync()]
        if self.thread_group is None:  # every rank makes it at the same point (wrap time)
            self.thread_group = dist.new_group(self.process_group.ranks)
            # its communicator now, from this thread (NCCL makes one at first use: here, not in the averaging thread)
            dist.all_reduce(torch.zeros(1, device=self.weights[0].device), group=self.thread_group)
        if self.step_id < self.warmup_steps:
            self.warmup.init(ddp)

    def set_gradient_sync(self, enabled: bool) -> None:
        self.warmup.set_gradient_sync(enabled)

    def before_forward(self, ddp: "BaguaDistributedDataParallel") -> None:
        if self.averager is not None and self.averager.error is not None:
            raise RuntimeError(f"the averaging thread failed: {self.averager.error!r}") from self.averager.error
        if not self.averaging or self.sync_interval_ms == 0:
            return
        if not self._holding:
            self.lock.acquire()
            self._holding = True
            if self.averager is not None:
                self.averager.training_step_begins()
        if self.averager is None:
            self._start()

    def after_step(self, ddp: "BaguaDistributedDataParallel", optimizer: torch.optim.Optimizer) -> None:
        if optimizer is ddp.bagua_optimizers[-1]:
            self._release()

    def _start(self) -> None:
        assert self.thread_group is not None
        self.averager = _AveragingThread(self.weights, self.thread_group, self.lock, self.sync_interval_ms / 1000)
        self._stopped = False
        if not self._exit_hook:
            atexit.register(self._stop_at_exit)
            self._exit_hook = True

    def _stop_at_exit(self) -> None:
        if self.averager is not None:
            self._release()
            self.averager.stop.set()
            self.averager.thread.join(JOIN_TIMEOUT_S)
            self.averager = None

    def _release(self) -> None:
        if self._holding:
            if self.averager is not None:
                self.averager.training_step_ends()
            self._holding = False
            self.lock.release()

    def abort(self, bagua_module: Any) -> None:
        """Stop the averaging thread after its current round; every rank must call it (a barrier
        first). Does nothing when no thread runs.

        Args:
            bagua_module: the wrapped model (``with_bagua``), its ``DistributedDataParallel`` or engine.
        """
        engine = _engine_of(bagua_module, self)
        if self.averager is None:
            return
        dist.barrier(group=engine.process_group.torch_group)
        self._release()
        averager, self.averager = self.averager, None
        averager.join()
        self._stopped = True

    def resume(self, bagua_module: Any) -> None:
        """Start the averaging thread again (after :meth:`abort`); every rank must call it. Does
        nothing while a thread runs or before the warmup is over.

        Args:
            bagua_module: the wrapped model (``with_bagua``), its ``DistributedDataParallel`` or engine.
        """
        engine = _engine_of(bagua_module, self)
        if self.averager is not None or not self.averaging:
            return
        dist.barrier(group=engine.process_group.torch_group)
        self._start()

    def detach(self, ddp: "BaguaDistributedDataParallel") -> None:
        self.warmup.detach(ddp)
        if self.averager is not None:
            self._release()
            averager, self.averager = self.averager, None
            averager.join()

    def rounds(self) -> int:
        """The averaging rounds the running thread has finished."""
        return 0 if self.averager is None else self.averager.rounds

    def buckets(self) -> list:
        return self.warmup.buckets()


def _recorded_event(stream: Optional[torch.cuda.Stream]) -> Optional[torch.cuda.Event]:
    """A CUDA event recorded on ``stream`` now (None without a stream)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _engine_of(bagua_module: Any, algorithm: AlgorithmImpl) -> "BaguaDistributedDataParallel":
    from functional_bagua.compat.bagua_module import ENGINE_ATTRIBUTE, BaguaDistributedDataParallel

    for candidate in (bagua_module, getattr(bagua_module, "inner", None), vars(bagua_module).get(ENGINE_ATTRIBUTE)):
        if isinstance(candidate, BaguaDistributedDataParallel) and candidate.bagua_algorithm is algorithm:
            return candidate
    raise TypeError(
        f"abort/resume need the model wrapped with this algorithm (with_bagua or DistributedDataParallel), "
        f"got {type(bagua_module).__name__}"
    )


class AsyncModelAverageAlgorithm(Algorithm):
    """Average the weights in a background thread while training runs (module docstring; Bagua's signature).

    Args:
        peer_selection_mode: ``"all"``.
        sync_interval_ms: the pause between two averages, in milliseconds.
        warmup_steps: training steps with synchronous gradient averaging first.
    """

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0) -> None:
        self.peer_selection_mode, self.sync_interval_ms, self.warmup_steps = (
            peer_selection_mode,
            sync_interval_ms,
            warmup_steps,
        )
        self._impls: weakref.WeakSet = weakref.WeakSet()  # the running implementations, not kept alive by us

    def reify(self, process_group: BaguaProcessGroup) -> AsyncModelAverageAlgorithmImpl:
        impl = AsyncModelAverageAlgorithmImpl(
            process_group, self.peer_selection_mode, self.sync_interval_ms, self.warmup_steps
        )
        self._impls.add(impl)
        return impl

    def abort(self, bagua_module: Any) -> None:
        """Stop the averaging thread of ``bagua_module`` (Bagua calls this on the algorithm).

        Args:
            bagua_module: the wrapped model, its ``DistributedDataParallel`` or engine.
        """
        _impl_of(bagua_module, self).abort(bagua_module)

    def resume(self, bagua_module: Any) -> None:
        """Start the averaging thread of ``bagua_module`` again.

        Args:
            bagua_module: the wrapped model, its ``DistributedDataParallel`` or engine.
        """
        _impl_of(bagua_module, self).resume(bagua_module)

    def rounds(self, bagua_module: Any) -> int:
        """The averaging rounds the running thread of ``bagua_module`` has finished (not in Bagua:
        how often the weights were averaged while training, which depends on timing; read it
        before ``abort``).

        Args:
            bagua_module: the wrapped model, its ``DistributedDataParallel`` or engine.
        """
        return _impl_of(bagua_module, self).rounds()


def _impl_of(bagua_module: Any, algorithm: AsyncModelAverageAlgorithm) -> AsyncModelAverageAlgorithmImpl:
    for impl in algorithm._impls:
        try:
            _engine_of(bagua_module, impl)
            return impl
        except TypeError:
            continue
    raise TypeError(f"{type(bagua_module).__name__} is not a model wrapped with this AsyncModelAverageAlgorithm")


__getattr__ = engine_on_demand(__name__)  # Bagua's module exports BaguaDistributedDataParallel
