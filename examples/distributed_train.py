"""Data-parallel training with functional_bagua.distributed: each rank computes gradients on its
slice of every global batch, and a transform chain averages them and updates the parameters.

    torchrun --nproc-per-node 2 examples/distributed_train.py                       # allreduce + clip + adamw
    torchrun --nproc-per-node 2 examples/distributed_train.py --compression minmax_uint8
    torchrun --nproc-per-node 2 examples/distributed_train.py --shard                # ZeRO: sharded AdamW state
    torchrun --nproc-per-node 2 examples/distributed_train.py --shard-by-tensor      # SOAP, each rank its tensors
    torchrun --nproc-per-node 2 examples/distributed_train.py --periodic-average 4   # local SGD

Runs on CPU with gloo (NCCL when CUDA is available). The modes are exclusive: ``--shard`` and
``--shard-by-tensor`` reduce gradients themselves (no compression), and ``--periodic-average``
sends no gradients at all. ``--shard-by-tensor`` trains with SOAP, each rank keeping the state of
the tensors it owns. With the all-reduce and with either shard every rank ends with the same
parameters, which the script checks
at the end; with ``--periodic-average`` the ranks agree right after each average, up to the
rounding of ``p + (average - p)`` on each rank (checked then), and drift apart in between (the
script prints both).
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
    if args.shard_by_tensor:  # SOAP needs whole tensors: each rank preconditions the tensors it owns
        return fbd.shard_by_tensor(fb.soap(lr=args.lr, weight_decay=1e-4, precondition_frequency=10))
    if args.periodic_average:
        return fb.chain(adamw, fbd.periodic_average(args.periodic_average))  # no gradient traffic
    return fb.chain(
        fbd.allreduce_gradients(bucket_cap_mb=args.bucket_cap_mb, compression=args.compression),
        fb.clip_by_global_norm(1.0),
        adamw,
    )


def main(args) -> float:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "run this example with torchrun, which starts the ranks and sets RANK and WORLD_SIZE:\n"
            "    torchrun --standalone --nproc-per-node 2 examples/distributed_train.py"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU, before NCCL starts
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
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
    after_averages = []  # the largest difference between ranks right after each average
    for step in range(args.steps):
        idx = torch.randint(0, x.shape[0], (args.global_batch,), generator=gen).chunk(world)[rank]
        grads, loss = grad_and_loss(params, x[idx], y[idx])
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
        if args.periodic_average and step % args.periodic_average == 0:  # periodic_average averaged just now
            after_averages.append(_largest_difference(params, world))
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss (rank 0's slice) {loss.item():.4f}")

    full_loss = loss_of(params, x, y).item()
    if args.periodic_average:
        # right after an average each rank holds p + (mean - p), which rounds differently per rank
        if max(after_averages) > AVERAGE_ROUNDING:
            raise RuntimeError(f"ranks differ by {max(after_averages):.3g} right after an average")
        agreement = (
            f"right after each of the {len(after_averages)} averages the ranks agreed to within "
            f"{max(after_averages):.2g} (rounding); at the end they differ by up to "
            f"{_largest_difference(params, world):.3g}"
        )
    else:
        _check_same_params(params, world, "at the end")
        agreement = "parameters agree across ranks"
    if rank == 0:
        print(f"full-data loss {full_loss:.4f} after {args.steps} steps on {world} ranks; {agreement}")
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()
    return full_loss


AVERAGE_ROUNDING = 1e-6  # float32: a few units in the last place of these parameters


def _gathered(p: torch.Tensor, world: int) -> list:
    copies = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(copies, p.contiguous())
    return copies


def _check_same_params(params, world: int, when: str) -> None:
    """Raise unless every rank holds the same parameters, bit for bit."""
    for name, p in params.items():
        copies = _gathered(p, world)
        if not all(torch.equal(c, copies[0]) for c in copies):
            raise RuntimeError(f"parameter {name!r} differs across ranks {when}")


def _largest_difference(params, world: int) -> float:
    """The largest difference between any rank's parameters and rank 0's."""
    return max(
        (c - copies[0]).abs().max().item() for p in params.values() for copies in [_gathered(p, world)] for c in copies
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="default: DDP's sizes, 1 MiB then 25")
    parser.add_argument("--compression", choices=["fp16", "bf16", "minmax_uint8"], default=None)
    parser.add_argument("--shard", action="store_true", help="ZeRO: shard the AdamW state across ranks")
    parser.add_argument(
        "--shard-by-tensor", action="store_true", help="SOAP, each rank keeping the state of the tensors it owns"
    )
    parser.add_argument(
        "--periodic-average",
        type=int,
        default=0,
        metavar="PERIOD",
        help="local SGD: no gradient all-reduce, average the parameters every PERIOD steps",
    )
    args = parser.parse_args()
    if args.shard and args.shard_by_tensor:
        parser.error("--shard and --shard-by-tensor are two ways to shard the state; pick one")
    for flag, given in (("--shard", args.shard), ("--shard-by-tensor", args.shard_by_tensor)):
        if given and args.compression:
            parser.error(f"{flag} reduce-scatters the gradients itself and has no compression; drop --compression")
    if args.periodic_average and (args.shard or args.shard_by_tensor or args.compression):
        parser.error(
            "--periodic-average sends no gradients (it averages the parameters every PERIOD steps); "
            "it combines with neither --shard, --shard-by-tensor nor --compression"
        )
    main(args)
