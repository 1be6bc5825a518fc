"""Owner-computes: the per-rank time of the preconditioners' decompositions falls with the number
of ranks that share them.

    python benchmarks/second_order_sharded.py [--matrices 32] [--size 128] [--ranks 1,2]
    python benchmarks/second_order_sharded.py --computation psgd_kron_fit
    python benchmarks/second_order_sharded.py --computation shampoo_roots_of_many_shapes --matrices 12
    python benchmarks/second_order_sharded.py --computation soap_by_tensor --ranks 1,2
    python benchmarks/second_order_sharded.py --computation soap_refresh --ranks 1,2,4

Each run spawns the ranks (gloo on 127.0.0.1, one thread each) and times, on every rank,
``batched_matrices.owner_computes`` over ``--matrices`` matrices of ``--size x --size`` that all
ranks hold: the rank's own computations, and the whole call with the all-gather that shares
them. Medians of 5 calls. ``shampoo_root``: Shampoo's inverse root (``eigh`` in float64) of
symmetric matrices; ``psgd_kron_fit``: PSGD-Kron's fit of both triangular factors of each
matrix (float32), inside ``scale_by_psgd_kron(group=...)``'s update;
``shampoo_roots_of_many_shapes``: the inverse roots of ``--matrices`` matrices of as many sizes
(``--size`` down in steps of 4: one batch each, as a model of many shapes gives), all in one
update's :class:`~functional_bagua.transforms.batched_matrices.Owners` (each row to the rank
least loaded so far) with every batch's results in one all-gather
(``owner_computes_all``), the same owners with an all-gather per batch, and, for comparison,
each batch balanced alone (every single-row batch on rank 0). ``soap_by_tensor``: a step of SOAP on a 4-layer GPT-2 of hidden 256 (vocabulary 8192)
under ``shard_by_tensor`` against ``allreduce_gradients`` followed by SOAP, where every rank
preconditions every tensor (``--matrices`` and ``--size`` unused): the step time and the bytes of
each rank's optimizer state. ``soap_refresh``: SOAP refreshing its eigenbases every step on a
4-layer GPT-2 of hidden 256 (vocabulary 2048), with ``group=`` (each rank the QRs it owns, every
batch's results in one all-gather) and without (every rank all): the median and slowest of 5
steps, and the all-gathers per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import on_gloo_ranks, record, table  # noqa: E402

from functional_bagua.transforms.batched_matrices import Owners, owner_computes, owner_computes_all  # noqa: E402
from functional_bagua.transforms.shampoo import inverse_root  # noqa: E402


def _psgd_kron_fit(matrices: int, size: int) -> dict:
    """PSGD-Kron's update with ``group=``, its fits timed through the owner-computes call."""
    from functional_bagua.transforms import psgd_kron

    own: list = []
    whole: list = []

    def timed(fn, batch, group, name, agreed):  # noqa: ANN001, ANN202
        def timed_fn(*rows: torch.Tensor) -> tuple:
            start = time.perf_counter()
            out = fn(*rows)
            own.append(time.perf_counter() - start)
            return out

        start = time.perf_counter()
        out = owner_computes(timed_fn, batch, group, name, agreed)
        whole.append(time.perf_counter() - start)
        return out

    psgd_kron.owner_computes = timed  # the module's name for it: its update calls this one
    gen = torch.Generator().manual_seed(0)
    params = {f"m{i}": torch.randn(size, size, generator=gen) for i in range(matrices)}
    grads = {k: torch.randn(size, size, generator=gen) for k in params}
    tx = psgd_kron.scale_by_psgd_kron(group=dist.group.WORLD)
    state = tx.init(params)
    for step in range(6):  # the first one warms up; every step fits (the first 500 do)
        torch.manual_seed(step)
        dist.barrier()
        _, state = tx.update(grads, state, params)
    return dict(own=statistics.median(own[1:]), whole=statistics.median(whole[1:]))


def _shampoo_root(matrices: int, size: int) -> dict:
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
    return dict(own=statistics.median(own), whole=statistics.median(whole))


def _shampoo_roots_of_many_shapes(matrices: int, size: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for i in range(matrices):
        a = torch.randn(1, size - 4 * i, size - 4 * i, generator=gen, dtype=torch.float64)
        batches.append(a @ a.mT)
    timings = {}
    for how in ("one all-gather", "update", "per batch"):
        own: list = []
        whole, per_update = [], []

        def timed_root(m: torch.Tensor, own: list = own) -> torch.Tensor:
            start = time.perf_counter()
            out = inverse_root(m, 1e-12, 4, torch.float64)
            if m.device.type != "meta":  # a rank that owns no row learns the shapes on meta: no time
                own.append(time.perf_counter() - start)
            return out

        for repeat in range(6):  # the first a warm-up
            owners = Owners(dist.group.WORLD, "benchmark", "roots")
            owners.begin_update()
            own.clear()
            dist.barrier()
            start = time.perf_counter()
            if how == "one all-gather":  # every batch's results shared at once
                owner_computes_all(timed_root, batches, owners)
            for batch in batches if how != "one all-gather" else []:  # "per batch": each balanced alone
                owner_computes(timed_root, batch, owners if how == "update" else dist.group.WORLD)
            if repeat:
                whole.append(time.perf_counter() - start)
                per_update.append(sum(own))  # this update's own computations
        timings[how] = dict(own=statistics.median(per_update), whole=statistics.median(whole))
    return timings


def _gpt2_params_and_grads(vocab: int) -> tuple[dict, dict]:
    """Parameters and gradients of a 4-layer GPT-2 of hidden 256 and ``vocab`` tokens, seeded."""
    from optimizer_step import gpt2_small_shapes

    gen = torch.Generator().manual_seed(0)
    shapes = gpt2_small_shapes(hidden=256, layers=4, vocab=vocab, positions=256)
    params = {f"p{i:03d}": torch.randn(s, generator=gen) * 0.02 for i, s in enumerate(shapes)}
    return params, {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in params.items()}


def _soap_by_tensor(matrices: int, size: int) -> dict:
    import functional_bagua as fb
    import functional_bagua.distributed as fbd

    del matrices, size
    params, grads = _gpt2_params_and_grads(vocab=8192)
    timings = {}
    for how, tx in (
        ("by tensor", fbd.shard_by_tensor(fb.soap(precondition_frequency=10))),
        ("allreduce, then soap", fb.chain(fbd.allreduce_gradients(), fb.soap(precondition_frequency=10))),
    ):
        state = tx.init(params)
        steps = []
        for _ in range(12):  # the first initializes the bases; then 10 steps and a refresh
            dist.barrier()
            start = time.perf_counter()
            _, state = tx.update(grads, state, params)
            steps.append(time.perf_counter() - start)
        held = [t for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor)]
        timings[how] = dict(
            own=statistics.median(steps[1:]), whole=sum(steps[1:]), state_mb=sum(t.nbytes for t in held) / 2**20
        )
    return timings


def _soap_refresh(matrices: int, size: int) -> dict:
    """SOAP refreshing every step on a 4-layer GPT-2 of hidden 256, with ``group=`` (each rank
    the QRs it owns, every batch's shared in one all-gather) and without (every rank all)."""
    import functional_bagua as fb

    del matrices, size
    params, grads = _gpt2_params_and_grads(vocab=2048)
    timings = {}
    all_gather = dist.all_gather
    for how, group in (("group=", dist.group.WORLD), ("every rank all", None)):
        tx = fb.soap(precondition_frequency=1, group=group)
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # the first eigenbases
        steps, calls = [], []
        dist.all_gather = lambda *args, calls=calls, **kwargs: calls.append(1) or all_gather(*args, **kwargs)
        try:
            for _ in range(5):
                dist.barrier()
                start = time.perf_counter()
                _, state = tx.update(grads, state, params)
                steps.append(time.perf_counter() - start)
        finally:
            dist.all_gather = all_gather
        timings[how] = dict(own=statistics.median(steps), whole=max(steps), all_gathers=len(calls) / len(steps))
    return timings


COMPUTATIONS = {
    "shampoo_root": _shampoo_root,
    "soap_refresh": _soap_refresh,
    "psgd_kron_fit": _psgd_kron_fit,
    "shampoo_roots_of_many_shapes": _shampoo_roots_of_many_shapes,
    "soap_by_tensor": _soap_by_tensor,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrices", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--computation", default="shampoo_root", choices=list(COMPUTATIONS))
    parser.add_argument("--record", action="store_true", help="keep the tables in benchmarks/results/ for the docs")
    args = parser.parse_args()
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        results = on_gloo_ranks(COMPUTATIONS[args.computation], world, args.matrices, args.size)
        by_how = results[0] if "own" not in results[0] else {"": results[0]}
        for how in by_how:
            per_rank = [r if how == "" else r[how] for r in results]
            row = dict(
                ranks=world,
                owners=how,
                own_decompositions_ms=1e3 * max(r["own"] for r in per_rank),
                with_all_gather_ms=1e3 * max(r["whole"] for r in per_rank),
            )
            if "all_gathers" in per_rank[0]:
                row = dict(
                    ranks=world,
                    transform=how,
                    step_ms=row["own_decompositions_ms"],
                    slowest_step_ms=row["with_all_gather_ms"],
                    all_gathers_per_step=per_rank[0]["all_gathers"],
                )
            if "state_mb" in per_rank[0]:
                row = dict(
                    ranks=world,
                    transform=how,
                    step_ms=row["own_decompositions_ms"],
                    state_mb_per_rank=max(r["state_mb"] for r in per_rank),
                )
            rows.append(row)
    if "all_gathers_per_step" in rows[0]:
        print("SOAP refreshing every step on a GPT-2 of hidden 256, 4 layers; one thread per rank; slowest rank's")
        columns = ["ranks", "transform", "step_ms", "slowest_step_ms", "all_gathers_per_step"]
        print(table(rows, columns))
        keep(args, "SOAP refreshing every step on a GPT-2 of hidden 256, 4 layers", columns, rows)
        return
    if "step_ms" in rows[0]:
        print("SOAP on a GPT-2 of hidden 256, 4 layers; one thread per rank; the slowest rank's median step")
        columns = ["ranks", "transform", "step_ms", "state_mb_per_rank"]
        print(table(rows, columns))
        keep(args, "SOAP on a GPT-2 of hidden 256, 4 layers", columns, rows)
        return
    base = {r["owners"]: r["own_decompositions_ms"] for r in rows if r["ranks"] == rows[0]["ranks"]}
    for r in rows:  # against the same way of sharing on the fewest ranks
        r["own x 1 rank"] = r["own_decompositions_ms"] / base[r["owners"]]
    what = {
        "shampoo_root": f"{args.matrices} matrices of {args.size} x {args.size}, float64 eigh",
        "psgd_kron_fit": f"{args.matrices} matrices of {args.size} x {args.size}, PSGD-Kron fits, float32",
        "shampoo_roots_of_many_shapes": f"{args.matrices} matrices of sizes {args.size} down by 4, one batch each, "
        "float64 eigh",
    }[args.computation]
    print(f"{what}, one thread per rank; slowest rank's medians")
    columns = ["ranks", "owners", "own_decompositions_ms", "with_all_gather_ms", "own x 1 rank"]
    columns = columns if rows[0]["owners"] else [c for c in columns if c != "owners"]
    print(table(rows, columns))
    keep(args, what, columns, rows)


def keep(args: argparse.Namespace, what: str, columns: list[str], rows: list[dict]) -> None:
    """The table in benchmarks/results/ (``--record``), one file per computation."""
    if args.record:
        title = f"{what}; one thread per rank; the slowest rank's medians"
        record(f"second_order_sharded-{args.computation}", "cpu", [dict(title=title, columns=columns, rows=rows)])


if __name__ == "__main__":
    main()
