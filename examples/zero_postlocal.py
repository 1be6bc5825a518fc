"""torch.distributed.optim's ZeRO and post-local SGD, on functional_bagua (only the imports change).

    torchrun --standalone --nproc-per-node 2 examples/zero_postlocal.py                  # DDP + ZeRO AdamW
    torchrun --standalone --nproc-per-node 2 examples/zero_postlocal.py --overlap        # ZeRO stepped in backward
    torchrun --standalone --nproc-per-node 2 examples/zero_postlocal.py --post-local-sgd # DDP + post-local SGD

``--zero`` (the default): torch's DDP averages the gradients and a ``ZeroRedundancyOptimizer`` keeps
AdamW's state for this rank's shard of the parameters only; the script prints rank 0's share of
the optimizer state, consolidates the state at the end and loads it into a plain AdamW. With
``--overlap`` the ZeRO step runs inside DDP's backward (``overlap_with_ddp=True`` and the
``hook_with_zero_step`` communication hook), on gloo too, and ``step()`` leaves the loop.
``--post-local-sgd``: DDP all-reduces gradients for the first ``--warmup`` steps, then
each rank steps alone and a ``PeriodicModelAverager`` averages the parameters every ``--period``
steps; the script prints how far apart the ranks are right after an average and at the end.
CPU (gloo) or CUDA (NCCL).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

from functional_bagua.compat.optim import (  # was: from torch.distributed.optim import ...
    PostLocalSGDOptimizer,
    ZeroRedundancyOptimizer,
    averagers,  # was: from torch.distributed.algorithms.model_averaging import averagers
    hook_with_zero_step,  # was: from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import ...
)


def make_data(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen) / 16**0.5  # x @ w of unit variance: a learnable sine
    return x.to(device), torch.sin(2 * x @ w).to(device)


def spread(model: torch.nn.Module) -> float:
    """The largest difference between any rank's parameters and rank 0's."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return max((w - everyone[0]).abs().max().item() for w in everyone)


def main(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "run this example with torchrun, which starts the ranks and sets RANK and WORLD_SIZE:\n"
            "    torchrun --standalone --nproc-per-node 2 examples/zero_postlocal.py"
        )
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU, before NCCL starts
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    ).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if args.post_local_sgd:
        alone, _ = dist.new_subgroups(group_size=1)  # after the warm-up: no gradient all-reduce
        ddp.register_comm_hook(
            PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=args.warmup), post_localSGD_hook
        )
        averager = averagers.PeriodicModelAverager(period=args.period, warmup_steps=args.warmup)
        optimizer: torch.optim.Optimizer = PostLocalSGDOptimizer(
            torch.optim.AdamW(model.parameters(), lr=args.lr), averager
        )
    else:
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, overlap_with_ddp=args.overlap, lr=args.lr
        )
        if args.overlap:  # backward reduces, steps this rank's shard and broadcasts it
            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, optimizer))

    x, y = make_data(args.batch_size * world * args.steps, device)
    after_average, losses = [], []
    for step in range(args.steps):
        start = (step * world + rank) * args.batch_size
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(x[start : start + args.batch_size]), y[start : start + args.batch_size])
        loss.backward()
        if not args.overlap:
            optimizer.step()
        losses.append(loss.item())
        if args.post_local_sgd and step >= args.warmup and (step - args.warmup) % args.period == 0:
            after_average.append(spread(model))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    if rank == 0:
        window = max(1, len(losses) // 4)
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        print(f"mean loss of the first {window} steps {first:.4f}, of the last {window} steps {last:.4f}")
    if args.post_local_sgd:
        at_end = spread(model)
        if rank == 0:
            print(
                f"post-local SGD: right after each of the {len(after_average)} averages the ranks agreed to within "
                f"{max(after_average):.3g}; at the end they differ by up to {at_end:.3g}"
            )
    else:
        local = sum(
            t.numel() for s in optimizer.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        )
        whole = 2 * sum(p.numel() for p in model.parameters())  # AdamW: two moments per parameter
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            state = optimizer.state_dict()
            plain = torch.optim.AdamW(model.parameters(), lr=args.lr)
            plain.load_state_dict(state)  # the consolidated state is the plain optimizer's format
            loaded = sum(
                t.numel() for s in plain.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
            )
            print(
                f"ZeRO: rank 0 kept {local} of the {whole} optimizer-state elements; the consolidated state "
                f"loads into a plain AdamW with {loaded} elements"
            )
        at_end = spread(model)
        if rank == 0:
            print(f"ZeRO: the ranks' parameters differ by at most {at_end:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--post-local-sgd", action="store_true", help="post-local SGD instead of ZeRO")
    parser.add_argument("--overlap", action="store_true", help="ZeRO's step inside DDP's backward")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log-every", type=int, default=40)
    arguments = parser.parse_args()
    if arguments.overlap and arguments.post_local_sgd:
        parser.error("--overlap is ZeRO's; leave it out with --post-local-sgd")
    main(arguments)
