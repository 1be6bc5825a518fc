"""torch's ``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of its shard of the
parameters only (ZeRO stage 1).

    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    loss_fn(ddp_model(x), y).backward()      # gradients averaged by DDP
    optimizer.step()                          # this rank's shard stepped, then every shard broadcast

The partition is torch's: for each param group in turn, its parameters, largest first, go one by
one to the rank holding the fewest elements so far; each parameter belongs to one rank. A step
runs ``optimizer_class`` (torch's or a user's) on this rank's parameters, then every rank
broadcasts the parameters it owns (with ``parameters_as_bucket_view``, one flat buffer per rank
and device, which the parameters view: :func:`functional_bagua.flatten_parameters`). So the
numbers are those of ``optimizer_class`` on all the parameters, with ``1/world`` of its state per rank.

``consolidate_state_dict(to)`` gathers the ranks' local states on rank ``to``; ``state_dict()`` (an
error there before it) returns torch's optimizer format over all the parameters, keyed by their
index in ``param_groups``, which ``optimizer_class`` itself can load. Beyond torch:
``load_state_dict`` takes such a state saved at any world size (each rank keeps what it owns now),
and loads through the local optimizer's own ``load_state_dict``, so a fused optimizer's ``step``
tensors land where it needs them (torch moved every 0-dim state tensor to the CPU).

With ``overlap_with_ddp=True`` the step runs inside DDP's backward, from the communication hook
that :func:`~functional_bagua.compat.optim.ddp_zero_hook.hook_with_zero_step` (or its interleaved sibling) builds:
as each DDP bucket's all-reduce completes, this rank steps the parameters of that bucket it owns,
on the reduced gradients, and every owner broadcasts its updated parameters (module
:mod:`~functional_bagua.compat.optim.ddp_zero_hook`). The partition stays the one above, so the
numbers are ``optimizer_class``'s from the first step on (torch's version skips the first two or
three steps while it learns DDP's buckets, and refuses gloo).
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from functional_bagua.flat import flatten_parameters, split_like

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


def partition(param_groups: list[dict[str, Any]], world_size: int) -> list[list[dict[str, Any]]]:
    """torch's partition (module docstring): per rank, its param groups (copies of ``param_groups``
    holding that rank's parameters, possibly none).

    Args:
        param_groups: the optimizer's param groups.
        world_size: the number of ranks.
    """
    per_rank: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for group in param_groups:
        owned: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            owned[rank].append(p)
            sizes[rank] += p.numel()
        for rank in range(world_size):
            per_rank[rank].append({**group, "params": owned[rank]})
    return per_rank


def _copy_hyperparameters(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Every key but ``params`` from each group of ``source`` into the matching group of ``target``."""
    for src, dst in zip(source, target):
        dst.update({k: v for k, v in src.items() if k != "params"})


class _ZeroJoinHook(JoinHook):
    """Under ``Join``, a rank out of inputs still steps, so that the others' broadcasts find it."""

    def __init__(self, zero: "ZeroRedundancyOptimizer") -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """``optimizer_class`` with its state sharded over the ranks (module docstring).

    Args:
        params: parameters or param groups, as for any torch optimizer.
        optimizer_class: the optimizer class each rank runs on its shard (a class; torch's or a user's).
        process_group: the group; ``None`` for the default group.
        parameters_as_bucket_view: keep each rank's parameters in one flat buffer per device and
            broadcast those (fewer, larger broadcasts).
        overlap_with_ddp: step inside DDP's backward instead of in :meth:`step`, through a
            communication hook from :mod:`~functional_bagua.compat.optim.ddp_zero_hook` (module
            docstring); ``parameters_as_bucket_view`` is then ignored, as torch ignores it.
        defaults: ``optimizer_class``'s arguments (``lr=...``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: Callable[..., torch.optim.Optimizer],
        process_group: Optional[dist.ProcessGroup] = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        if not inspect.isclass(optimizer_class):
            raise TypeError(
                f"ZeroRedundancyOptimizer: optimizer_class must be an optimizer class such as torch.optim.AdamW, "
                f"got {type(optimizer_class).__name__} {optimizer_class!r}"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ZeroRedundancyOptimizer: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first"
            )
        params = _checked_params(params)
        _check_same_dense_type(params)
        self.initialized = False
        torch.optim.Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        self.process_group: dist.ProcessGroup = dist.group.WORLD if process_group is None else process_group  # type: ignore[assignment]
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.global_rank = dist.get_global_rank(self.process_group, self.rank)
        self.overlapping = overlap_with_ddp
        self.parameters_as_bucket_view = parameters_as_bucket_view and not overlap_with_ddp
        self._optimizer_class: Callable[..., torch.optim.Optimizer] = optimizer_class  # type: ignore[assignment]
        self._partition = partition(self.param_groups, self.world_size)
        self._owner = self._owners()
        self._shadows: dict[int, torch.Tensor] = {}  # overlapping: parameter -> the tensor the local optimizer steps
        self._step_lock = threading.Lock()
        self.optim: torch.optim.Optimizer = self._optimizer_class(
            [self._local_group(g) for g in self._partition[self.rank]], **defaults
        )
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._trainable = self._trainable_mask()
        self._buckets: list[list[torch.Tensor]] = []  # per rank, its flat buffers
        self._build_buckets()
        self._all_state_dicts: list[dict[str, Any]] = []
        self.initialized = True

    # ---- who owns what ---------------------------------------------------------------------------

    def _owners(self) -> dict[int, int]:
        """``id(parameter)`` -> the rank that owns it."""
        return {id(p): rank for rank, groups in enumerate(self._partition) for g in groups for p in g["params"]}

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """The param group this rank's optimizer holds: ``group`` itself, or, when overlapping with
        DDP, one over shadows of its parameters (``p.detach()``: the same storage, a ``.grad`` of
        its own that the DDP hook sets to the reduced gradient without touching ``p.grad``)."""
        if not self.overlapping:
            return group
        for p in group["params"]:
            self._shadows[id(p)] = p.detach()
        return {**group, "params": [self._shadows[id(p)] for p in group["params"]]}

    @property
    def _overlap_with_ddp(self) -> bool:
        raise TypeError(
            "functional_bagua's ZeroRedundancyOptimizer overlaps with DDP through "
            "functional_bagua.compat.optim.hook_with_zero_step / hook_with_zero_step_interleaved; torch's hooks "
            "read torch's private state. Import the hook from functional_bagua.compat.optim instead."
        )

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter, in param-group order (a list attribute in torch's class, which join hooks read)."""
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _build_buckets(self) -> None:
        """With ``parameters_as_bucket_view``, each rank's trainable parameters move into flat
        buffers (one per dtype and device) that they view; frozen ones get storage of their own."""
        self._buckets = []
        if not self.parameters_as_bucket_view:
            return
        for groups in self._partition:
            owned = [p for g in groups for p in g["params"]]
            for p in owned:
                if not p.requires_grad:
                    p.data = p.data.detach().clone()
            trainable = [p for p in owned if p.requires_grad]
            self._buckets.append(list(flatten_parameters(trainable)[1].values()) if trainable else [])

    # ---- the step ------------------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Step this rank's shard with ``optimizer_class``, then broadcast every rank's parameters.

        Args:
            closure: re-evaluates the model and returns the loss, for optimizers that need it.
            kwargs: passed to the local optimizer's ``step``.
        """
        if self.overlapping:
            logger.warning(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True).step() does nothing: DDP's communication hook steps "
                "the parameters during backward; leave step() out of the training loop"
            )
            return None
        Join.notify_join_context(self)
        mask = self._trainable_mask()
        if mask != self._trainable:
            logger.warning("ZeroRedundancyOptimizer: the trainable parameters changed; rebuilding the buckets")
            self._build_buckets()
            self._trainable = mask
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._broadcast_shards()
        return loss

    @torch.no_grad()
    def _broadcast_shards(self) -> None:
        """Every rank's parameters (or buffers) from their owner, launched together, then awaited."""
        works = []
        for rank in range(self.world_size):
            src = dist.get_global_rank(self.process_group, rank)
            tensors = (
                self._buckets[rank]
                if self.parameters_as_bucket_view
                else [p.data for g in self._partition[rank] for p in g["params"]]
            )
            works += [dist.broadcast(t, src, group=self.process_group, async_op=True) for t in tensors]
        for work in works:
            work.wait()

    # ---- the step inside DDP's backward (overlap_with_ddp) ---------------------------------------------

    def _step_owned(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Step the parameters among ``params`` that this rank owns, on ``grads`` (reduced), with the
        local optimizer; the others are left alone. Thread-safe (interleaved hooks step from the
        communication threads)."""
        mine = [(p, self._shadows[id(p)], g) for p, g in zip(params, grads) if id(p) in self._shadows]
        if not mine:
            return
        with self._step_lock:
            _copy_hyperparameters(self.param_groups, self.optim.param_groups)
            if any(p.untyped_storage().data_ptr() != shadow.untyped_storage().data_ptr() for p, shadow, _ in mine):
                raise RuntimeError(
                    "ZeroRedundancyOptimizer(overlap_with_ddp=True): a parameter's storage was replaced after the "
                    "optimizer was built (model.to(), p.data = ...); build the optimizer after moving the model"
                )
            for _, shadow, g in mine:
                shadow.grad = g
            try:
                self.optim.step()
            finally:
                for _, shadow, _ in mine:
                    shadow.grad = None

    @torch.no_grad()
    def _launch_broadcasts(self, params: list[torch.Tensor]) -> list[tuple[Any, torch.Tensor, list[torch.Tensor]]]:
        """Broadcast ``params`` from their owners, one flat tensor per owner, in rank order (the same
        on every rank): (work, the flat tensor, the parameters to unpack it into once it arrives)."""
        launched = []
        for rank in range(self.world_size):
            unpack: list[torch.Tensor] = []
            owned = [p for p in params if self._owner[id(p)] == rank]
            if not owned:
                continue
            src = dist.get_global_rank(self.process_group, rank)
            if len(owned) == 1 and owned[0].is_contiguous():
                flat = owned[0].detach()
            elif rank == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in owned])
            else:
                flat = owned[0].new_empty(sum(p.numel() for p in owned))
                unpack = owned
            launched.append((dist.broadcast(flat, src, group=self.process_group, async_op=True), flat, unpack))
        return launched

    @staticmethod
    @torch.no_grad()
    def _finish_broadcasts(launched: list[tuple[Any, torch.Tensor, list[torch.Tensor]]]) -> None:
        for work, flat, unpack in launched:
            work.wait()
            for p, piece in zip(unpack, split_like(flat, unpack) if unpack else []):  # receivers of a packed flat
                p.copy_(piece)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of all the parameters, owned or not.

        Args:
            set_to_none: drop the gradients instead of zeroing them.
        """
        torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group on every rank (every rank must call it); this rank's optimizer gets its
        share of the new parameters (the partition of the earlier groups does not change).

        Args:
            param_group: a param group, as torch's optimizers take it.
        """
        super().add_param_group(param_group)
        if not self.initialized:
            return
        self._partition = partition(self.param_groups, self.world_size)
        self._owner = self._owners()
        self.optim.add_param_group(self._local_group(self._partition[self.rank][-1]))
        self._trainable = self._trainable_mask()
        self._build_buckets()

    # ---- state dicts ------------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's local optimizer state on rank ``to`` (every rank must call it).

        Args:
            to: the rank (within the process group) that receives the states.
        """
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        gathered: Optional[list] = [None] * self.world_size if self.rank == to else None
        dist.gather_object(
            self.optim.state_dict(),
            gathered,
            dst=dist.get_global_rank(self.process_group, to),
            group=self.process_group,
        )
        self._all_state_dicts = list(gathered) if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in torch's format (parameters indexed over ``param_groups``),
        as last consolidated on this rank.

        Raises:
            RuntimeError: before :meth:`consolidate_state_dict` brought the states to this rank.
        """
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to save the global state."
            )
        index = {id(p): i for i, p in enumerate(self._all_params)}
        packed = torch.optim.Optimizer.state_dict(self)
        state: dict[int, Any] = {}
        for rank, local in enumerate(self._all_state_dicts):
            owned = [p for g in self._partition[rank] for p in g["params"]]
            for local_index, p in enumerate(owned):  # torch numbers a local optimizer's parameters in order
                if local_index in local["state"]:
                    state[index[id(p)]] = local["state"][local_index]
        packed["state"] = dict(sorted(state.items()))
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole-optimizer state (from :meth:`state_dict`, saved at any world size, or from
        ``optimizer_class`` itself): this rank keeps the entries of the parameters it owns.

        Args:
            state_dict: torch's optimizer format over all the parameters.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "ZeroRedundancyOptimizer.load_state_dict: the state dict's param groups do not match this "
                f"optimizer's ({[len(g['params']) for g in groups]} vs {[len(g['params']) for g in self.param_groups]} parameters)"
            )
        index = {id(p): i for i, p in enumerate(self._all_params)}
        local_state, local_index = {}, 0
        local_groups = []
        for group, mine in zip(groups, self._partition[self.rank]):
            indices = []
            for p in mine["params"]:
                saved = state_dict["state"].get(index[id(p)])
                if saved is not None:
                    local_state[local_index] = copy.deepcopy(saved)
                indices.append(local_index)
                local_index += 1
            local_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)

    # ---- Join ---------------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that keeps a rank without inputs stepping under ``torch.distributed.algorithms.Join``.

        Args:
            kwargs: unused (torch's signature).
        """
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._all_params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


def _checked_params(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list of tensors or of param groups; a clear error for anything else."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
    try:
        listed = list(params)
    except TypeError as e:
        raise TypeError(
            f"`params` argument should be an iterable of Tensors or dicts, but got {type(params).__name__}"
        ) from e
    if not listed:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if not (all(isinstance(p, torch.Tensor) for p in listed) or all(isinstance(p, dict) for p in listed)):
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    for i, group in enumerate(listed):
        if isinstance(group, dict):
            if "params" not in group:
                raise ValueError("each parameter group passed in `params` needs a 'params' key")
            group_params = group["params"]
            listed[i] = {
                **group,
                "params": [group_params] if isinstance(group_params, torch.Tensor) else list(group_params),
            }
    return listed


def _check_same_dense_type(params: list[Any]) -> None:
    """torch's rule: every parameter dense, of one type (dtype and device)."""
    listed = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    tensors = [t for t in listed if isinstance(t, torch.Tensor)]  # torch.optim names anything else
    if any(t.layout != torch.strided for t in tensors) or len({(t.dtype, t.device) for t in tensors}) > 1:
        raise ValueError(
            "ZeroRedundancyOptimizer only supports using the same dense type for all parameters; got "
            f"{sorted({f'{t.layout} {t.dtype} on {t.device}' for t in tensors})}"
        )
