"""Data-parallel training with functional_bagua.distributed: each rank computes gradients on its
slice of every global batch, and a transform chain averages them and updates the parameters.

    torchrun --nproc-per-node 2 examples/distributed_train.py                       # allreduce + clip + adamw
    torchrun --nproc-per-node 2 examples/distributed_train.py --compression minmax_uint8
    torchrun --nproc-per-node 2 examples/distributed_train.py --shard                # ZeRO: sharded AdamW state
    torchrun --nproc-per-node 2 examples/distributed_train.py --periodic-average 4   # local SGD

Runs on CPU with gloo (NCCL when CUDA is available). Every rank ends with the same parameters,
which the script checks at the end.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import functional_bagua as fb
import functional_bagua.distributed as fbd


def make_data(n: int):
    """y = sin(2 x . w) + noise, the same on every rank (same seed)."""
    gen = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 1, generator=gen) / 8**0.5
    x = torch.randn(n, 8, generator=gen)
    return x, torch.sin(2 * x @ w_true) + 0.05 * torch.randn(n, 1, generator=gen)


def make_tx(args) -> fb.GradientTransformation:
    adamw = fb.adamw(args.lr, weight_decay=1e-4)
    if args.shard:
        return fbd.shard(adamw)  # reduce-scatter gradients, AdamW on this rank's shard, all-gather
    if args.periodic_average:
        return fb.chain(adamw, fbd.periodic_average(args.periodic_average))  # no gradient traffic
    return fb.chain(
        fbd.allreduce_gradients(bucket_cap_mb=args.bucket_cap_mb, compression=args.compression),
        fb.clip_by_global_norm(1.0),
        adamw,
    )


def main(args) -> float:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    x, y = (t.to(device) for t in make_data(4096))

    params = fb.params_of(model)
    tx = make_tx(args)
    state = tx.init(params)  # checks that every rank holds the same parameters

    def loss_of(params, xb, yb):
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (xb,)), yb)

    grad_and_loss = torch.func.grad_and_value(loss_of)
    gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
    for step in range(args.steps):
        idx = torch.randint(0, x.shape[0], (args.global_batch,), generator=gen).chunk(world)[rank]
        grads, loss = grad_and_loss(params, x[idx], y[idx])
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss (rank 0's slice) {loss.item():.4f}")

    full_loss = loss_of(params, x, y).item()
    _check_same_params(params, world, periodic=bool(args.periodic_average))
    if rank == 0:
        print(f"full-data loss {full_loss:.4f} after {args.steps} steps on {world} ranks; parameters agree across ranks")
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()
    return full_loss


def _check_same_params(params, world: int, periodic: bool) -> None:
    """Every rank must end with the same parameters (with periodic averaging, only right after an average)."""
    if periodic:
        return
    for name, p in params.items():
        gathered = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(gathered, p.contiguous())
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            raise RuntimeError(f"parameter {name!r} differs across ranks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--compression", choices=["fp16", "bf16", "minmax_uint8"], default=None)
    parser.add_argument("--shard", action="store_true", help="ZeRO: shard the AdamW state across ranks")
    parser.add_argument("--periodic-average", type=int, default=0, metavar="PERIOD",
                        help="local SGD: no gradient all-reduce, average the parameters every PERIOD steps")
    main(parser.parse_args())
