"""Owner-computes: the per-rank time of the preconditioners' decompositions falls with the number
of ranks that share them.

    python benchmarks/second_order_sharded.py [--matrices 32] [--size 128] [--ranks 1,2]

Each run spawns the ranks (gloo on 127.0.0.1, one thread each) and times, on every rank,
``batched_matrices.owner_computes`` of Shampoo's inverse root (``eigh`` in float64) over a batch
of ``--matrices`` symmetric ``--size x --size`` matrices that all ranks hold: the rank's own
decompositions, and the whole call with the all-gather that shares them. Medians of 5 calls.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from common import table  # noqa: E402

from functional_bagua.transforms.batched_matrices import owner_computes  # noqa: E402
from functional_bagua.transforms.shampoo import inverse_root  # noqa: E402


def _rank(rank: int, world: int, port: int, matrices: int, size: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(matrices, size, size, generator=gen, dtype=torch.float64)
    batch = a @ a.mT
    own: list = []

    def timed_root(m: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = inverse_root(m, 1e-12, 4, torch.float64)
        own.append(time.perf_counter() - start)
        return out

    whole = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        owner_computes(timed_root, batch, dist.group.WORLD)
        whole.append(time.perf_counter() - start)
    torch.save(dict(own=statistics.median(own), whole=statistics.median(whole)), os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrices", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--ranks", default="1,2")
    args = parser.parse_args()
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as out_dir:
            context = mp.start_processes(
                _rank,
                args=(world, free_port(), args.matrices, args.size, out_dir),
                nprocs=world,
                join=False,
                start_method="spawn",
            )
            while not context.join(timeout=300):
                pass
            results = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]
        rows.append(
            dict(
                ranks=world,
                own_decompositions_ms=1e3 * max(r["own"] for r in results),
                with_all_gather_ms=1e3 * max(r["whole"] for r in results),
            )
        )
    base = rows[0]["own_decompositions_ms"]
    for r in rows:
        r["own x 1 rank"] = r["own_decompositions_ms"] / base
    print(
        f"{args.matrices} matrices of {args.size} x {args.size}, float64 eigh, one thread per rank; slowest rank's medians"
    )
    print(table(rows, ["ranks", "own_decompositions_ms", "with_all_gather_ms", "own x 1 rank"]))


if __name__ == "__main__":
    main()
