"""Second-order transforms sharded over gloo ranks (run by dist_harness.run_ranks, module
"second_order_scenarios"): each rank computes some of the eigendecompositions, roots and
PSGD-Kron fits and shares them; test_second_order_sharded.py compares with one process on the
global batch. The probes of PSGD-Kron come from torch's global RNG, seeded per step (alike on
every rank, or differently per rank). Data is drawn on the CPU and moved to the default device,
so a run on CUDA starts from the same numbers (test_cuda_distributed.py)."""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

import optree
import torch
import torch.distributed as dist

import functional_bagua as fb
import functional_bagua.distributed as fbd
from functional_bagua.transforms.batched_matrices import Owners, owner_computes, owner_computes_all

SHAPES = {"a": (6, 6), "b": (6, 6), "c": (6, 6), "d": (5, 5), "e": (5, 5), "f": (4, 3, 3, 3)}
STEPS = 5


def drawn(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Normal float64 numbers drawn on the CPU by ``gen``, on the default device."""
    return torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu").to(torch.get_default_device())


def local_gradients(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {k: drawn(s, gen) for k, s in SHAPES.items()}


def start() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {k: drawn(s, gen) for k, s in SHAPES.items()}


MAKERS = {
    "soap": lambda group: fb.soap(precondition_frequency=2, matrix_dtype=torch.float64, group=group),
    "shampoo": lambda group: fb.shampoo(grafting="adam", precondition_frequency=2, group=group),
    "psgd_kron": lambda group: fb.psgd_kron(lr=1e-2, precond_dtype=torch.float64, group=group),
}


def seed(step: int, rank: int = 0) -> None:
    """The global RNG before a step (PSGD-Kron's probes)."""
    torch.manual_seed(100 * step + rank)


NAN_STEP = 1  # the step where NaN_AT's gradient is NaN (on rank 1 only, in the NaN scenarios)
NAN_AT = "b"  # the second row of its batch: rank 1's to compute


def with_nan(grads: dict, rank: int, step: int) -> dict:
    """``grads`` with a NaN in ``NAN_AT``'s at ``NAN_STEP`` on rank 1."""
    if rank == 1 and step == NAN_STEP:
        grads = dict(grads, **{NAN_AT: grads[NAN_AT].clone().fill_(float("nan"))})
    return grads


def run(
    tx: fb.GradientTransformation, rank: int, allreduce: bool = True, seed_rank: int = 0, nan: bool = False
) -> dict:
    """The parameters after STEPS steps of ``tx`` on this rank's gradients (averaged by
    ``allreduce_gradients`` first where ``allreduce``; with a NaN where ``nan``, skipped by
    ``apply_if_finite``)."""
    if nan:  # inside the all-reduce: it decides on the averaged gradients, alike on every rank
        tx = fb.apply_if_finite(tx, 3)
    if allreduce:
        tx = fb.chain(fbd.allreduce_gradients(), tx)
    params = start()
    state = tx.init(params)
    for step in range(STEPS):
        seed(step, seed_rank)
        grads = local_gradients(rank, step)
        u, state = tx.update(with_nan(grads, rank, step) if nan else grads, state, params)
        params = fb.apply_updates(params, u)
    return params


def run_fused(tx: fb.GradientTransformation, rank: int) -> dict:
    """:func:`run` on flat buffers (``fb.fuse``, eagerly), the gradients averaged first: the
    parameters after STEPS steps."""
    params = start()
    layout = fb.FlatLayout.of(params)
    fused, flat = fb.fuse(tx, layout), layout.flatten(params)
    state = fused.init(flat)
    for step in range(STEPS):
        seed(step)
        grads = layout.flatten(local_gradients(rank, step))
        for g in grads.values():
            dist.all_reduce(g)
            g /= dist.get_world_size()
        u, state = fused.update(grads, state, flat)
        flat = fb.apply_updates(flat, u)
    return layout.unflatten(flat)


def sharded_second_order(rank: int, world_size: int) -> dict:
    """Each rank its own gradients, averaged by allreduce_gradients, then the transform with its
    decompositions shared among the ranks: the parameters after STEPS steps."""
    out = {name: run(make(dist.group.WORLD), rank) for name, make in MAKERS.items()}
    out.update({f"{name}, fused": run_fused(make(dist.group.WORLD), rank) for name, make in MAKERS.items()})
    # probes drawn from RNGs seeded per rank: each fit is its owner's, shared with its perturbed
    # momentum, so the ranks still agree
    out["psgd_kron, RNG per rank"] = run(MAKERS["psgd_kron"](dist.group.WORLD), rank, seed_rank=rank)
    for name, make in MAKERS.items():  # the gradients not averaged: refused on every rank alike
        try:
            run(make(dist.group.WORLD), rank, allreduce=False)
            out[f"{name}, not averaged"] = None
        except ValueError as error:
            out[f"{name}, not averaged"] = str(error)
    for name in ("shampoo", "soap"):
        out[f"{name}, all-gathers per step"] = all_gathers_per_step(MAKERS[name](dist.group.WORLD), rank)
    for name, make in MAKERS.items():  # rank 1 a step ahead: refused alike, not a hang
        out[f"{name}, counts differ"] = differing_counts(make(dist.group.WORLD), rank)
    # a NaN gradient under apply_if_finite: PSGD-Kron's fit takes it (the step is then skipped)
    out["psgd_kron, a NaN step skipped"] = run(MAKERS["psgd_kron"](dist.group.WORLD), rank, nan=True)
    # Shampoo's eigh raises on the NaN statistic, on the rank that owns it: every rank raises; with
    # Newton's roots too (every rank learns the results' shapes on meta before computing its own)
    newton = lambda group: fb.shampoo(grafting="adam", precondition_frequency=2, root_method="newton", group=group)  # noqa: E731
    for name, make in (("shampoo", MAKERS["shampoo"]), ("shampoo newton", newton)):
        try:
            run(make(dist.group.WORLD), rank, nan=True)
            out[f"{name}, a NaN statistic"] = None
        except RuntimeError as error:
            out[f"{name}, a NaN statistic"] = str(error)
    # gradients of other shapes on rank 1: refused alike before anything is shared
    shapes = {"a": (6, 6), "b": (5, 5) if rank == 0 else (5, 4)}
    tx = fb.shampoo(precondition_frequency=1, group=dist.group.WORLD)
    params = {k: torch.ones(s, dtype=torch.float64) for k, s in shapes.items()}
    try:
        tx.update({k: torch.ones(s, dtype=torch.float64) for k, s in shapes.items()}, tx.init(params), params)
        out["shampoo, other shapes"] = None
    except ValueError as error:
        out["shampoo, other shapes"] = str(error)
    return out


@contextlib.contextmanager
def all_gathers_counted() -> Iterator[list]:
    """``dist.all_gather`` counted while inside: the list gets one entry per call."""
    all_gather, calls = dist.all_gather, []
    dist.all_gather = lambda *args, **kwargs: calls.append(1) or all_gather(*args, **kwargs)
    try:
        yield calls
    finally:
        dist.all_gather = all_gather


def all_gathers_per_step(tx: fb.GradientTransformation, rank: int) -> list:
    """The all-gathers of each of four steps on equal gradients (no all-reduce), counted."""
    params, counts = start(), []
    state = tx.init(params)
    with all_gathers_counted() as calls:
        for step in range(4):
            calls.clear()
            u, state = tx.update(local_gradients(0, step), state, params)
            params = fb.apply_updates(params, u)
            counts.append(len(calls))
    return counts


def differing_counts(tx: fb.GradientTransformation, rank: int) -> Optional[str]:
    """Equal gradients on every rank, but rank 1's state a step ahead (its counts one higher):
    the ranks would refresh in different steps. The error each rank raises, or ``None``."""
    params = start()
    state = tx.init(params)
    if rank == 1:  # the transform's own state is the chain's first
        own = state[0]
        ahead = {field: optree.tree_map(lambda c: c + 1, getattr(own, field)) for field in ("count",)}
        state = (own._replace(**ahead), *state[1:])
    try:
        for step in range(3):
            seed(step)
            u, state = tx.update(local_gradients(0, step), state, params)
            params = fb.apply_updates(params, u)
    except ValueError as error:
        return str(error)
    return None


def balanced_owners(rank: int, world_size: int) -> dict:
    """Six batches through one update's Owners (four single 8 x 8 matrices, then three 4 x 4 and
    one 2 x 2): each matrix's norm, computed by its owner and gathered, and the loads after."""
    owners = Owners(dist.group.WORLD, "balance test", "norms")
    owners.begin_update()
    results = [owner_computes(torch.linalg.matrix_norm, batch, owners) for batch in owner_batches()]
    out = {"results": results, "loads": list(owners.loads)}
    # all six at once, counting the collectives: the norms, and each with its transpose (a tuple)
    with all_gathers_counted() as calls:
        owners = Owners(dist.group.WORLD, "balance test", "norms")
        owners.begin_update()
        out["all at once"] = owner_computes_all(torch.linalg.matrix_norm, owner_batches(), owners)
        out["loads at once"] = list(owners.loads)
        pairs = owner_computes_all(lambda m: (m.mT.contiguous(), torch.linalg.matrix_norm(m)), owner_batches(), None)
        out["tuples at once"] = owner_computes_all(
            lambda m: (m.mT.contiguous(), torch.linalg.matrix_norm(m)), owner_batches(), dist.group.WORLD
        )
        out["tuples here"] = pairs
    out["all-gathers"] = len(calls)
    return out


def owner_batches() -> list:
    gen = torch.Generator().manual_seed(3)
    shapes = [(1, 8, 8)] * 4 + [(3, 4, 4), (1, 2, 2)]
    return [drawn(s, gen) for s in shapes]


# --- shard_by_tensor: each rank the state of the whole tensors it owns ----------------------------

WHOLE_TENSOR_MAKERS = {
    **{name: (lambda make: lambda: make(None))(make) for name, make in MAKERS.items()},
    "lamb": lambda: fb.lamb(1e-2),
}
MATRIX_SHAPES = {k: s for k, s in SHAPES.items() if len(s) == 2}  # Muon: matrices only


def by_tensor(
    inner: fb.GradientTransformation, rank: int, shapes: dict = SHAPES, seed_rank: int = 0, compiled: bool = False
) -> tuple:
    """The parameters after STEPS steps of ``shard_by_tensor(inner)`` on this rank's gradients
    (its update under ``torch.compile(fullgraph=True)`` where ``compiled``: traced by dynamo and
    AOT autograd, run without inductor's code generation, which the compiled modules of each
    transform test), and the bytes of this rank's inner state."""
    tx = fbd.shard_by_tensor(inner)
    update = torch.compile(tx.update, fullgraph=True, backend="aot_eager") if compiled else tx.update
    params = {k: v for k, v in start().items() if k in shapes}
    state = tx.init(params)
    for step in range(STEPS):
        seed(step, seed_rank)
        grads = {k: v for k, v in local_gradients(rank, step).items() if k in shapes}
        u, state = update(grads, state, params)
        params = fb.apply_updates(params, u)
    held = [t for t in fb.tree.flatten(state.inner)[0] if isinstance(t, torch.Tensor)]
    return params, sum(t.numel() * t.element_size() for t in held)


def sharded_by_tensor(rank: int, world_size: int) -> dict:
    out = {name: by_tensor(make(), rank) for name, make in WHOLE_TENSOR_MAKERS.items()}
    out["muon"] = by_tensor(fb.muon(lr=0.02), rank, MATRIX_SHAPES)
    out["soap, resumed"] = resumed_by_tensor(rank, world_size)
    out["adamw"] = by_tensor(fb.adamw(1e-2), rank)
    if world_size == 2:  # compiled: SOAP's conds between the collectives (2 ranks, SOAP alone: CI's time)
        for name in ("soap",):
            out[f"{name}, compiled"] = by_tensor(WHOLE_TENSOR_MAKERS[name](), rank, compiled=True)
    try:
        tx = fbd.shard_by_tensor(fb.adamw(1e-2))
        params = start()
        state = tx.init(params)
        grads = dict(local_gradients(rank, 0), a=None)
        tx.update(grads, state, params)
        out["a None gradient"] = None
    except ValueError as error:
        out["a None gradient"] = str(error)
    return out


def resumed_by_tensor(rank: int, world_size: int) -> dict:
    """SOAP under shard_by_tensor saved after half the steps (fb.state_dict), loaded into a new
    init and run on: the parameters, and the error loading the next rank's checkpoint raises."""
    tx = fbd.shard_by_tensor(MAKERS["soap"](None))
    params = start()
    state = tx.init(params)
    for step in range(STEPS):
        if step == STEPS // 2:
            saved = fb.state_dict(state)
            state = fb.load_state_dict(tx.init(params), {k: v.clone() for k, v in saved.items()})
            others = [None] * world_size
            dist.all_gather_object(others, {k: v.clone() for k, v in saved.items()})
        u, state = tx.update(local_gradients(rank, step), state, params)
        params = fb.apply_updates(params, u)
    try:
        fb.load_state_dict(tx.init(params), others[(rank + 1) % world_size])
        refused = None
    except ValueError as error:
        refused = str(error)
    return {"params": params, "another rank's": refused}


class _RaisesOn(NamedTuple):
    """A transform whose update raises where it holds the tensor ``name`` (one rank's, under
    shard_by_tensor)."""

    name: str

    def transform(self) -> fb.GradientTransformation:
        def update(grads, state, params=None):
            if self.name in grads:
                raise ValueError(f"the update of {self.name!r} failed here")
            return grads, state

        return fb.GradientTransformation(lambda params: fb.EmptyState(), update)


def refused_by_tensor(rank: int, world_size: int) -> dict:
    """What shard_by_tensor refuses, each on every rank alike (the error's text, or None)."""
    out = {}
    cases = {
        "clip_by_global_norm": lambda: fb.chain(fb.clip_by_global_norm(1.0), fb.adamw(1e-2)),
        "apply_if_finite": lambda: fb.apply_if_finite(fb.adamw(1e-2), 3),
        "soap with group=": lambda: MAKERS["soap"](dist.group.WORLD),
        "an inner that raises on one rank": lambda: _RaisesOn("f").transform(),
    }
    for name, make in cases.items():
        try:
            by_tensor(make(), rank)
            out[name] = None
        except Exception as error:  # the kind is checked by the test
            out[name] = f"{type(error).__name__}: {error}"
    try:
        fbd.shard_by_tensor(fb.sgd(0.1)).init({"a": {"b": torch.zeros(2)}, "a/b": torch.zeros(2)})
        out["two tensors of one name"] = None
    except ValueError as error:
        out["two tensors of one name"] = str(error)
    # an empty tensor of its own dtype, owned by rank 1 on two ranks: its update is gathered too
    params = {"a": torch.ones(10, dtype=torch.float64), "z": torch.zeros(0, 3), "b": torch.ones(4, dtype=torch.float64)}
    tx = fbd.shard_by_tensor(fb.sgd(0.1))
    grads = {k: torch.full_like(v, float(rank + 1)) for k, v in params.items()}
    updates, _ = tx.update(grads, tx.init(params), params)
    out["updates with an empty tensor"] = updates
    return out
