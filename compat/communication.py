"""Bagua's communication API (``bagua.torch_api.communication``), as thin calls of torch.distributed.

    import functional_bagua.compat as bagua

    bagua.init_process_group()                  # from torchrun's environment: gloo on CPU, nccl with CUDA
    group = bagua.communication.new_group(ranks=[0, 1])
    bagua.allreduce_inplace(tensor, op=bagua.ReduceOp.AVG, comm=group.get_global_communicator())

A :class:`BaguaProcessGroup` is a torch process group plus Bagua's attributes (``ranks``,
``group_name``, ``intra_ranks``, ``inter_ranks``); a communicator (``group.get_global_communicator()``)
is what the collectives take as ``comm`` (``None``: the default group's). Ranks given to a
collective (``src``, ``dst``) are ranks within the communicator, as in Bagua. A process outside a
communicator's group returns at once from every collective, as Bagua's do.

Beyond Bagua: any backend torch.distributed has (gloo on the CPU, NCCL on CUDA), tensors on any
device the backend takes, and ``to_bagua_process_group`` accepts every torch process group
(Bagua's accepted NCCL groups only). Differences: ``ReduceOp.AVG`` is a sum divided by the group
size (gloo has no average), and a reduce leaves the non-destination ranks' tensors untouched (as
NCCL does; gloo alone would leave partial sums there).
"""

from __future__ import annotations

import atexit
import enum
import functools
import gc
import os
import socket
import weakref
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from functional_bagua.compat.autotune import AutotuneClient, AutotuneService, run_flask_app, start_autotune_server  # noqa: F401  # Bagua's module exports them
from functional_bagua.compat.backend import get_backend  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.utils import apply_flattened_call, flatten, unflatten  # noqa: F401  # flatten, unflatten: Bagua's module exports them
from functional_bagua.distributed import collectives

__all__ = [
    "ReduceOp",
    "BaguaProcessGroup",
    "Communicator",
    "CommMember",
    "init_process_group",
    "is_initialized",
    "new_group",
    "from_torch_group",
    "to_bagua_process_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_size",
    "send",
    "recv",
    "broadcast",
    "reduce",
    "reduce_inplace",
    "allreduce",
    "allreduce_inplace",
    "allgather",
    "allgather_inplace",
    "gather",
    "gather_inplace",
    "scatter",
    "scatter_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
]


class ReduceOp(enum.IntEnum):
    """Bagua's reduction operators (the same values as Bagua's)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # then divided by the group size
}


_BITWISE = {ReduceOp.BOR: torch.bitwise_or, ReduceOp.BAND: torch.bitwise_and, ReduceOp.BXOR: torch.bitwise_xor}


def _all_reduce(tensor: torch.Tensor, op: ReduceOp, group: "BaguaProcessGroup") -> None:
    """``tensor`` reduced over ``group`` in place with Bagua's ``op``. NCCL has no bitwise
    reductions: for tensors off the CPU, BOR/BAND/BXOR gather every rank's tensor and fold here."""
    op = ReduceOp(op)
    if op in _BITWISE and tensor.device.type != "cpu":
        _all_reduce_by_gathering(tensor, op, group)
    else:
        dist.all_reduce(tensor, op=_TORCH_OPS[op], group=group.torch_group)
    _reduced(tensor, op, group)


def _all_reduce_by_gathering(tensor: torch.Tensor, op: ReduceOp, group: "BaguaProcessGroup") -> None:
    """A bitwise ``op`` over ``group`` as an all-gather and a fold on every rank."""
    pieces = [torch.empty_like(tensor) for _ in group.ranks]
    dist.all_gather(pieces, tensor.contiguous(), group=group.torch_group)
    tensor.copy_(functools.reduce(_BITWISE[op], pieces))


class CommMember(enum.Enum):
    """``NON_COMM_MEMBER``: what a process outside a group gets for the group's communicators;
    ``WORLD``: the default group (Bagua's name, taken wherever ``comm=`` is)."""

    NON_COMM_MEMBER = 0
    WORLD = 1


class comm:  # noqa: N801  # Bagua's name
    """Bagua's older spelling of ``CommMember.WORLD``."""

    WORLD = CommMember.WORLD


# ---- environment (torchrun sets these variables) ------------------------------------------------


def get_rank() -> int:
    """This process's global rank: ``RANK`` (0 when unset), as Bagua reads it."""
    return int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    """The number of processes: ``WORLD_SIZE`` (1 when unset), as Bagua reads it."""
    return int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    """This process's rank on its machine: ``LOCAL_RANK`` (0 when unset), as Bagua reads it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_local_size() -> int:
    """The number of processes on this machine: ``LOCAL_WORLD_SIZE`` (1 when unset), as Bagua reads it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


# ---- process groups ------------------------------------------------------------------------------


class Communicator:
    """A :class:`BaguaProcessGroup` as the collectives take it (``comm=``): ``rank()`` and
    ``nranks()`` within the group.

    Args:
        group: the process group this communicator talks to.
    """

    def __init__(self, group: "BaguaProcessGroup") -> None:
        self.group = group

    def rank(self) -> int:
        """This process's rank within the group."""
        return dist.get_rank(self.group.torch_group)

    def nranks(self) -> int:
        """The number of processes in the group."""
        return dist.get_world_size(self.group.torch_group)


class BaguaProcessGroup:
    """A torch process group with Bagua's attributes (module docstring); made by :func:`new_group`,
    :func:`from_torch_group` or :func:`init_process_group` (the default group).

    Args:
        ranks: the global ranks in the group, sorted.
        torch_group: the torch process group over those ranks (``None`` on a process outside it).
        group_name: the group's name (a counter, as Bagua's).
        stream: a CUDA stream, kept for Bagua's signature (torch's backends choose their own).
        borrowed: ``torch_group`` belongs to the caller (:func:`from_torch_group`): held weakly,
            and a RuntimeError once it is gone.
    """

    def __init__(
        self,
        ranks: list[int],
        torch_group: Optional[dist.ProcessGroup],
        group_name: str,
        stream: object = None,
        *,
        borrowed: bool = False,
    ) -> None:
        # a torch group given by the caller (from_torch_group) is borrowed: held weakly, so that it
        # goes when its owner and torch.distributed let it go (as Bagua's cache lets it)
        self._torch_group: Any = weakref.ref(torch_group) if borrowed and torch_group is not None else torch_group
        self.ranks, self.group_name, self.stream = ranks, group_name, stream
        local_size, rank = get_local_size(), dist.get_rank()
        node = rank // local_size
        self.intra_ranks = [r for r in ranks if r // local_size == node]
        self.inter_ranks = [r for r in ranks if r % local_size == ranks[0] % local_size]
        _pg_group_ranks[self] = {global_rank: group_rank for group_rank, global_rank in enumerate(ranks)}
        _pg_map[group_name] = self

    @property
    def torch_group(self) -> Optional[dist.ProcessGroup]:
        """The torch process group (``None`` on a process outside it); a RuntimeError once a
        borrowed one is gone (``None`` would mean the default group to torch's collectives)."""
        held = self._torch_group
        if not isinstance(held, weakref.ref):
            return held
        group = held()
        if group is None:
            raise RuntimeError(
                f"the torch process group Bagua group {self.group_name!r} was made from is gone (destroyed); "
                "make a new one and call from_torch_group (or pg.bagua_patch()) again"
            )
        return group

    def is_member(self) -> bool:
        """Whether this process is in the group."""
        return dist.get_rank() in self.ranks

    def get_inter_node_communicator(self) -> Union[Communicator, CommMember]:
        """The communicator over the group's ranks with the first rank's local rank, one per node
        (:func:`get_communicator`)."""
        return get_communicator(self.group_name, "inter")

    def get_intra_node_communicator(self) -> Union[Communicator, CommMember]:
        """The communicator over the group's ranks on this process's node (:func:`get_communicator`)."""
        return get_communicator(self.group_name, "intra")

    def get_global_communicator(self) -> Union[Communicator, CommMember]:
        """The communicator over all ranks of the group (``CommMember.NON_COMM_MEMBER`` outside it)."""
        return Communicator(self) if self.is_member() else CommMember.NON_COMM_MEMBER

    def __repr__(self) -> str:
        return f"BaguaProcessGroup(name={self.group_name!r}, ranks={self.ranks})"


# Bagua's records of the groups made in this process (its module keeps them so): each group's global
# rank -> rank in the group, and each group by name. The default group, the number of groups
# named so far and the default store are read live (module __getattr__).
_pg_group_ranks: dict = {}
_pg_map: dict = {}


def __getattr__(name: str) -> Any:
    if name == "_default_pg":
        return _groups.default
    if name == "_group_count":
        return _groups.count
    if name == "_default_store":
        return _default_store_now()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _default_store_now() -> Optional[dist.Store]:
    """torch.distributed's default store (the one the default process group rendezvoused with), or
    ``None`` before it is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _check_default_pg() -> None:
    """An AssertionError unless the default Bagua group exists (Bagua's helper)."""
    assert _groups.default is not None, "Default process group is not initialized"


def _get_rank_mappings() -> dict[int, tuple[int, int]]:
    """``{global rank: (node rank, local rank)}`` for every process of the default group, gathered
    from all of them (every process must call it)."""
    _check_default_pg()
    gathered: list = [None] * get_world_size()
    dist.all_gather_object(gathered, (get_node_rank(), get_local_rank()))
    return {rank: tuple(pair) for rank, pair in enumerate(gathered)}


def broadcast_nccl_unique_id(comm_key: str, root: int) -> str:
    """A fresh random id (NCCL's 128 bytes, in hex) made on rank ``root`` and shared with every
    process through the default store under ``comm_key`` (every process must call it; torch makes
    its own NCCL communicators, so the id only serves scripts that want a shared one).

    Args:
        comm_key: the store key, unique per id.
        root: the rank that makes the id.
    """
    store = _default_store_now()
    if store is None:
        raise RuntimeError("broadcast_nccl_unique_id: call init_process_group() first (the id goes through its store)")
    if get_rank() == root:
        unique_id = os.urandom(128).hex()
        store.set(comm_key, unique_id)
        return unique_id
    return str(store.get(comm_key), encoding="utf-8")


@functools.lru_cache(maxsize=None)
def get_hyperparameters_service_client() -> AutotuneClient:
    """The client of the autotuning service (:mod:`functional_bagua.compat.autotune`: answered in
    this process)."""
    return AutotuneClient(get_master_addr(), _autotune_service_port)


def _find_free_bagua_service_port(store: dist.Store) -> int:
    """The port of Bagua's service: ``BAGUA_SERVICE_PORT`` where set, else a free port found by
    rank 0 and shared through ``store`` (every process must call it).

    Args:
        store: a store every process can reach (the default group's).
    """
    port = get_bagua_service_port()
    if port > 0:
        return port
    if get_rank() == 0:
        port = find_free_network_port()
        store.set("bagua_service_port", str(port))
        return port
    return int(store.get("bagua_service_port"))


class _Registry:
    """The default group and the names given so far; one per process (what torch.distributed's own
    default group is to torch)."""

    def __init__(self) -> None:
        self.default: Optional[BaguaProcessGroup] = None
        self.count = 0
        self.of_torch_group: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # torch group -> ours
        self.communicators: dict = {}  # (group name, "inter" or "intra") -> Communicator

    def name(self) -> str:
        self.count += 1
        return str(self.count - 1)


_groups = _Registry()


def init_process_group(store: Optional[dist.Store] = None) -> None:
    """Initialize torch.distributed from torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``), unless it is initialized already, and make the default Bagua group
    over all ranks. With CUDA: NCCL for CUDA tensors (gloo for CPU ones), and this process's
    current device is GPU ``LOCAL_RANK`` (Bagua's rule); without: gloo.

    The process group is destroyed when the process exits (gloo aborts a process that exits
    without it, and Bagua's scripts never destroy it themselves).

    Args:
        store: a ``torch.distributed.Store`` to rendezvous through, instead of the environment.

    Raises:
        RuntimeError: when called a second time in a process.
    """
    if _groups.default is not None:
        raise RuntimeError("init_process_group was called twice; the default Bagua group exists already")
    if not dist.is_initialized():
        if torch.cuda.is_available():  # this rank's GPU; gloo beside NCCL for CPU tensors and objects
            device: Optional[torch.device] = torch.device("cuda", get_local_rank())
            torch.cuda.set_device(device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            device, backend = None, "gloo"
        if store is None:
            dist.init_process_group(backend, device_id=device)
        else:
            dist.init_process_group(
                backend, store=store, rank=get_rank(), world_size=get_world_size(), device_id=device
            )
        atexit.register(_destroy_at_exit)
    default_group()  # made here, over the world


def _destroy_at_exit() -> None:
    """Destroy the process group at exit, once nothing of ours references it any more: a gloo group
    kept alive past ``destroy_process_group`` (here, by a wrapped model and its engine, which
    reference each other and wait for the garbage collector) keeps its worker threads, and the
    interpreter's shutdown then aborts the process ("terminate called without an active exception")."""
    _groups.default = None
    _groups.of_torch_group.clear()
    _groups.communicators.clear()
    _pg_group_ranks.clear()
    _pg_map.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def is_initialized() -> bool:
    """Whether :func:`init_process_group` has made the default Bagua group."""
    return _groups.default is not None and dist.is_initialized()


def default_group() -> BaguaProcessGroup:
    """The default Bagua group: the one :func:`init_process_group` made, or, where torch.distributed
    was initialized directly, one over its default group; a RuntimeError naming the fix before either."""
    if _groups.default is None and dist.is_available() and dist.is_initialized():
        _groups.default = BaguaProcessGroup(list(range(dist.get_world_size())), dist.group.WORLD, _groups.name())
    if not is_initialized() or _groups.default is None:
        raise RuntimeError(
            "Bagua's process group is not initialized: call functional_bagua.compat.init_process_group() first "
            "(under torchrun, or with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set)"
        )
    return _groups.default


def new_group(ranks: Optional[Sequence[int]] = None, stream: object = None) -> BaguaProcessGroup:
    """A new group over ``ranks`` (all ranks when ``None``). Every process must call it, in the same
    order, also those not in ``ranks`` (as torch's ``new_group``).

    Args:
        ranks: global ranks, each in ``[0, world size)``; sorted.
        stream: a CUDA stream, kept for Bagua's signature.
    """
    world = default_group()
    chosen = sorted(ranks) if ranks is not None else list(world.ranks)
    bad = [r for r in chosen if not 0 <= r < dist.get_world_size()]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are not in [0, {dist.get_world_size()})")
    torch_group = dist.new_group(chosen)
    member = torch_group if dist.get_rank() in chosen else None
    return BaguaProcessGroup(chosen, member, _groups.name(), stream)


def from_torch_group(group: dist.ProcessGroup, stream: object = None) -> BaguaProcessGroup:
    """The Bagua group over the same ranks as the torch process group ``group`` (it uses ``group``
    itself; no new group is made, so only the processes in ``group`` need to call this).

    Args:
        group: a torch process group this process belongs to.
        stream: a CUDA stream, kept for Bagua's signature.
    """
    known = _groups.of_torch_group.get(group)
    if known is not None:
        return known
    made = BaguaProcessGroup(sorted(dist.get_process_group_ranks(group)), group, _groups.name(), stream, borrowed=True)
    _groups.of_torch_group[group] = made
    return made


def get_communicator(group_name: str, comm_name: str) -> Union[Communicator, CommMember]:
    """The communicator ``comm_name`` of the group named ``group_name``: ``"global"`` (all its
    ranks), ``"intra"`` (its ranks on this process's node) or ``"inter"`` (its ranks whose local
    rank is its first rank's: one per node); ``CommMember.NON_COMM_MEMBER`` on a process
    outside it.

    The intra- and inter-node communicators are torch subgroups, made at their first use and kept.
    As torch's ``new_group``, that first call must be made by every process of the job, in the
    same order (Bagua asks it of the group's processes): the group must be one every process made
    (:func:`new_group`, the default group), not one made from a torch group on its members only
    (a RuntimeError says so).

    Args:
        group_name: a group's ``group_name`` (``_pg_map``'s keys).
        comm_name: ``"global"``, ``"inter"`` or ``"intra"``.
    """
    if comm_name not in ("global", "inter", "intra"):
        raise ValueError(f"comm_name should be one of ['global', 'inter', 'intra'], got {comm_name!r}")
    if group_name not in _pg_map:
        raise KeyError(f"no process group is named {group_name!r}; known: {sorted(_pg_map)}")
    group = _pg_map[group_name]
    if comm_name == "global":
        return group.get_global_communicator()
    key = (group_name, comm_name)
    if key not in _groups.communicators:
        if isinstance(group._torch_group, weakref.ref):
            raise RuntimeError(
                f"the {comm_name}-node communicator of group {group_name!r} would be made by every process, but this "
                "group was made from a torch process group on its members only; make it with "
                "bagua.communication.new_group(ranks) on every process instead"
            )
        _groups.communicators[key] = _subgroup_communicator(group, comm_name)
    return _groups.communicators[key]


def _subgroup_communicator(group: BaguaProcessGroup, comm_name: str) -> Union[Communicator, CommMember]:
    """The intra- or inter-node subgroup of ``group`` holding this process, made by every process
    in one order (every node's intra-node group, or the one inter-node group), as torch requires."""
    local_size = get_local_size()
    if comm_name == "inter":
        layouts = [[r for r in group.ranks if r % local_size == group.ranks[0] % local_size]]
    else:
        nodes = sorted({r // local_size for r in group.ranks})
        layouts = [[r for r in group.ranks if r // local_size == node] for node in nodes]
    mine: Union[Communicator, CommMember] = CommMember.NON_COMM_MEMBER
    for ranks in layouts:
        torch_group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = Communicator(BaguaProcessGroup(ranks, torch_group, f"{group.group_name}_{comm_name}", group.stream))
    return mine


class BaguaProcessGroupPatch:
    """Bagua's methods on torch's ``ProcessGroup`` (given to it on import,
    :func:`patch_torch_process_group`): ``pg.bagua_patch()`` makes (once) the Bagua group of a
    torch group, ``pg.bagua_pg`` is it, and ``pg.bagua_get_*_communicator()`` its communicators."""

    def bagua_patch(self, stream: object = None) -> Any:
        from_torch_group(self, stream)  # type: ignore[arg-type]
        return self

    @property
    def bagua_pg(self) -> BaguaProcessGroup:
        known = _groups.of_torch_group.get(self)
        if known is None:
            raise RuntimeError("this torch process group has no Bagua process group yet: call pg.bagua_patch() first")
        return known

    def bagua_get_global_communicator(self) -> Union[Communicator, CommMember]:
        return get_communicator(self.bagua_pg.group_name, "global")

    def bagua_get_inter_node_communicator(self) -> Union[Communicator, CommMember]:
        return get_communicator(self.bagua_pg.group_name, "inter")

    def bagua_get_intra_node_communicator(self) -> Union[Communicator, CommMember]:
        return get_communicator(self.bagua_pg.group_name, "intra")


def patch_torch_process_group() -> None:
    """Give torch's ``ProcessGroup`` the methods of :class:`BaguaProcessGroupPatch` (Bagua's patch)."""
    for name, member in vars(BaguaProcessGroupPatch).items():
        if name.startswith("bagua"):
            setattr(dist.ProcessGroup, name, member)


def to_bagua_process_group(process_group: object = None) -> BaguaProcessGroup:
    """``None`` -> the default Bagua group; a torch process group -> :func:`from_torch_group`; a
    :class:`BaguaProcessGroup` as it is; anything else raises a TypeError.

    Args:
        process_group: ``None``, a ``torch.distributed.ProcessGroup`` or a :class:`BaguaProcessGroup`.
    """
    if process_group is None:
        return default_group()
    if isinstance(process_group, BaguaProcessGroup):
        return process_group
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "to_bagua_process_group: this process is not in that torch process group (torch's new_group gave it "
            "GroupMember.NON_GROUP_MEMBER); only its members can use it"
        )
    if isinstance(process_group, dist.ProcessGroup):
        return from_torch_group(process_group)
    raise TypeError(
        f"expected None, a torch.distributed process group or a BaguaProcessGroup, got {type(process_group).__name__}"
    )


def _get_default_group() -> BaguaProcessGroup:
    """Bagua's name of :func:`default_group` (Bagua's own tests call it)."""
    return default_group()


def _rank_not_in_comm(comm: object) -> bool:
    """Whether ``comm`` is the marker this process gets outside a group (Bagua's helper)."""
    return comm is CommMember.NON_COMM_MEMBER


def _rank_not_in_group(group: Optional[BaguaProcessGroup] = None) -> bool:
    """Whether this process is outside ``group`` (``None``: the default group, which holds every
    process); Bagua's helper, which its tests import."""
    if group is None:
        return False
    return _rank_not_in_comm(group.get_global_communicator())


# Bagua's cache of the Bagua group of each torch process group (the one from_torch_group keeps)
_torch_to_bagua_pg_map = _groups.of_torch_group


# ---- collectives ---------------------------------------------------------------------------------


def _resolve(comm: object) -> Optional[BaguaProcessGroup]:
    """The group of ``comm`` (``None``: the default group's), or ``None`` outside it."""
    if comm is CommMember.NON_COMM_MEMBER:
        return None
    if comm is None or comm is CommMember.WORLD:
        return default_group()
    if isinstance(comm, Communicator):
        return comm.group
    if isinstance(comm, BaguaProcessGroup):
        return comm if comm.is_member() else None
    raise TypeError(f"comm must be a communicator (group.get_global_communicator()) or None, got {type(comm).__name__}")


def _global(group: BaguaProcessGroup, rank: int) -> int:
    """The global rank of ``rank`` within ``group``."""
    if not 0 <= rank < len(group.ranks):
        raise ValueError(f"rank {rank} is not in the communicator, which has {len(group.ranks)} ranks")
    return group.ranks[rank]


def _reduced(tensor: torch.Tensor, op: ReduceOp, group: BaguaProcessGroup) -> None:
    """``AVG``'s division by the group size, in place (the sum was taken by torch)."""
    if ReduceOp(op) == ReduceOp.AVG:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
        tensor.div_(len(group.ranks))


def _rows(tensor: torch.Tensor, n: int, what: str) -> list[torch.Tensor]:
    """``tensor`` as ``n`` equal contiguous pieces (views)."""
    if tensor.numel() % n or not tensor.is_contiguous():
        raise ValueError(
            f"{what}: a contiguous tensor of a multiple of {n} elements is needed, got {tuple(tensor.shape)}"
        )
    return list(tensor.view(n, -1).unbind(0))


def send(tensor: torch.Tensor, dst: int, comm: object = None) -> None:
    """Send ``tensor`` to rank ``dst`` of the communicator.

    Args:
        tensor: the tensor to send.
        dst: the receiving rank, within the communicator.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        dist.send(tensor, _global(group, dst), group=group.torch_group)


def recv(tensor: torch.Tensor, src: int, comm: object = None) -> None:
    """Receive into ``tensor`` from rank ``src`` of the communicator.

    Args:
        tensor: where the message lands (shape and dtype of what ``src`` sends).
        src: the sending rank, within the communicator.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        dist.recv(tensor, _global(group, src), group=group.torch_group)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: object = None) -> None:
    """Rank ``src``'s ``tensor`` on every rank, in place.

    Args:
        tensor: sent from ``src``, overwritten elsewhere.
        src: the sending rank, within the communicator.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        dist.broadcast(tensor, _global(group, src), group=group.torch_group)


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: object = None) -> None:
    """The reduction of every rank's ``tensor``, written into rank ``dst``'s; the others' stay as they were.

    Args:
        tensor: this rank's contribution (and, on ``dst``, the result).
        dst: the receiving rank, within the communicator.
        op: a :class:`ReduceOp`.
        comm: a communicator, or ``None`` for the default group's.
    """
    reduce(tensor, tensor, dst, op, comm)


def reduce(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: object = None
) -> None:
    """The reduction of every rank's ``send_tensor`` into rank ``dst``'s ``recv_tensor``.

    Args:
        send_tensor: this rank's contribution (not changed).
        recv_tensor: on ``dst``, where the result goes (untouched on the others).
        dst: the receiving rank, within the communicator.
        op: a :class:`ReduceOp`.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    work = send_tensor.detach().clone()
    if ReduceOp(op) in _BITWISE and work.device.type != "cpu":
        _all_reduce(work, op, group)  # NCCL: no bitwise reduce (see _all_reduce)
    else:
        dist.reduce(work, _global(group, dst), op=_TORCH_OPS[ReduceOp(op)], group=group.torch_group)
        _reduced(work, op, group)
    if dist.get_rank() == _global(group, dst):
        recv_tensor.copy_(work)


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: object = None) -> None:
    """The reduction of every rank's ``tensor``, on every rank, in place.

    Args:
        tensor: this rank's contribution, overwritten with the result.
        op: a :class:`ReduceOp`.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        _all_reduce(tensor, op, group)


def allreduce(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: object = None
) -> None:
    """The reduction of every rank's ``send_tensor`` into ``recv_tensor``, on every rank (the two may
    be the same tensor).

    Args:
        send_tensor: this rank's contribution.
        recv_tensor: where the result goes.
        op: a :class:`ReduceOp`.
        comm: a communicator, or ``None`` for the default group's.
    """
    if recv_tensor is not send_tensor:
        recv_tensor.copy_(send_tensor)
    allreduce_inplace(recv_tensor, op, comm)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: object = None) -> None:
    """Every rank's ``send_tensor``, back to back in rank order, in ``recv_tensor`` on every rank.

    Args:
        send_tensor: this rank's piece.
        recv_tensor: a contiguous tensor of ``nranks * send_tensor.numel()`` elements.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        pieces = _rows(recv_tensor, len(group.ranks), "allgather")
        dist.all_gather(pieces, send_tensor.reshape(-1).contiguous(), group=group.torch_group)


def allgather_inplace(tensor: torch.Tensor, comm: object = None) -> None:
    """``tensor`` holds ``nranks`` pieces; every rank's own piece (at its rank's position) ends up
    on every rank.

    Args:
        tensor: a contiguous tensor of ``nranks`` equal pieces.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        pieces = _rows(tensor, len(group.ranks), "allgather_inplace")
        mine = pieces[group.ranks.index(dist.get_rank())].clone()
        dist.all_gather(pieces, mine, group=group.torch_group)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm: object = None) -> None:
    """Every rank's ``send_tensor``, back to back in rank order, in rank ``dst``'s ``recv_tensor``.

    Args:
        send_tensor: this rank's piece.
        recv_tensor: on ``dst``, a contiguous tensor of ``nranks * send_tensor.numel()`` elements.
        dst: the receiving rank, within the communicator.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    target = _global(group, dst)
    pieces = _rows(recv_tensor, len(group.ranks), "gather") if dist.get_rank() == target else None
    dist.gather(send_tensor.reshape(-1).contiguous(), pieces, dst=target, group=group.torch_group)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: object = None) -> None:
    """On rank ``dst``, ``tensor`` (``nranks * count`` elements) gets every rank's first ``count``
    elements (its own piece at its rank's position); elsewhere ``tensor`` holds ``count`` elements.

    Args:
        tensor: this rank's piece (and on ``dst`` the whole result).
        count: the elements per rank.
        dst: the receiving rank, within the communicator.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    target = _global(group, dst)
    if dist.get_rank() == target:
        pieces = _rows(tensor, len(group.ranks), "gather_inplace")
        mine = pieces[group.ranks.index(target)].clone()
        dist.gather(mine, pieces, dst=target, group=group.torch_group)
    else:
        dist.gather(tensor.reshape(-1)[:count].contiguous(), None, dst=target, group=group.torch_group)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm: object = None) -> None:
    """Piece ``r`` of rank ``src``'s ``send_tensor`` into rank ``r``'s ``recv_tensor``.

    Args:
        send_tensor: on ``src``, a contiguous tensor of ``nranks * recv_tensor.numel()`` elements.
        recv_tensor: where this rank's piece lands.
        src: the sending rank, within the communicator.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    source = _global(group, src)
    pieces = _rows(send_tensor, len(group.ranks), "scatter") if dist.get_rank() == source else None
    out = torch.empty(recv_tensor.numel(), dtype=recv_tensor.dtype, device=recv_tensor.device)
    dist.scatter(out, pieces, src=source, group=group.torch_group)
    recv_tensor.copy_(out.view(recv_tensor.shape))


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: object = None) -> None:
    """On rank ``src`` ``tensor`` holds ``nranks * count`` elements; rank ``r`` receives piece ``r``
    into its ``tensor`` (``count`` elements; ``src`` keeps its whole tensor).

    Args:
        tensor: on ``src`` the pieces, elsewhere where this rank's piece lands.
        count: the elements per rank.
        src: the sending rank, within the communicator.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    source = _global(group, src)
    if dist.get_rank() == source:
        pieces = _rows(tensor, len(group.ranks), "scatter_inplace")
        out = pieces[group.ranks.index(source)].clone()
        dist.scatter(out, pieces, src=source, group=group.torch_group)
    else:
        out = torch.empty(count, dtype=tensor.dtype, device=tensor.device)
        dist.scatter(out, None, src=source, group=group.torch_group)
        tensor.reshape(-1)[:count].copy_(out)


def reduce_scatter(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: object = None
) -> None:
    """Piece ``r`` of the reduction of every rank's ``send_tensor``, into rank ``r``'s ``recv_tensor``.

    Args:
        send_tensor: a contiguous tensor of ``nranks * recv_tensor.numel()`` elements.
        recv_tensor: where this rank's reduced piece lands.
        op: a :class:`ReduceOp`.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    _rows(send_tensor, len(group.ranks), "reduce_scatter")
    if ReduceOp(op) in _BITWISE and send_tensor.device.type != "cpu":  # NCCL: see _all_reduce
        whole = send_tensor.detach().reshape(-1).clone()
        _all_reduce(whole, op, group)
        out = whole.view(len(group.ranks), -1)[group.ranks.index(dist.get_rank())]
    else:
        out = torch.empty(recv_tensor.numel(), dtype=recv_tensor.dtype, device=recv_tensor.device)
        collectives.reduce_scatter_single_into(
            out, send_tensor.reshape(-1).contiguous(), op=_TORCH_OPS[ReduceOp(op)], group=group.torch_group
        )
        _reduced(out, op, group)
    recv_tensor.copy_(out.view(recv_tensor.shape))


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: object = None) -> None:
    """``tensor`` holds ``nranks`` pieces; this rank's piece (at its rank's position) becomes the
    reduction of every rank's piece there.

    Args:
        tensor: a contiguous tensor of ``nranks`` equal pieces.
        op: a :class:`ReduceOp`.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        pieces = _rows(tensor, len(group.ranks), "reduce_scatter_inplace")
        reduce_scatter(tensor, pieces[group.ranks.index(dist.get_rank())], op, comm)


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: object = None) -> None:
    """Piece ``j`` of every rank's ``send_tensor`` to rank ``j``, where the pieces land in rank order.

    Args:
        send_tensor: a contiguous tensor of ``nranks`` equal pieces.
        recv_tensor: a tensor of as many elements.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    _rows(send_tensor, len(group.ranks), "alltoall")
    out = torch.empty(recv_tensor.numel(), dtype=recv_tensor.dtype, device=recv_tensor.device)
    dist.all_to_all_single(out, send_tensor.reshape(-1).contiguous(), group=group.torch_group)
    recv_tensor.copy_(out.view(recv_tensor.shape))


def alltoall_inplace(tensor: torch.Tensor, comm: object = None) -> None:
    """:func:`alltoall` with ``tensor`` as both the pieces sent and where the received ones land.

    Args:
        tensor: a contiguous tensor of ``nranks`` equal pieces.
        comm: a communicator, or ``None`` for the default group's.
    """
    alltoall(tensor.clone(), tensor, comm)


def alltoall_v(
    send_tensor: torch.Tensor,
    send_counts: Sequence[int],
    send_displs: Sequence[int],
    recv_tensor: torch.Tensor,
    recv_counts: Sequence[int],
    recv_displs: Sequence[int],
    comm: object = None,
) -> None:
    """All-to-all with pieces of their own sizes: ``send_counts[j]`` elements from offset
    ``send_displs[j]`` of ``send_tensor`` go to rank ``j``, which puts them at ``recv_displs[r]``.

    Args:
        send_tensor: the elements to send.
        send_counts: elements sent to each rank.
        send_displs: where each rank's elements start in ``send_tensor``.
        recv_tensor: where received elements land.
        recv_counts: elements received from each rank.
        recv_displs: where each rank's elements land in ``recv_tensor``.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return
    flat_send = send_tensor.reshape(-1)
    sent = torch.cat([flat_send[d : d + c] for c, d in zip(send_counts, send_displs)])
    received = torch.empty(sum(recv_counts), dtype=recv_tensor.dtype, device=recv_tensor.device)
    dist.all_to_all_single(received, sent, list(recv_counts), list(send_counts), group=group.torch_group)
    flat_recv = recv_tensor.view(-1)
    for piece, c, d in zip(received.split(list(recv_counts)), recv_counts, recv_displs):
        flat_recv[d : d + c].copy_(piece)


def alltoall_v_inplace(
    tensor: torch.Tensor,
    send_counts: Sequence[int],
    send_displs: Sequence[int],
    recv_counts: Sequence[int],
    recv_displs: Sequence[int],
    comm: object = None,
) -> None:
    """:func:`alltoall_v` with ``tensor`` as both what is sent and where received pieces land.

    Args:
        tensor: the elements sent, overwritten with those received.
        send_counts: elements sent to each rank.
        send_displs: where each rank's elements start.
        recv_counts: elements received from each rank.
        recv_displs: where each rank's elements land.
        comm: a communicator, or ``None`` for the default group's.
    """
    alltoall_v(tensor.clone(), send_counts, send_displs, tensor, recv_counts, recv_displs, comm)


def barrier(comm: object = None) -> None:
    """Wait until every rank of the communicator gets here.

    Args:
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is not None:
        dist.barrier(group=group.torch_group)


def allreduce_coalesced_inplace(
    tensors: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM, comm: object = None
) -> None:
    """:func:`allreduce_inplace` of several tensors of one dtype at once (one flat buffer, one
    collective), each overwritten with its reduced values (Bagua's function).

    Args:
        tensors: the tensors, all of one dtype and device.
        op: the reduction.
        comm: a communicator, or ``None`` for the default group's.
    """
    if _resolve(comm) is not None and tensors:
        apply_flattened_call(tensors, allreduce_inplace, [op, comm])


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0, comm: object = None) -> None:
    """:func:`broadcast` of several tensors of one dtype at once (one flat buffer), each
    overwritten with rank ``src``'s values (Bagua's function).

    Args:
        tensors: the tensors, all of one dtype and device.
        src: the rank (within the communicator's group) whose values everyone gets.
        comm: a communicator, or ``None`` for the default group's.
    """
    if _resolve(comm) is not None and tensors:
        apply_flattened_call(tensors, broadcast, [src, comm])


def broadcast_object(obj: object, src: int = 0, comm: object = None) -> object:
    """Rank ``src``'s ``obj`` (any picklable object) on every rank of the communicator, returned
    (Bagua's function: ``state = broadcast_object(optimizer.state_dict(), 0)``).

    Args:
        obj: the object to send (read on rank ``src`` only).
        src: the rank (within the communicator's group) that sends.
        comm: a communicator, or ``None`` for the default group's.
    """
    group = _resolve(comm)
    if group is None:
        return obj
    payload = [obj if dist.get_rank() == _global(group, src) else None]
    dist.broadcast_object_list(payload, _global(group, src), group=group.torch_group)
    return payload[0]


# ---- Bagua's environment readers (bagua.torch_api.env, which its communication module re-exports)


def get_master_addr() -> str:
    """The address of rank 0's host (``MASTER_ADDR``; 127.0.0.1 if unset, as Bagua)."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def get_node_rank() -> int:
    """This node's rank among the nodes: ``GROUP_RANK`` under an elastic launcher (torchrun, which
    sets ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``), else ``NODE_RANK``; 0
    if unset (Bagua's rule)."""
    elastic = {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}.issubset(os.environ)
    return int(os.environ.get("GROUP_RANK" if elastic else "NODE_RANK", 0))


def get_default_bucket_size() -> int:
    """Bagua's default communication bucket size in bytes (``BAGUA_DEFAULT_BUCKET_SIZE``, 10 MiB)."""
    return int(os.environ.get("BAGUA_DEFAULT_BUCKET_SIZE", 10 * 1024**2))


def get_autotune_server_wait_time() -> int:
    """Seconds Bagua waits for its autotuning service (``BAGUA_AUTOTUNE_SERVER_WAIT_TIME``, 300 if
    unset). There is no such service here; Bagua's scripts read the number."""
    return int(os.environ.get("BAGUA_AUTOTUNE_SERVER_WAIT_TIME", 300))


# Bagua's autotuning service (start_autotune_server sets these; the service answers in process)
_autotune_server: Optional[object] = None
_autotune_service_port: Optional[int] = None


def _bagua_backend_comm(comm: object = None) -> object:
    """``comm``, or ``None`` where this process is outside it (Bagua's helper)."""
    return None if _rank_not_in_comm(comm) else comm


def get_bagua_service_port() -> int:
    """The port of Bagua's autotuning service (``BAGUA_SERVICE_PORT``; -1 if unset). There is no
    such service here; Bagua's scripts read the number."""
    return int(os.environ.get("BAGUA_SERVICE_PORT", -1))


def find_free_network_port() -> int:
    """A TCP port that is free on this host's loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
