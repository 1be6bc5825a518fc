"""A Bagua training script, unchanged but for its import: ``import bagua.torch_api as bagua``
became ``import functional_bagua.compat as bagua``. Runs on the CPU (gloo) and on CUDA (NCCL).

    torchrun --standalone --nproc-per-node 2 examples/bagua_legacy.py                          # gradient_allreduce
    torchrun --standalone --nproc-per-node 2 examples/bagua_legacy.py --algorithm decentralized
    torchrun --standalone --nproc-per-node 2 examples/bagua_legacy.py --algorithm qadam --ddp

``--algorithm`` is one of Bagua's six (gradient_allreduce, bytegrad, decentralized,
low_precision_decentralized, qadam, async), or ``own``: an algorithm written to Bagua's own
interface, as a Bagua user writes one (its buckets average the gradients; :class:`OwnAllReduce`);
``--ddp`` wraps the model with Bagua's
``DistributedDataParallel`` instead of ``model.with_bagua``. Every rank seeds its model
differently, as Bagua's examples do: wrapping broadcasts rank 0's weights. At the end the script
gathers every rank's weights and prints how far apart they are: equal for the algorithms that
average gradients; for those that average weights, as far apart as the steps since their last
averaging let them drift. ``async`` averages in a thread every ``sync_interval_ms`` while the
ranks train, so how many rounds it runs depends on the time each step takes: the script prints
that count.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_bagua.compat as bagua  # was: import bagua.torch_api as bagua
from functional_bagua.compat import BaguaDistributedDataParallel, BaguaProcessGroup
from functional_bagua.compat.algorithms import (
    Algorithm,
    AlgorithmImpl,
    async_model_average,
    bytegrad,
    decentralized,
    gradient_allreduce,
    q_adam,
)
from functional_bagua.compat.bucket import BaguaBucket

ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam", "async", "own")
GRADIENT_AVERAGING = ("gradient_allreduce", "bytegrad", "qadam", "own")  # replicas stay equal


class OwnAllReduceImpl(AlgorithmImpl):
    """Bagua's interface with its defaults (each parameter's gradient is a communicated tensor,
    marked ready as backward produces it; the backend waited for at the end of backward), plus
    one operation per bucket: the mean over the ranks."""

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(average=True, group=self.process_group)


class OwnAllReduce(Algorithm):
    def reify(self, process_group: BaguaProcessGroup) -> OwnAllReduceImpl:
        return OwnAllReduceImpl(process_group)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.fc3 = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make_data(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Four classes of points, labelled by a fixed random teacher (the same on every rank)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=gen)
    teacher = torch.randn(20, 4, generator=gen)
    return x.to(device), (x @ teacher).argmax(dim=1).to(device)


def make_algorithm(name: str, optimizer: torch.optim.Optimizer) -> bagua.algorithms.Algorithm:
    if name == "gradient_allreduce":
        return gradient_allreduce.GradientAllReduceAlgorithm()
    if name == "bytegrad":
        return bytegrad.ByteGradAlgorithm()
    if name == "decentralized":
        return decentralized.DecentralizedAlgorithm(peer_selection_mode="shift_one")
    if name == "low_precision_decentralized":
        return decentralized.LowPrecisionDecentralizedAlgorithm()
    if name == "qadam":
        assert isinstance(optimizer, q_adam.QAdamOptimizer)
        return q_adam.QAdamAlgorithm(optimizer)
    if name == "own":
        return OwnAllReduce()
    return async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=20, warmup_steps=20)


def spread_across_ranks(model: torch.nn.Module) -> float:
    """The largest difference between any rank's weights and rank 0's."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return max((w - everyone[0]).abs().max().item() for w in everyone)


def main(args: argparse.Namespace) -> float:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "run this example with torchrun, which starts the ranks and sets RANK and WORLD_SIZE:\n"
            "    torchrun --standalone --nproc-per-node 2 examples/bagua_legacy.py"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(bagua.get_local_rank())
    bagua.init_process_group()
    device = torch.device("cuda", bagua.get_local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    rank, world = bagua.get_rank(), bagua.get_world_size()
    torch.manual_seed(rank)  # different on every rank: with_bagua broadcasts rank 0's weights

    model = Net().to(device)
    if args.algorithm == "qadam":
        optimizer: torch.optim.Optimizer = q_adam.QAdamOptimizer(model.parameters(), lr=3e-3, warmup_steps=50)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    algorithm = make_algorithm(args.algorithm, optimizer)
    if args.ddp:
        net: torch.nn.Module = bagua.data_parallel.DistributedDataParallel(
            model, optimizers=[optimizer], algorithm=algorithm
        )
    else:
        net = model.with_bagua([optimizer], algorithm)  # type: ignore[operator]  # added to nn.Module at import

    x, y = make_data(args.batch_size * world * args.steps, device)
    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        start = (step * world + rank) * args.batch_size  # this rank's part of the step's global batch
        xb, yb = x[start : start + args.batch_size], y[start : start + args.batch_size]
        optimizer.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  ({args.algorithm}, {world} ranks)", flush=True)
    rounds = ""
    if args.algorithm == "async":
        rounds = f" after {algorithm.rounds(model)} averaging rounds in the thread"  # type: ignore[attr-defined]
        algorithm.abort(model)  # type: ignore[attr-defined]
    spread = spread_across_ranks(model)
    if rank == 0:
        kind = "average gradients" if args.algorithm in GRADIENT_AVERAGING else "average weights"
        print(f"{args.algorithm} ({kind}){rounds}: weights differ across ranks by at most {spread:.3g}")
    return loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="gradient_allreduce")
    parser.add_argument("--ddp", action="store_true", help="Bagua's DistributedDataParallel instead of with_bagua")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=50)
    main(parser.parse_args())
