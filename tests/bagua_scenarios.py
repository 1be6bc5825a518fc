"""Scenarios of the Bagua compat layer, run on each gloo rank by dist_harness.run_ranks (module
"bagua_scenarios"); test_compat_bagua.py checks the results against torch's own DDP and formulas.

Every rank seeds its model differently (``seed=rank``), as Bagua's tests do: wrapping must make
the replicas equal."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import errors_of
from models import batches, loss_fn, make_model

import functional_bagua.compat as bagua
from functional_bagua.compat.algorithms import async_model_average, bytegrad, decentralized, gradient_allreduce

DTYPE = torch.float64
STEPS = 4
TINY_BUCKETS_MB = 0.0005  # a few hundred bytes: several buckets even for the small test models
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
}


def local_batches(rank: int, world_size: int, steps: int = STEPS, seed: int = 1) -> list:
    """This rank's part of each global batch."""
    return [(x.chunk(world_size)[rank], y.chunk(world_size)[rank]) for x, y in batches(steps, DTYPE, seed=seed)]


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters, buffers and optimizer state tensors, by name (clones)."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer/{n}": b.detach().clone() for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in optimizer.state.items():
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                out[f"state/{names[id(p)]}/{key}"] = value.detach().clone()
    return out


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list, step=None) -> None:  # noqa: ANN001
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        (step or optimizer.step)()


def torch_ddp(rank: int, world_size: int, kind: str, optimizer: str, ignore: tuple = (), **ddp_kwargs) -> dict:  # noqa: ANN003
    """The reference: torch's own DistributedDataParallel."""
    model = make_model(kind, DTYPE, seed=rank)
    if ignore:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    opt = OPTIMIZERS[optimizer](model.parameters())
    train(ddp, opt, local_batches(rank, world_size))
    return state_of(model, opt)


def ours(rank: int, world_size: int, kind: str, optimizer: str, how: str, ignore: tuple = (), **kwargs) -> dict:  # noqa: ANN003
    model = make_model(kind, DTYPE, seed=rank)
    if ignore:
        model._bagua_params_and_buffers_to_ignore = list(ignore)
    opt = OPTIMIZERS[optimizer](model.parameters())
    algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
    if how == "with_bagua":
        net = model.with_bagua([opt], algorithm)
    else:
        net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm, **kwargs)
    train(net, opt, local_batches(rank, world_size))
    return state_of(model, opt)


def gradient_allreduce_against_torch_ddp(rank: int, world_size: int) -> dict:
    """GradientAllReduce via with_bagua and via DistributedDataParallel, and torch's DDP, on the
    same seeds and data: BatchNorm buffers, an ignored parameter, tiny buckets, two optimizers."""
    results = {}
    ignore = ("fc.bias",)
    for optimizer in OPTIMIZERS:
        results[f"torch/{optimizer}"] = torch_ddp(rank, world_size, "norm", optimizer, ignore)
        results[f"torch_tiny/{optimizer}"] = torch_ddp(
            rank, world_size, "norm", optimizer, ignore, bucket_cap_mb=TINY_BUCKETS_MB
        )
        results[f"with_bagua/{optimizer}"] = ours(rank, world_size, "norm", optimizer, "with_bagua", ignore)
        results[f"ddp/{optimizer}"] = ours(
            rank, world_size, "norm", optimizer, "ddp", ignore, bucket_cap_mb=TINY_BUCKETS_MB
        )
    return results


def v1_9_0_with_bagua_defaults(rank: int, world_size: int) -> dict:
    """DistributedDataParallel_V1_9_0 built as Bagua's own tests build it, with Bagua's defaults
    (no optimizers, GradientAllReduceAlgorithm()), and torch's DDP on the same seeds and data."""
    from functional_bagua.compat.data_parallel.distributed import DistributedDataParallel_V1_9_0

    results = {"torch": torch_ddp(rank, world_size, "shapes", "sgd")}
    model = make_model("shapes", DTYPE, seed=rank)
    net = DistributedDataParallel_V1_9_0(model)
    opt = OPTIMIZERS["sgd"](model.parameters())
    train(net, opt, local_batches(rank, world_size))
    results["v1_9_0"] = state_of(model, opt)
    return results


def buckets_launch_during_backward(rank: int, world_size: int) -> dict:
    """When the gradient backward computes last (the first layer's weight) arrives, the buckets
    that do not hold it are in flight already."""
    model = make_model("shapes", DTYPE, seed=0)
    first = model.conv.weight
    seen: list = []
    first.register_post_accumulate_grad_hook(lambda p: seen.append(len(net.inner.bagua_algorithm.reducer._pending)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt], bucket_cap_mb=TINY_BUCKETS_MB)
    x, y = local_batches(rank, world_size)[0]
    loss_fn(net(x), y).backward()
    return dict(launched_before_last=seen, buckets=len(net.bagua_buckets))


def no_sync_against_torch_ddp(rank: int, world_size: int) -> dict:
    """Two micro-batches accumulated under no_sync, then one synchronized: as torch's DDP."""
    out = {}
    for name in ("torch", "ours"):
        model = make_model("shapes", DTYPE, seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if name == "torch":
            net = torch.nn.parallel.DistributedDataParallel(model)
        else:
            net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt])
        for step, (x, y) in enumerate(local_batches(rank, world_size, steps=6)):
            if step % 3 < 2:
                with net.no_sync():
                    loss_fn(net(x), y).backward()
            else:
                loss_fn(net(x), y).backward()
                opt.step()
                opt.zero_grad()
        out[name] = state_of(model, opt)
    return out


def no_sync_under_decentralized(rank: int, world_size: int) -> dict:
    """Decentralized SGD with two micro-batches per step, the first under no_sync: no collective
    is left unwaited (before, each no_sync forward launched an average that nothing waited for),
    and the weights are those of one forward per step over both micro-batches (summed losses)."""
    from torch._C._distributed_c10d import _get_work_registry_size

    gen = torch.Generator().manual_seed(10 + rank)
    data = [
        (torch.randn(2, 6, 4, generator=gen, dtype=DTYPE), torch.randn(2, 6, 1, generator=gen, dtype=DTYPE))
        for _ in range(4)
    ]
    out = {}
    for name in ("micro-batches", "one forward"):
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DTYPE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net = model.with_bagua([opt], decentralized.DecentralizedAlgorithm(peer_selection_mode="all"))
        for x, y in data:
            if name == "micro-batches":
                with net.no_sync():
                    torch.nn.functional.mse_loss(net(x[0]), y[0]).backward()
                torch.nn.functional.mse_loss(net(x[1]), y[1]).backward()
            else:
                out_ = net(x.reshape(12, 4)).reshape(2, 6, 1)
                (torch.nn.functional.mse_loss(out_[0], y[0]) + torch.nn.functional.mse_loss(out_[1], y[1])).backward()
            opt.step()
            opt.zero_grad()
        out[name] = dict(params=[p.detach().clone() for p in model.parameters()], unwaited=_get_work_registry_size())
    # every second synchronized step averages, however many micro-batches each accumulates
    model = torch.nn.Linear(4, 1).to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = decentralized.DecentralizedAlgorithm(peer_selection_mode="all", communication_interval=2)
    net = model.with_bagua([opt], algorithm)
    for x, y in data:
        with net.no_sync():
            torch.nn.functional.mse_loss(net(x[0, :, :4]), y[0]).backward()
        torch.nn.functional.mse_loss(net(x[1, :, :4]), y[1]).backward()
        opt.step()
        opt.zero_grad()
    out["averages_at_interval_2"] = net.bagua_algorithm.communications
    return out


def join_with_no_sync_and_buffers(rank: int, world_size: int) -> dict:
    """Bagua's DDP wrapper (buffers broadcast) under Join with a no_sync micro-batch per step and
    2 and 4 steps on the two ranks: no forward broadcasts what the joined rank does not shadow
    (before, this hung until the process group's timeout); the replicas end equal."""
    from torch.distributed.algorithms.join import Join

    gen = torch.Generator().manual_seed(40 + rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1)).to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt])
    with Join([net]):
        for _ in range(2 + 2 * rank):
            x, y = torch.randn(2, 5, 4, generator=gen, dtype=DTYPE), torch.randn(2, 5, 1, generator=gen, dtype=DTYPE)
            with net.no_sync():
                torch.nn.functional.mse_loss(net(x[0]), y[0]).backward()
            torch.nn.functional.mse_loss(net(x[1]), y[1]).backward()
            opt.step()
            opt.zero_grad()
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def uneven_inputs_under_join(rank: int, world_size: int) -> dict:
    """Rank r trains 3 + 2 r steps inside torch's Join: torch's DDP, with_bagua and Bagua's DDP
    wrapper (gradient all-reduce, and ByteGrad for the wrapper), on the same seeds and data.
    Before, the rank that ran out of batches left the others waiting until the process group's
    timeout, and Join itself refused the module ('Sequential' object has no attribute 'join_hook')."""
    from torch.distributed.algorithms.join import Join

    gen = torch.Generator().manual_seed(20 + rank)
    data = [
        (torch.randn(6, 4, generator=gen, dtype=DTYPE), torch.randn(6, 1, generator=gen, dtype=DTYPE))
        for _ in range(3 + 2 * rank)
    ]
    out = {}
    for how in ("torch", "with_bagua", "ddp", "ddp_bytegrad"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DTYPE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if how == "torch":
            net = torch.nn.parallel.DistributedDataParallel(model)
        elif how == "with_bagua":
            net = model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
        else:
            algorithm = (
                bytegrad.ByteGradAlgorithm()
                if how == "ddp_bytegrad"
                else gradient_allreduce.GradientAllReduceAlgorithm()
            )
            net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
        with Join([net]):
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()
        out[how] = [p.detach().clone() for p in model.parameters()]
    return out


def join_with_an_averaging_algorithm(rank: int, world_size: int) -> str:
    from torch.distributed.algorithms.join import Join

    model = torch.nn.Linear(4, 1).to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = model.with_bagua([opt], decentralized.DecentralizedAlgorithm())
    with Join([net]):  # refused on every rank when the context is made, before any collective
        pass
    return "joined"


class PartlyUnused(torch.nn.Module):
    """``unused`` never gets a gradient; ``sometimes`` only on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(72, 4)
        self.sometimes = torch.nn.Linear(72, 4)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x.flatten(1))
        if dist.get_rank() == 0:
            out = out + self.sometimes(x.flatten(1))
        return out


def find_unused_parameters_against_torch_ddp(rank: int, world_size: int) -> dict:
    out = {}
    for name in ("torch", "ours"):
        torch.manual_seed(rank)
        model = PartlyUnused().to(DTYPE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if name == "torch":
            net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        else:
            net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt], find_unused_parameters=True)
        train(net, opt, local_batches(rank, world_size))
        out[name] = state_of(model, opt)
        out[f"{name}/unused_grad_is_none"] = model.unused.weight.grad is None
    return out


def broadcast_at_wrap_time(rank: int, world_size: int) -> dict:
    """Replicas trained apart (different seeds, data, optimizer state) equal rank 0's after wrapping."""
    out = {}
    for optimizer in OPTIMIZERS:
        model = make_model("norm", DTYPE, seed=rank)
        opt = OPTIMIZERS[optimizer](model.parameters())
        train(model, opt, local_batches(rank, world_size, seed=10 + rank))
        opt.param_groups[0]["lr"] = 0.5 + rank  # hyperparameters differ too
        model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
        out[optimizer] = state_of(model, opt)
        out[f"{optimizer}/lr"] = opt.param_groups[0]["lr"]
    return out


def model_switch(rank: int, world_size: int) -> dict:
    """One model wrapped in turn with ByteGrad, GradientAllReduce and ByteGrad again (Bagua's
    model-switch test): each wrap replaces the previous engine's hooks; the replicas stay equal."""
    model = make_model("shapes", DTYPE, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = local_batches(rank, world_size, steps=6)
    for i, algorithm in enumerate(
        [bytegrad.ByteGradAlgorithm(), gradient_allreduce.GradientAllReduceAlgorithm(), bytegrad.ByteGradAlgorithm()]
    ):
        model.with_bagua([opt], algorithm)
        train(model, opt, data[2 * i : 2 * i + 2])
    return dict(state=state_of(model, opt), hooks=len(next(model.parameters())._post_accumulate_grad_hooks or {}))


def bytegrad_against_float(rank: int, world_size: int) -> dict:
    """One backward under ByteGrad and under GradientAllReduce, from the same replicas."""
    out = {}
    for name, algorithm in (
        ("bytegrad", bytegrad.ByteGradAlgorithm()),
        ("float", gradient_allreduce.GradientAllReduceAlgorithm()),
    ):
        model = make_model("shapes", DTYPE, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.with_bagua([opt], algorithm)
        x, y = local_batches(rank, world_size)[0]
        loss_fn(model(x), y).backward()
        out[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    x, y = local_batches(rank, world_size)[0]
    model = make_model("shapes", DTYPE, seed=0)
    loss_fn(model(x), y).backward()
    out["local"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def fused_optimizer_with_bagua(rank: int, world_size: int) -> dict:
    """fuse_optimizer before and after with_bagua, stepped with fuse_step: as torch's DDP with a plain step."""
    out = {"torch": torch_ddp(rank, world_size, "shapes", "adam")}
    for order in ("fuse_first", "wrap_first"):
        model = make_model("shapes", DTYPE, seed=rank)
        opt = OPTIMIZERS["adam"](model.parameters())
        if order == "fuse_first":
            bagua.fuse_optimizer(opt)
            model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
        else:
            model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
            bagua.fuse_optimizer(opt)
        train(model, opt, local_batches(rank, world_size), step=opt.fuse_step)
        out[order] = state_of(model, opt)
        out[f"{order}/fused_count"] = opt._bagua_fused_count
    return out


def mismatched_models(rank: int, world_size: int) -> str:
    """Rank 1's model has another shape: with_bagua raises on every rank (no hang)."""
    model = torch.nn.Linear(4, 3 if rank == 0 else 2).to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    return "wrapped"


def mismatched_algorithms(rank: int, world_size: int) -> str:
    model = torch.nn.Linear(4, 3).to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = bytegrad.ByteGradAlgorithm() if rank else gradient_allreduce.GradientAllReduceAlgorithm()
    model.with_bagua([opt], algorithm)
    return "wrapped"


MISMATCHED_ARGUMENTS = {  # the same algorithm built with other arguments on rank 1
    "peer_selection_mode": lambda r: decentralized.DecentralizedAlgorithm(
        peer_selection_mode="shift_one" if r else "all"
    ),
    "communication_interval": lambda r: decentralized.DecentralizedAlgorithm(communication_interval=2 if r else 1),
    "sync_interval_ms": lambda r: async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=20 if r else 500),
    "warmup_steps": lambda r: async_model_average.AsyncModelAverageAlgorithm(warmup_steps=3 if r else 0),
    "hierarchical": lambda r: gradient_allreduce.GradientAllReduceAlgorithm(hierarchical=not r),
}


def mismatched_algorithm_arguments(rank: int, world_size: int) -> dict:
    """Each algorithm built with other arguments on rank 1: with_bagua raises the same ValueError
    on every rank (before, the decentralized and async cases hung at the first backward)."""
    out = {}
    for name, make in MISMATCHED_ARGUMENTS.items():
        model = torch.nn.Linear(4, 3).to(DTYPE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            model.with_bagua([opt], make(rank))
            out[name] = "wrapped"
        except ValueError as e:
            out[name] = str(e)
    return out


def replaced_learning_rate(rank: int, world_size: int) -> dict:
    """Rank 1's optimizer built with another lr: Bagua's behaviour (rank 0's state and numbers
    broadcast) is kept, and rank 1 is warned, naming the number and both values."""
    import warnings

    model = torch.nn.Linear(4, 3).to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 if rank else 0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    return dict(
        lr=opt.param_groups[0]["lr"], warnings=[str(w.message) for w in caught if "with_bagua" in str(w.message)]
    )


def bad_arguments(rank: int, world_size: int) -> dict:
    """Mistakes found before any collective: the same on every rank."""
    model, other = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    return errors_of(
        {
            "not an algorithm": lambda: model.with_bagua(
                [torch.optim.SGD(model.parameters(), lr=0.1)], "gradient_allreduce"
            ),
            "optimizer of another model": lambda: model.with_bagua(
                [torch.optim.SGD(other.parameters(), lr=0.1)], gradient_allreduce.GradientAllReduceAlgorithm()
            ),
            "not a process group": lambda: model.with_bagua(
                [torch.optim.SGD(model.parameters(), lr=0.1)], gradient_allreduce.GradientAllReduceAlgorithm(), 42
            ),
        }
    )


# ---- communication ---------------------------------------------------------------------------------


def coalesced_and_object_collectives(rank: int, world_size: int) -> dict:
    """Bagua's coalesced collectives against their one-tensor forms, and broadcast_object."""
    gen = torch.Generator().manual_seed(30 + rank)
    tensors = [torch.randn(3, generator=gen, dtype=DTYPE), torch.randn(2, 2, generator=gen, dtype=DTYPE)]
    out: dict = {}
    coalesced, single = [t.clone() for t in tensors], [t.clone() for t in tensors]
    bagua.communication.allreduce_coalesced_inplace(coalesced, bagua.ReduceOp.SUM)
    for t in single:
        bagua.allreduce_inplace(t, bagua.ReduceOp.SUM)
    out["allreduce"] = (coalesced, single)
    coalesced, single = [t.clone() for t in tensors], [t.clone() for t in tensors]
    bagua.communication.broadcast_coalesced(coalesced, src=1)
    for t in single:
        bagua.broadcast(t, src=1)
    out["broadcast"] = (coalesced, single)
    out["object"] = bagua.communication.broadcast_object({"from": rank, "t": tensors[0]}, src=1)
    out["mine"] = tensors[0]
    return out


def communication_api(rank: int, world_size: int) -> dict:
    """bagua.init_process_group from torchrun's variables, then every collective against torch's own."""
    bagua.init_process_group()
    out: dict = dict(
        initialized=bagua.communication.is_initialized(),
        rank=bagua.get_rank(),
        world_size=bagua.get_world_size(),
        local_rank=bagua.get_local_rank(),
        local_size=bagua.get_local_size(),
        backend=dist.get_backend(),
    )
    n = world_size
    x = torch.arange(4 * n, dtype=DTYPE) + 100 * rank

    def fresh() -> torch.Tensor:
        return x.clone()

    t = fresh()
    bagua.allreduce_inplace(t, op=bagua.ReduceOp.AVG)
    out["allreduce_avg"] = t
    recv = torch.empty_like(x)
    bagua.allreduce(x, recv, op=bagua.ReduceOp.MAX)
    out["allreduce_max"] = recv
    t = fresh()
    bagua.broadcast(t, src=n - 1)
    out["broadcast"] = t
    t = fresh()
    bagua.reduce_inplace(t, dst=0, op=bagua.ReduceOp.SUM)
    out["reduce"] = t
    gathered = torch.empty(n, x.numel(), dtype=DTYPE)
    bagua.allgather(x, gathered)
    out["allgather"] = gathered
    t = fresh()
    bagua.allgather_inplace(t)
    out["allgather_inplace"] = t
    piece = torch.empty(4, dtype=DTYPE)
    bagua.reduce_scatter(x, piece)
    out["reduce_scatter"] = piece
    a2a = torch.empty_like(x)
    bagua.alltoall(x, a2a)
    out["alltoall"] = a2a
    got = torch.empty(4, dtype=DTYPE)
    bagua.scatter(x, got, src=0)
    out["scatter"] = got
    gathered_at_0 = torch.zeros(n * x.numel(), dtype=DTYPE)
    bagua.gather(x, gathered_at_0, dst=0)
    out["gather"] = gathered_at_0
    t = fresh()
    bagua.gather_inplace(t, count=4, dst=0)
    out["gather_inplace"] = t
    t = fresh()
    bagua.scatter_inplace(t, count=4, src=0)
    out["scatter_inplace"] = t
    t = fresh()
    bagua.reduce_scatter_inplace(t)
    out["reduce_scatter_inplace"] = t
    t = fresh()
    bagua.alltoall_inplace(t)
    out["alltoall_inplace"] = t
    counts = [r + 1 for r in range(n)]  # rank r sends r + 1 elements to everyone, from offset 0
    mine = [rank + 1] * n
    received = torch.zeros(sum(counts), dtype=DTYPE)
    bagua.alltoall_v(x, mine, [0] * n, received, counts, [sum(counts[:r]) for r in range(n)])
    out["alltoall_v"] = received
    bits = torch.tensor([0b1100, 0b1010, 0b0110 + rank, 1 << rank], dtype=torch.int64)
    for op in ("BOR", "BAND", "BXOR"):  # gloo's own reduction, and the all-gather path NCCL takes
        t = bits.clone()
        bagua.allreduce_inplace(t, op=getattr(bagua.ReduceOp, op))
        folded = bits.clone()
        bagua.communication._all_reduce_by_gathering(
            folded, getattr(bagua.ReduceOp, op), bagua.communication._resolve(None)
        )
        out[f"bitwise_{op}"] = (t, folded)
    message = torch.full((3,), float(rank), dtype=DTYPE)
    if rank == 0:
        bagua.send(message, dst=1)
    elif rank == 1:
        bagua.recv(message, src=0)
    out["recv"] = message
    bagua.barrier()
    comm = bagua.communication
    count_before = comm._group_count
    group = comm.new_group(ranks=[0, n - 1])
    comm._check_default_pg()
    out["internals"] = dict(
        default_pg_is_default=comm._default_pg is comm._get_default_group(),
        named_one_more=comm._group_count == count_before + 1,
        group_ranks=comm._pg_group_ranks[group],
        by_name=comm._pg_map[group.group_name] is group,
        rank_mappings=comm._get_rank_mappings(),
        service_port=comm._find_free_bagua_service_port(comm._default_store),
    )
    import gc

    pg = dist.new_group(list(range(n)))  # Bagua's patch of torch's ProcessGroup
    pg.bagua_patch()
    try:
        pg.bagua_get_intra_node_communicator()
        borrowed_intra = None
    except RuntimeError as e:  # made on the torch group's members only: refused, not a hang
        borrowed_intra = str(e)
    made_everywhere = comm.new_group(list(range(n)))
    intra, inter = made_everywhere.get_intra_node_communicator(), made_everywhere.get_inter_node_communicator()
    t = fresh()
    bagua.allreduce_inplace(t, comm=intra)
    out["patched"] = dict(
        in_map=pg in comm._torch_to_bagua_pg_map,
        ranks=pg.bagua_pg.ranks,
        once=pg.bagua_patch().bagua_pg is pg.bagua_pg,
        global_nranks=pg.bagua_get_global_communicator().nranks(),
        borrowed_intra=borrowed_intra,
        intra_nranks=intra.nranks(),
        intra_sum=t,
        inter=inter.nranks() if inter is not bagua.communication.CommMember.NON_COMM_MEMBER else "outside",
        named=comm.get_communicator(made_everywhere.group_name, "intra") is intra,
    )
    borrowed = pg.bagua_pg
    dist.destroy_process_group(pg)
    del pg
    gc.collect()
    try:
        out["gone"] = repr(borrowed.torch_group)
    except RuntimeError as e:  # never None, which torch would read as the default group
        out["gone"] = str(e)
    t = fresh()
    bagua.allreduce_inplace(t, comm=group.get_global_communicator())
    out["subgroup_allreduce"] = t
    torch_group = dist.new_group([0])
    try:
        from_torch = bagua.communication.to_bagua_process_group(torch_group)
        out["from_torch_ranks"] = from_torch.ranks
        out["from_torch_nranks"] = from_torch.get_global_communicator().nranks()
    except ValueError as e:  # a process outside the torch group
        out["from_torch_ranks"] = str(e)
    try:
        bagua.init_process_group()
        out["second_init"] = None
    except RuntimeError as e:
        out["second_init"] = str(e)
    return out


# ---- weight-averaging algorithms, QAdam, async ----------------------------------------------------

SGD_LR = 0.1
DECENTRALIZED_CASES = {
    "all-1": ("all", 1),
    "all-2": ("all", 2),
    "shift_one-1": ("shift_one", 1),
    "shift_one-2": ("shift_one", 2),
}


def sgd_with(rank: int, world_size: int, algorithm: object, steps: int = STEPS) -> dict:
    """Plain SGD (no momentum) on the "shapes" model wrapped with ``algorithm``: its parameters after each step."""
    model = make_model("shapes", DTYPE, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    model.with_bagua([opt], algorithm)
    trace = []
    for x, y in local_batches(rank, world_size, steps=steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        trace.append({n: p.detach().clone() for n, p in model.named_parameters()})
    bucket = model.bagua_buckets[0]
    attributes = ("_peer_weight", "_weight", "_left_peer_weight", "_right_peer_weight")
    return dict(trace=trace, bucket={a: getattr(bucket, a).clone() for a in attributes if hasattr(bucket, a)})


def decentralized_runs(rank: int, world_size: int) -> dict:
    from functional_bagua.compat.algorithms import decentralized

    return {
        name: sgd_with(
            rank, world_size, decentralized.DecentralizedAlgorithm(peer_selection_mode=mode, communication_interval=k)
        )
        for name, (mode, k) in DECENTRALIZED_CASES.items()
    }


def low_precision_runs(rank: int, world_size: int) -> dict:
    from functional_bagua.compat.algorithms import decentralized

    return {
        f"interval-{k}": sgd_with(
            rank, world_size, decentralized.LowPrecisionDecentralizedAlgorithm(communication_interval=k)
        )
        for k in (1, 2)
    }


QADAM_WARMUP = 3


def qadam_runs(rank: int, world_size: int) -> dict:
    """QAdam through with_bagua, and torch DDP with torch's Adam (for-loop) on the same data."""
    from functional_bagua.compat.algorithms import q_adam

    model = make_model("shapes", DTYPE, seed=rank)
    opt = q_adam.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=QADAM_WARMUP, weight_decay=0.1)
    model.with_bagua([opt], q_adam.QAdamAlgorithm(opt))
    ref_model = make_model("shapes", DTYPE, seed=rank)
    ref = torch.nn.parallel.DistributedDataParallel(ref_model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ours_trace, ref_trace = [], []
    for x, y in local_batches(rank, world_size, steps=2 * QADAM_WARMUP):
        for net, o, trace, m in ((model, opt, ours_trace, model), (ref, ref_opt, ref_trace, ref_model)):
            o.zero_grad()
            loss_fn(net(x), y).backward()
            o.step()
            trace.append(state_of(m, o))
    return dict(ours=ours_trace, torch=ref_trace)


def async_average(rank: int, world_size: int) -> dict:
    """Train with async averaging (warmup 2 steps), abort and resume twice each, then let the
    thread average the idle replicas and abort: the replicas agree; no thread is left."""
    import threading
    import time

    from functional_bagua.compat.algorithms import async_model_average

    model = make_model("shapes", DTYPE, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    algorithm = async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=2, warmup_steps=2)
    model.with_bagua([opt], algorithm)
    statuses = [model.bagua_algorithm.status]
    data = local_batches(rank, world_size, steps=12, seed=rank + 5)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if step == 1:
            after_warmup = {n: p.detach().clone() for n, p in model.named_parameters()}
        if step == 6:
            statuses.append(model.bagua_algorithm.status)
            model.bagua_algorithm.abort(model)
            model.bagua_algorithm.abort(model)  # twice: a no-op
            statuses.append(model.bagua_algorithm.status)
            model.bagua_algorithm.resume(model)
            model.bagua_algorithm.resume(model)
            statuses.append(model.bagua_algorithm.status)
        time.sleep(0.005)
    rounds_while_training = model.bagua_algorithm.rounds()
    time.sleep(0.2)  # idle: the thread averages the replicas
    algorithm.abort(model)
    statuses.append(model.bagua_algorithm.status)
    threads = [t.name for t in threading.enumerate() if t.name == "bagua-async-average"]
    return dict(
        after_warmup=after_warmup,
        final={n: p.detach().clone() for n, p in model.named_parameters()},
        rounds=rounds_while_training,
        threads=threads,
        statuses=[status.name for status in statuses],
    )


def every_algorithm_in_turn(rank: int, world_size: int) -> dict:
    """Bagua's model-switch test: one model through all six algorithms, a few steps each."""
    from functional_bagua.compat.algorithms import async_model_average, decentralized, q_adam

    model = make_model("shapes", DTYPE, seed=rank)
    sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    qadam = q_adam.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    steps = {}
    for name, opt, algorithm in (
        ("bytegrad", sgd, bytegrad.ByteGradAlgorithm()),
        ("decentralized", sgd, decentralized.DecentralizedAlgorithm(peer_selection_mode="shift_one")),
        ("gradient_allreduce", sgd, gradient_allreduce.GradientAllReduceAlgorithm()),
        ("qadam", qadam, q_adam.QAdamAlgorithm(qadam)),
        ("async", qadam, async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=1)),
        ("low_precision_decentralized", qadam, decentralized.LowPrecisionDecentralizedAlgorithm()),
    ):
        model.with_bagua([opt], algorithm)
        for x, y in local_batches(rank, world_size, steps=4):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        if name == "async":
            model.bagua_algorithm.abort(model)
        steps[name] = model.bagua_train_step_counter
        losses = loss_fn(model(x), y).item()
    return dict(steps=steps, finite=bool(torch.isfinite(torch.tensor(losses))))


def other_dtypes_and_compiled_modules(rank: int, world_size: int) -> dict:
    """GradientAllReduce on a bfloat16 model, and on a model whose layer is torch.compile'd, each
    against torch's DDP on the same model."""
    out = {}
    for name in ("torch", "ours"):
        model = make_model("shapes", torch.bfloat16, seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if name == "torch":
            net = torch.nn.parallel.DistributedDataParallel(model)
        else:
            net = model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
        for x, y in local_batches(rank, world_size):
            opt.zero_grad()
            loss_fn(net(x.to(torch.bfloat16)), y.to(torch.bfloat16)).backward()
            opt.step()
        out[f"bf16/{name}"] = state_of(model, opt)
    for name in ("torch", "ours"):
        model = make_model("shapes", DTYPE, seed=rank)
        model.fc = torch.compile(model.fc, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if name == "torch":
            net = torch.nn.parallel.DistributedDataParallel(model)
        else:
            net = model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
        train(net, opt, local_batches(rank, world_size))
        out[f"compiled/{name}"] = state_of(model, opt)
    return out


def find_unused_parameters_build_params(rank: int, world_size: int) -> dict:
    """Bagua's DDP test: after one backward, bagua_build_params names only the parameters that got
    a gradient when find_unused_parameters is on, all of them otherwise."""
    out = {}
    for find_unused in (True, False):
        torch.manual_seed(0)
        model = PartlyUnused().to(DTYPE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt], find_unused_parameters=find_unused)
        x, y = local_batches(rank, world_size)[0]
        if not find_unused:
            import warnings

            warnings.simplefilter("ignore")  # the unused parameters' warning
        loss_fn(net(x), y).backward()
        out[find_unused] = sorted(name for name, _ in net.inner.bagua_build_params())
    return out


class Net1(torch.nn.Module):
    def __init__(self, widths: tuple) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def multi_models(rank: int, world_size: int) -> dict:
    """Two models wrapped with one GradientAllReduceAlgorithm object, trained in turns: each equals
    the same model under torch's DDP."""
    shapes = ((72, 10, 4), (72, 10, 30, 20, 4))
    out = {}
    for name in ("torch", "ours"):
        algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
        pairs = []
        for i, widths in enumerate(shapes):
            torch.manual_seed(10 * rank + i)
            model = Net1(widths).to(DTYPE)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            net = (
                torch.nn.parallel.DistributedDataParallel(model)
                if name == "torch"
                else model.with_bagua([opt], algorithm)
            )
            pairs.append((model, net, opt))
        for x, y in local_batches(rank, world_size):
            for _, net, opt in pairs:
                opt.zero_grad()
                loss_fn(net(x.flatten(1)), y).backward()
                opt.step()
        out[name] = [state_of(model, opt) for model, _, opt in pairs]
    return out


def dead_rank(rank: int, world_size: int) -> str:
    """Rank 1 dies after wrapping; rank 0's next backward fails within the process-group timeout."""
    import os

    model = make_model("shapes", DTYPE, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    if rank == 1:
        os._exit(1)
    for x, y in local_batches(rank, world_size):
        loss_fn(model(x), y).backward()
        opt.step()
    return "trained alone?"


def wrapper_attributes(rank: int, world_size: int) -> dict:
    """What scripts read off a wrapped model: DDP's state_dict keys, the step counter, with_bagua's
    no_sync (gradients stay local inside, as torch DDP's no_sync)."""
    model = make_model("norm", DTYPE, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt])
    theirs = torch.nn.parallel.DistributedDataParallel(make_model("norm", DTYPE, seed=0))
    out: dict = dict(
        ours_keys=list(ours.state_dict()), torch_keys=list(theirs.state_dict()), module=ours.module is model
    )
    wrapped = make_model("shapes", DTYPE, seed=0)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    wrapped.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    x, y = local_batches(rank, world_size)[0]
    with wrapped.no_sync():
        loss_fn(wrapped(x), y).backward()
    out["local_grad"] = wrapped.fc.weight.grad.clone()
    wrapped.eval()
    wrapped(x)  # an evaluation forward is not a training step
    wrapped.train()
    opt.zero_grad()
    loss_fn(wrapped(x), y).backward()
    out["synced_grad"] = wrapped.fc.weight.grad.clone()
    out["counter"] = wrapped.bagua_train_step_counter
    reference = make_model("shapes", DTYPE, seed=0)
    loss_fn(reference(x), y).backward()
    out["reference_local_grad"] = reference.fc.weight.grad.clone()
    return out


def cache_shared_between_ranks(rank: int, world_size: int) -> dict:
    """CachedDataset on the default store: rank 0 makes every sample, the others read them back."""
    from functional_bagua.compat.contrib import CachedDataset

    made: list = []

    class Counting(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> torch.Tensor:
            made.append(i)
            return torch.full((2,), float(i))

    dataset = CachedDataset(Counting(), backend="store", dataset_name="shared", writer_buffer_size=4)
    if rank == 0:
        first = [dataset[i] for i in range(6)]
        dataset.cache_loader.flush()
    dist.barrier()
    if rank != 0:
        first = [dataset[i] for i in range(6)]
    return dict(made=made, samples=first, keys=dataset.cache_loader.num_keys())
