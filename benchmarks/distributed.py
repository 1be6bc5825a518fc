"""Data-parallel step on 2 gloo ranks (spawned on this machine, loopback): torch DDP vs
functional_bagua.distributed and the Bagua compat layer (every algorithm), plus the bytes each
variant hands to the collectives and the optimizer-state memory per rank with and without ZeRO
sharding.

    python benchmarks/distributed.py                      # 2 ranks, CPU, gloo
    python benchmarks/distributed.py --ranks 4 --hidden 1024

Every variant trains the same MLP (same weights, same batches) for the same steps; the step is
forward + backward + gradient averaging + AdamW. Times are rank 0's median; `bytes/step` is
the payload given to the collectives per rank and step, counted by wrapping torch's functional
collectives (the wire traffic of a ring all-reduce is ~2(n-1)/n of it); for the Bagua rows it is
what the running algorithm reports (``bytes_per_step``: the tensors it hands to the collectives
per training step, the codes where it compresses; the asynchronous one communicates outside the
step, not counted).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, record, table  # noqa: E402

import functional_bagua as fb  # noqa: E402
import functional_bagua.compat as bagua  # noqa: E402
import functional_bagua.distributed as fbd  # noqa: E402
from functional_bagua.compat.algorithms import (  # noqa: E402
    async_model_average,
    bytegrad,
    decentralized,
    gradient_allreduce,
    q_adam,
)

COUNTED = ("all_reduce", "all_to_all_single", "all_gather_single", "reduce_scatter_single")
LR = 1e-3


def count_collective_bytes(counter: list) -> None:
    """Wrap torch's functional collectives so that each call adds its input's bytes to ``counter[0]``."""
    for name in COUNTED:
        original = getattr(funcol, name)

        def counting(tensor, *args, _original=original, **kwargs):
            if not torch.compiler.is_compiling():  # eager calls only: the compiled step is not counted
                counter[0] += tensor.numel() * tensor.element_size()
            return _original(tensor, *args, **kwargs)

        setattr(funcol, name, counting)


def make_model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    dims = [256] + [hidden] * layers + [10]
    mods = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        mods += [torch.nn.Linear(a, b)] + ([torch.nn.GELU()] if i < len(dims) - 2 else [])
    return torch.nn.Sequential(*mods)


def batches(steps: int, global_batch: int, rank: int, world: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(global_batch, 256, generator=gen)
        y = torch.randint(0, 10, (global_batch,), generator=gen)
        out.append((x.chunk(world)[rank], y.chunk(world)[rank]))
    return out


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor))


def torch_adamw(ddp: bool):
    """torch.optim AdamW(fused) on the model, wrapped in torch's DDP or (the step without any
    communication) not."""

    def build(args, data):
        model = make_model(args.hidden, args.layers)
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

        def step(batch):
            x, y = batch
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        return step, lambda: state_bytes(list(opt.state.values()))

    return build


def fb_chain(tx_of):
    def build(args, data):
        model = make_model(args.hidden, args.layers)
        params = fb.params_of(model)
        tx = tx_of(args)
        holder = {"params": params, "state": tx.init(params)}
        grad_of = torch.func.grad(lambda ps, x, y: loss_fn(torch.func.functional_call(model, ps, (x,)), y))

        def step(batch):
            grads = grad_of(holder["params"], *batch)
            updates, holder["state"] = tx.update(grads, holder["state"], holder["params"])
            holder["params"] = fb.apply_updates(holder["params"], updates)

        return step, lambda: state_bytes(holder["state"])

    return build


def fb_train_step(overlap: bool, compile: bool = False, communicate: bool = True, donate: bool = False):
    """make_train_step on the parameter tree with chain(allreduce_gradients, adamw): the all-reduce
    during backward (``overlap``: gradient hooks eager, inductor's reordering compiled) or after it;
    without ``communicate``, adamw alone (the step's own cost); ``donate``: torch's kernel in place
    on the step's own parameters and state (eager)."""

    def build(args, data):
        model = make_model(args.hidden, args.layers)
        params = fb.params_of(model)
        tx = fb.chain(fbd.allreduce_gradients(args.bucket_cap_mb), fb.adamw(LR)) if communicate else fb.adamw(LR)
        train_step = fb.make_train_step(model, loss_fn, tx, compile=compile, overlap=overlap, donate=donate)
        holder = {"params": params, "state": tx.init(params)}

        def step(batch):
            holder["params"], holder["state"], _ = train_step(holder["params"], holder["state"], batch)

        return step, lambda: state_bytes(holder["state"])

    return build


def fb_compiled_flat(args, data):
    """forward + backward + allreduce + AdamW as one compiled step on the flat buffer."""
    model = make_model(args.hidden, args.layers)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params)
    tx = fb.chain(fbd.allreduce_gradients(args.bucket_cap_mb), fb.adamw(LR))
    flat = layout.flatten(params)
    holder = {"params": flat, "state": fb.fuse(tx, layout).init(flat)}
    train_step = fb.make_train_step(model, loss_fn, tx, compile=True, layout=layout)

    def step(batch):
        holder["params"], holder["state"], _ = train_step(holder["params"], holder["state"], batch)

    return step, lambda: state_bytes(holder["state"])


def bagua_step(make_algorithm, wrap: str = "with_bagua", qadam: bool = False):
    """A Bagua-style script's step: ``model.with_bagua([optimizer], algorithm)`` (or Bagua's
    ``DistributedDataParallel``), then forward, backward and ``optimizer.step()``."""

    def build(args, data):
        model = make_model(args.hidden, args.layers)
        if qadam:
            opt = q_adam.QAdamOptimizer(model.parameters(), lr=LR, warmup_steps=args.warmup)
            algorithm = q_adam.QAdamAlgorithm(opt)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
            algorithm = make_algorithm()
        if wrap == "with_bagua":
            net = model.with_bagua([opt], algorithm)
            engine = vars(model)["_bagua_engine"]
        else:
            net = bagua.data_parallel.DistributedDataParallel(
                model, optimizers=[opt], algorithm=algorithm, bucket_cap_mb=args.bucket_cap_mb
            )
            engine = net.inner

        def step(batch):
            x, y = batch
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()

        def finish():
            if isinstance(algorithm, async_model_average.AsyncModelAverageAlgorithm):
                algorithm.abort(model)
            return state_bytes(list(opt.state.values()))

        step.bytes_per_step = engine.bytes_per_step  # type: ignore[attr-defined]
        return step, finish

    return build


def zero_step(which: str):
    """DDP + ZeroRedundancyOptimizer(AdamW fused), torch's or functional_bagua.compat's."""

    def build(args, data):
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        from functional_bagua.compat.optim import ZeroRedundancyOptimizer as OurZero

        model = torch.nn.parallel.DistributedDataParallel(
            make_model(args.hidden, args.layers), bucket_cap_mb=args.bucket_cap_mb
        )
        zero = TorchZero if which == "torch" else OurZero
        opt = zero(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True)

        def step(batch):
            x, y = batch
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        return step, lambda: state_bytes(list(opt.optim.state.values()))

    return build


def zero_overlap_step():
    """DDP + functional_bagua.compat's ZeroRedundancyOptimizer(AdamW fused, overlap_with_ddp=True)
    stepped inside backward by hook_with_zero_step (torch's refuses gloo)."""

    def build(args, data):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from functional_bagua.compat.optim import ZeroRedundancyOptimizer, hook_with_zero_step

        model = torch.nn.parallel.DistributedDataParallel(
            make_model(args.hidden, args.layers), bucket_cap_mb=args.bucket_cap_mb
        )
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, overlap_with_ddp=True, lr=LR, fused=True
        )
        model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, opt))

        def step(batch):
            x, y = batch
            opt.zero_grad()
            loss_fn(model(x), y).backward()

        return step, lambda: state_bytes(list(opt.optim.state.values()))

    return build


def post_local_sgd_step(which: str):
    """DDP with post_localSGD_hook (local after the warm-up steps) + PostLocalSGDOptimizer(AdamW
    fused, PeriodicModelAverager(4)), torch's or functional_bagua.compat's."""

    def build(args, data):
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
        from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocal

        from functional_bagua.compat import optim as ours

        model = torch.nn.parallel.DistributedDataParallel(
            make_model(args.hidden, args.layers), bucket_cap_mb=args.bucket_cap_mb
        )
        alone, _ = dist.new_subgroups(group_size=1)
        model.register_comm_hook(
            PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=args.warmup), post_localSGD_hook
        )
        local = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        if which == "torch":
            opt = TorchPostLocal(local, torch_averagers.PeriodicModelAverager(period=4, warmup_steps=args.warmup))
        else:
            opt = ours.PostLocalSGDOptimizer(
                local, ours.averagers.PeriodicModelAverager(period=4, warmup_steps=args.warmup)
            )

        def step(batch):
            x, y = batch
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        return step, lambda: state_bytes(list(local.state.values()))

    return build


VARIANTS = {
    "torch DDP + AdamW(fused)": torch_adamw(ddp=True),
    "fb adamw, no communication (reference)": fb_chain(lambda a: fb.adamw(LR)),
    "fb allreduce + adamw": fb_chain(lambda a: fb.chain(fbd.allreduce_gradients(a.bucket_cap_mb), fb.adamw(LR))),
    "fb allreduce fp16 + adamw": fb_chain(
        lambda a: fb.chain(fbd.allreduce_gradients(a.bucket_cap_mb, compression="fp16"), fb.adamw(LR))
    ),
    "fb allreduce bf16 + adamw": fb_chain(
        lambda a: fb.chain(fbd.allreduce_gradients(a.bucket_cap_mb, compression="bf16"), fb.adamw(LR))
    ),
    "fb allreduce minmax_uint8 + adamw": fb_chain(
        lambda a: fb.chain(fbd.allreduce_gradients(a.bucket_cap_mb, compression="minmax_uint8"), fb.adamw(LR))
    ),
    "fb shard(adamw)": fb_chain(lambda a: fbd.shard(fb.adamw(LR))),
    "fb adamw + periodic_average(4)": fb_chain(lambda a: fb.chain(fb.adamw(LR), fbd.periodic_average(4))),
    "fb compiled flat step (allreduce + adamw)": fb_compiled_flat,
    "fb compiled tree step, allreduce after backward + adamw": fb_train_step(overlap=False, compile=True),
    "fb compiled tree step, allreduce during backward + adamw": fb_train_step(overlap=True, compile=True),
    "fb train step eager, allreduce after backward + adamw": fb_train_step(overlap=False),
    "fb train step eager, allreduce during backward + adamw": fb_train_step(overlap=True),
    "fb train step eager donated, allreduce during backward + adamw": fb_train_step(overlap=True, donate=True),
    "torch eager AdamW(fused), no communication (reference)": torch_adamw(ddp=False),
    "fb train step eager, adamw, no communication (reference)": fb_train_step(overlap=False, communicate=False),
    "fb train step eager donated, adamw, no communication (reference)": fb_train_step(
        overlap=False, communicate=False, donate=True
    ),
    "bagua with_bagua GradientAllReduce + AdamW(fused)": bagua_step(gradient_allreduce.GradientAllReduceAlgorithm),
    "bagua DistributedDataParallel GradientAllReduce + AdamW(fused)": bagua_step(
        gradient_allreduce.GradientAllReduceAlgorithm, wrap="ddp"
    ),
    "bagua ByteGrad + AdamW(fused)": bagua_step(bytegrad.ByteGradAlgorithm),
    "bagua Decentralized(all) + AdamW(fused)": bagua_step(decentralized.DecentralizedAlgorithm),
    "bagua Decentralized(shift_one) + AdamW(fused)": bagua_step(
        lambda: decentralized.DecentralizedAlgorithm(peer_selection_mode="shift_one")
    ),
    "bagua LowPrecisionDecentralized + AdamW(fused)": bagua_step(decentralized.LowPrecisionDecentralizedAlgorithm),
    "bagua QAdam (8-bit momentum after the warm-up steps)": bagua_step(None, qadam=True),
    "bagua AsyncModelAverage(50 ms) + AdamW(fused)": bagua_step(
        lambda: async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=50)
    ),
    "torch ZeroRedundancyOptimizer(AdamW fused) + DDP": zero_step("torch"),
    "compat ZeroRedundancyOptimizer(AdamW fused) + DDP": zero_step("ours"),
    "compat ZeroRedundancyOptimizer(AdamW fused, overlap_with_ddp) + DDP hook": zero_overlap_step(),
    "torch PostLocalSGDOptimizer(AdamW fused, period 4) + DDP": post_local_sgd_step("torch"),
    "compat PostLocalSGDOptimizer(AdamW fused, period 4) + DDP": post_local_sgd_step("ours"),
}


def worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    counter = [0]
    count_collective_bytes(counter)
    data = batches(args.steps + args.warmup, args.global_batch, rank, world)
    rows = []
    for name, build in VARIANTS.items():
        if args.only and name != "torch DDP + AdamW(fused)" and not any(p in name for p in args.only.split(",")):
            continue
        step, measure_state = build(args, data)
        times = []
        for i, batch in enumerate(data):
            if i == args.warmup:
                counter[0] = 0
            dist.barrier()
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
        timed = times[args.warmup :]
        counted = step.bytes_per_step() if hasattr(step, "bytes_per_step") else counter[0] / len(timed)
        rows.append(
            dict(
                variant=name,
                ms=statistics.median(timed) * 1e3,
                collective_mib_per_step=counted / 2**20 if counted else None,
                state_mib=measure_state() / 2**20,
            )
        )
    if rank == 0:
        torch.save(rows, out_path)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="every variant's bucket size (default: DDP's, 1 MiB then 25)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--only", default="", help="comma-separated parts of the variant names to run (torch DDP always)"
    )
    parser.add_argument("--record", action="store_true", help="keep the table in benchmarks/results/ for the docs")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(
            worker, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True, start_method="spawn"
        )
        rows = torch.load(out)
    n_params = sum(p.numel() for p in make_model(args.hidden, args.layers).parameters())
    base = rows[0]["ms"]
    for r in rows:
        r["vs_ddp"] = f"{r['ms'] / base:.2f}x"
        if r["collective_mib_per_step"] is None:
            r["collective_mib_per_step"] = "n/a"
    title = (
        f"{args.ranks} gloo ranks ({args.threads} torch thread each); MLP {n_params / 1e6:.2f}M params "
        f"({n_params * 4 / 2**20:.1f} MiB float32), global batch {args.global_batch}"
    )
    print(f"# {title}, {machine()}\n")
    columns = ["variant", "ms", "vs_ddp", "collective_mib_per_step", "state_mib"]
    print(table(rows, columns))
    if args.record:
        chart = dict(value="ms", label=["variant"], log=False)
        record("distributed", "cpu", [dict(title=title, columns=columns, rows=rows, chart=chart)])


if __name__ == "__main__":
    main()
