"""Scenarios of functional_bagua.compat.optim (torch.distributed.optim's classes), run on each gloo
rank by dist_harness.run_ranks (module "torch_optim_scenarios"); test_compat_torch_optim.py compares
them with torch's own classes on the same model, data and seeds."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from helpers import errors_of
from models import batches, loss_fn, make_model
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hierarchical
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

from functional_bagua.compat import optim as ours
from functional_bagua.compat.optim import averagers as our_averagers

DTYPE = torch.float64
STEPS = 8
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


def local_batches(rank: int, world_size: int, steps: int = STEPS) -> list:
    return [(x.chunk(world_size)[rank], y.chunk(world_size)[rank]) for x, y in batches(steps, DTYPE)]


def params_of(model: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def post_local_sgd(rank: int, world_size: int, which: str, optimizer: str, averager: str) -> list:
    """torch DDP with post_localSGD_hook (gradients all-reduced for 2 steps, local after) and a
    PostLocalSGDOptimizer of torch's or ours: the parameters after each step."""
    model = make_model("shapes", DTYPE, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=averager == "periodic-view")
    alone, _ = dist.new_subgroups(group_size=1)  # local SGD after the switch: no gradient all-reduce
    ddp.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=2), post_localSGD_hook
    )
    local = OPTIMIZERS[optimizer](model.parameters())
    module = our_averagers if which == "ours" else torch_averagers
    if averager.startswith("periodic"):
        avg = module.PeriodicModelAverager(period=3, warmup_steps=2)
    else:
        cls = (
            our_averagers.HierarchicalModelAverager if which == "ours" else torch_hierarchical.HierarchicalModelAverager
        )
        levels = [(2, 2), (4, world_size)] if averager == "hierarchical" else [(2, 1), (3, 2), (5, world_size)]
        avg = cls(period_group_size_dict=OrderedDict(levels), warmup_steps=2)
    opt = (ours.PostLocalSGDOptimizer if which == "ours" else TorchPostLocalSGDOptimizer)(optim=local, averager=avg)
    trace = []
    for x, y in local_batches(rank, world_size):
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        trace.append(params_of(model))
    return trace


def post_local_sgd_all(rank: int, world_size: int) -> dict:
    out = {}
    for optimizer in OPTIMIZERS:
        for averager in ("periodic", "periodic-view", "hierarchical") + (
            ("hierarchical-3",) if world_size == 4 else ()
        ):
            for which in ("torch", "ours"):
                out[f"{which}/{optimizer}/{averager}"] = post_local_sgd(rank, world_size, which, optimizer, averager)
    return out


def averagers_take_parameters_groups_and_generators(rank: int, world_size: int) -> dict:
    """average_parameters with a module's parameters (a generator), param groups, and parameters of
    which one has no gradient (left alone, as torch's)."""
    out = {}
    for form in ("generator", "groups"):
        model = make_model("shapes", DTYPE, seed=rank)
        loss_fn(model(local_batches(rank, world_size)[0][0]), local_batches(rank, world_size)[0][1]).backward()
        model.fc.bias.grad = None  # no gradient: not averaged
        avg = our_averagers.PeriodicModelAverager(period=2)
        if form == "generator":
            avg.average_parameters(model.parameters())
        else:
            avg.average_parameters(
                [
                    {"params": [model.conv.weight, model.conv.bias]},
                    {"params": [model.fc.weight, model.fc.bias, model.scale]},
                ]
            )
        out[form] = params_of(model)
    out["start"] = params_of(make_model("shapes", DTYPE, seed=rank))
    return out


def state_dict_round_trip(rank: int, world_size: int) -> dict:
    model = make_model("shapes", DTYPE, seed=0)
    opt = ours.PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), our_averagers.PeriodicModelAverager(period=2)
    )
    for x, y in local_batches(rank, world_size, steps=3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    saved = opt.state_dict()
    fresh = ours.PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), our_averagers.PeriodicModelAverager(period=2)
    )
    fresh.load_state_dict(saved)
    without_step = {k: v for k, v in saved.items() if k != "step"}
    other = ours.PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), our_averagers.PeriodicModelAverager(period=2)
    )
    other.averager.step = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(without_step)
    return dict(
        saved_step=saved["step"],
        loaded_step=fresh.averager.step,
        loaded_state_equal=all(
            torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"]) for p in model.parameters()
        ),
        missing_step=other.averager.step,
        warnings=[str(w.message) for w in caught],
    )


def bad_averagers(rank: int, world_size: int) -> dict:
    return errors_of(
        {
            "period 0": lambda: our_averagers.PeriodicModelAverager(period=0),
            "negative warmup": lambda: our_averagers.PeriodicModelAverager(period=2, warmup_steps=-1),
            "empty hierarchy": lambda: our_averagers.HierarchicalModelAverager({}),
            "last size not the world": lambda: our_averagers.HierarchicalModelAverager(OrderedDict([(2, 1), (4, 1)])),
            "not an optimizer": lambda: ours.PostLocalSGDOptimizer(
                "sgd", our_averagers.PeriodicModelAverager(period=2)
            ),
        }
    )


# ---- ZeroRedundancyOptimizer -------------------------------------------------------------------

ZERO_CASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adam-for-loop": (torch.optim.Adam, dict(lr=1e-2, foreach=False)),
    "adamw-foreach": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    "adamw-fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
}


def zero_optimizer(which: str, params: Any, case: str, **kwargs: Any) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    cls, defaults = ZERO_CASES[case]
    zero = ours.ZeroRedundancyOptimizer if which == "ours" else TorchZero
    return zero(params, optimizer_class=cls, **defaults, **kwargs)


def zero_train(rank: int, world_size: int, which: str, case: str, setup: str, steps: int = 6) -> dict:
    """DDP + a ZeroRedundancyOptimizer (torch's or ours): parameters after each step and the
    consolidated state dict on rank 0. ``setup``: "plain", "bucket_view" or "groups" (two param
    groups, a third added after 3 steps)."""
    model = make_model("shapes", DTYPE, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if setup == "groups":
        params: Any = [{"params": [model.conv.weight, model.conv.bias]}, {"params": [model.fc.weight], "lr": 0.05}]
    else:
        params = model.parameters()
    opt = zero_optimizer(which, params, case, parameters_as_bucket_view=setup == "bucket_view")
    trace = []
    for t, (x, y) in enumerate(local_batches(rank, world_size, steps=steps)):
        if setup == "groups" and t == 3:
            opt.add_param_group({"params": [model.fc.bias, model.scale], "lr": 0.02})
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        trace.append(params_of(model))
    opt.consolidate_state_dict(to=0)
    views = None
    if setup == "bucket_view":
        storages = {b.untyped_storage().data_ptr() for buckets in opt._buckets for b in buckets}
        views = all(p.untyped_storage().data_ptr() in storages for p in model.parameters())
    return dict(
        trace=trace,
        state=opt.state_dict() if rank == 0 else None,
        local_entries=len(opt.optim.state),
        total=sum(len(g["params"]) for g in opt.param_groups),
        params_view_buckets=views,
    )


def zero_all(rank: int, world_size: int) -> dict:
    out = {}
    for case in ZERO_CASES:
        for setup in ("plain", "bucket_view", "groups"):
            for which in ("torch", "ours"):
                out[f"{which}/{case}/{setup}"] = zero_train(rank, world_size, which, case, setup)
    return out


def _resume(rank: int, world_size: int, case: str, params: dict, state: dict, data: list, zero: bool) -> list:
    """Continue from ``params`` and a whole-optimizer ``state``: with our ZeRO, or with the plain
    optimizer class (every rank holding all the state) under DDP."""
    model = make_model("shapes", DTYPE, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    cls, defaults = ZERO_CASES[case]
    opt = zero_optimizer("ours", model.parameters(), case) if zero else cls(model.parameters(), **defaults)
    opt.load_state_dict(state)
    trace = []
    for x, y in data:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        trace.append(params_of(model))
    return trace


def zero_resume(rank: int, world_size: int) -> dict:
    """Save after 3 steps (consolidated, rank 0's state given to every rank) and resume for 3 more:
    the same numbers as 6 uninterrupted steps."""
    out = {}
    for case in ("sgd", "adamw-fused"):
        data = local_batches(rank, world_size, steps=6)
        model = make_model("shapes", DTYPE, seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = zero_optimizer("ours", model.parameters(), case)
        trace = []
        for t, (x, y) in enumerate(data):
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()
            trace.append(params_of(model))
            if t == 2:
                opt.consolidate_state_dict(to=0)
                payload = [opt.state_dict() if rank == 0 else None]
                dist.broadcast_object_list(payload, src=0)
                saved = (params_of(model), payload[0])
        out[case] = dict(uninterrupted=trace[3:], resumed=_resume(rank, world_size, case, *saved, data[3:], zero=True))
    return out


def zero_save_for_other_world(rank: int, world_size: int) -> str:
    """Train 3 steps on this world size and save the parameters and the consolidated state."""
    import os

    model = make_model("shapes", DTYPE, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = zero_optimizer("ours", model.parameters(), "adam-for-loop")
    for x, y in local_batches(rank, world_size, steps=3):
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save((params_of(model), opt.state_dict()), os.path.join(os.environ["FB_TEST_DIR"], "zero.pt"))
    dist.barrier()
    return "saved"


def zero_load_from_other_world(rank: int, world_size: int) -> dict:
    """Load what zero_save_for_other_world saved on another world size and train 3 steps, with our
    ZeRO and with the plain optimizer class holding the whole state."""
    import os

    params, state = torch.load(os.path.join(os.environ["FB_TEST_DIR"], "zero.pt"), weights_only=False)
    data = local_batches(rank, world_size, steps=3)
    return dict(
        zero=_resume(rank, world_size, "adam-for-loop", params, state, data, zero=True),
        plain=_resume(rank, world_size, "adam-for-loop", params, state, data, zero=False),
    )


def zero_bad_input(rank: int, world_size: int) -> dict:
    model = make_model("shapes", DTYPE, seed=0)
    return errors_of(
        {
            "state_dict before consolidating": lambda: zero_optimizer("ours", model.parameters(), "sgd").state_dict(),
            "optimizer_class not a class": lambda: ours.ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.SGD(model.parameters(), lr=0.1), lr=0.1
            ),
            "empty parameters": lambda: zero_optimizer("ours", [], "sgd"),
        }
    )


def zero_join_uneven_inputs(rank: int, world_size: int) -> dict:
    """Under torch's Join with DDP, rank r has 3 + r batches: ours and torch's ZeRO end equal."""
    from torch.distributed.algorithms.join import Join

    out = {}
    for which in ("torch", "ours"):
        model = make_model("shapes", DTYPE, seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = zero_optimizer(which, model.parameters(), "adam-for-loop")
        with Join([ddp, opt]):
            for x, y in local_batches(rank, world_size, steps=6)[: 3 + rank]:
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()
        out[which] = params_of(model)
    return out


def zero_overlap_train(rank: int, world_size: int, case: str, hook: str, setup: str, steps: int = 6) -> dict:
    """DDP (buckets of ~1 KB: several per backward) with a comm hook, and either our ZeRO stepping
    inside backward (``hook``: "step" or "interleaved") or, as the reference (``hook`` "none"), the
    plain optimizer class stepped after backward. ``setup``: "plain", "fp16" (torch's
    fp16_compress_hook instead of allreduce_hook), "view" (gradient_as_bucket_view) or "groups"
    (two param groups)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook

    model = make_model("shapes", DTYPE, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001, gradient_as_bucket_view=setup == "view")
    comm = fp16_compress_hook if setup == "fp16" else allreduce_hook
    params: Any = model.parameters()
    if setup == "groups":
        params = [
            {"params": [model.conv.weight, model.fc.weight]},
            {"params": [model.conv.bias, model.fc.bias, model.scale], "lr": 0.05},
        ]
    cls, defaults = ZERO_CASES[case]
    if hook == "none":
        opt = cls(params, **defaults)
        ddp.register_comm_hook(None, comm)
    else:
        opt = ours.ZeroRedundancyOptimizer(params, optimizer_class=cls, overlap_with_ddp=True, **defaults)
        wrap = ours.hook_with_zero_step if hook == "step" else ours.hook_with_zero_step_interleaved
        ddp.register_comm_hook(None, wrap(comm, ddp, opt))
    start, trace = params_of(model), []
    for x, y in local_batches(rank, world_size, steps=steps):
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        if hook == "none":
            opt.step()
        trace.append(params_of(model))
    if hook == "none":
        state = opt.state_dict()
    else:
        opt.consolidate_state_dict(to=0)
        state = opt.state_dict() if rank == 0 else None
    local_entries = len(opt.state) if hook == "none" else len(opt.optim.state)
    return dict(start=start, trace=trace, state=state, local_entries=local_entries)


def zero_overlap_all(rank: int, world_size: int) -> dict:
    out = {}
    for case in ZERO_CASES:
        for setup in ("plain", "fp16", "view", "groups"):
            for hook in ("none", "step", "interleaved"):
                out[f"{case}/{setup}/{hook}"] = zero_overlap_train(rank, world_size, case, hook, setup)
    return out


def zero_overlap_bad_input(rank: int, world_size: int) -> dict:
    """torch's hook given our ZeRO; our hook given a ZeRO without overlap, or torch's ZeRO; step()
    under overlap (a warning, nothing stepped)."""
    import logging

    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    model = make_model("shapes", DTYPE, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    overlapping = ours.ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    plain = ours.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    other = make_model("shapes", DTYPE, seed=1)
    out = errors_of(
        {
            "torch's hook": lambda: torch_hooks.hook_with_zero_step(allreduce_hook, ddp, overlapping),
            "without overlap": lambda: ours.hook_with_zero_step(allreduce_hook, ddp, plain),
            "torch's zero": lambda: ours.hook_with_zero_step_interleaved(
                allreduce_hook, ddp, TorchZero(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
            ),
            "another model's zero": lambda: ours.hook_with_zero_step(
                allreduce_hook,
                ddp,
                ours.ZeroRedundancyOptimizer(
                    other.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1
                ),
            ),
        }
    )
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("functional_bagua.compat.optim.zero").addHandler(handler)
    before = params_of(model)
    loss_fn(
        ddp(local_batches(rank, world_size, steps=1)[0][0]), local_batches(rank, world_size, steps=1)[0][1]
    ).backward()
    out["step returns"] = overlapping.step()
    out["step warned"] = [r.getMessage() for r in records]
    out["unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return out


# ---- the behaviours torch's own ZeRO tests check on the CPU, ours against torch's class ------------


class _SGDWithKwargs(torch.optim.SGD):
    """A step taking a keyword argument (it records it) and adding a key to its first param group."""

    def step(self, closure: Any = None, record: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        record.append("called")
        self.param_groups[0]["added_by_step"] = 0.5
        return loss


class _SGDWithoutClosure(torch.optim.SGD):
    def step(self) -> Any:  # type: ignore[override]
        return super().step()


def _outcome(call: Any) -> Any:
    try:
        return call()
    except Exception as e:  # compared by type with torch's
        return type(e).__name__


def _zero_behaviours(zero: Any, rank: int, world_size: int) -> dict:
    out: dict = {}
    data = local_batches(rank, world_size, steps=4)

    def fresh(cls: Any = torch.optim.SGD, view: bool = False, **kwargs: Any) -> tuple:
        model = make_model("shapes", DTYPE, seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return model, ddp, zero(model.parameters(), optimizer_class=cls, parameters_as_bucket_view=view, **kwargs)

    model, ddp, opt = fresh(lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    out["scheduler"] = []
    for x, y in data:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        scheduler.step()
        out["scheduler"].append((params_of(model), opt.param_groups[0]["lr"]))
    opt.zero_grad()
    out["zero_grad"] = [p.grad for p in model.parameters()]

    model, ddp, opt = fresh(_SGDWithKwargs, lr=0.1)
    record: list = []
    loss_fn(ddp(data[0][0]), data[0][1]).backward()
    opt.step(record=record)
    out["kwargs"] = (record, opt.param_groups[0].get("added_by_step"), params_of(model))

    model, ddp, opt = fresh(_SGDWithoutClosure, lr=0.1)
    loss_fn(ddp(data[0][0]), data[0][1]).backward()
    opt.step()
    out["without closure"] = params_of(model)

    for view in (False, True):
        model, ddp, opt = fresh(view=view, lr=0.1)
        loss_fn(ddp(data[0][0]), data[0][1]).backward()

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(ddp(data[1][0]), data[1][1])
            loss.backward()
            return loss

        out[f"closure view={view}"] = (opt.step(closure=closure).detach(), params_of(model))

    model, ddp, opt = fresh(torch.optim.Adam, lr=1e-2, maximize=True, foreach=False)
    for x, y in data:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    out["maximize"] = params_of(model)

    for view in (False, True):  # a parameter frozen after two steps, unfrozen after three
        model, ddp, opt = fresh(view=view, lr=0.1, momentum=0.9)
        trace = []
        for t, (x, y) in enumerate(data):
            model.fc.bias.requires_grad_(t != 2)
            opt.zero_grad()
            loss_fn(model(x), y).backward()  # no DDP: its buckets are fixed at construction
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
            opt.step()
            trace.append(params_of(model))
        out[f"toggled requires_grad view={view}"] = trace

    model, ddp, opt = fresh(torch.optim.Adam, lr=1e-2, foreach=False)  # a plain optimizer's state, loaded
    plain_model = make_model("shapes", DTYPE, seed=0)
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-3, foreach=False)
    loss_fn(plain_model(data[0][0]), data[0][1]).backward()
    plain.step()
    opt.load_state_dict(plain.state_dict())
    loss_fn(ddp(data[1][0]), data[1][1]).backward()
    opt.step()
    opt.consolidate_state_dict(to=0)
    out["plain state loaded"] = (params_of(model), opt.param_groups[0]["lr"], opt.state_dict() if rank == 0 else None)

    linear = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.Linear(10, 10))
    out["constructor"] = {
        "empty": _outcome(lambda: zero([], optimizer_class=torch.optim.SGD, lr=0.1)),
        "a tensor": _outcome(lambda: zero(torch.randn(2), optimizer_class=torch.optim.SGD, lr=0.1)),
        "a float": _outcome(lambda: zero(1.5, optimizer_class=torch.optim.SGD, lr=0.1)),
        "a list with an int": _outcome(
            lambda: zero([*linear.parameters(), 42], optimizer_class=torch.optim.SGD, lr=0.1)
        ),
        "groups": _outcome(
            lambda: len(
                zero(
                    [{"params": [linear[0].weight, linear[1].weight]}, {"params": [linear[0].bias, linear[1].bias]}],
                    optimizer_class=torch.optim.SGD,
                    lr=0.1,
                ).optim.param_groups
            )
        ),
        "a generator": _outcome(
            lambda: len(zero(linear.parameters(), optimizer_class=torch.optim.SGD, lr=0.1).param_groups)
        ),
        "sparse": _outcome(
            lambda: zero([torch.sparse_coo_tensor(size=(2, 3))], optimizer_class=torch.optim.SGD, lr=0.1)
        ),
        "two dtypes": _outcome(
            lambda: zero([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], optimizer_class=torch.optim.SGD, lr=0.1)
        ),
    }
    return out


def zero_behaviours(rank: int, world_size: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    return {
        which: _zero_behaviours(zero, rank, world_size)
        for which, zero in (("ours", ours.ZeroRedundancyOptimizer), ("torch", TorchZero))
    }


def zero_join_with_another_joinable(rank: int, world_size: int) -> dict:
    """Join with DDP, ZeRO and a Joinable of the user's whose hook reads ``zero._all_params`` (as
    torch's test does) and gives a rank out of inputs gradients of its own; rank r has 2 + r batches."""
    from torch.distributed.algorithms.join import Join, Joinable, JoinHook

    class ScaledGradients(JoinHook):
        def __init__(self, zero: Any) -> None:
            self.zero = zero

        def main_hook(self) -> None:
            for p in self.zero._all_params:
                p.grad = torch.full_like(p, 0.5)

    class GradientGiver(Joinable):
        def __init__(self, zero: Any) -> None:
            super().__init__()
            self.zero = zero

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return ScaledGradients(self.zero)

        @property
        def join_device(self) -> torch.device:
            return torch.device("cpu")

        @property
        def join_process_group(self) -> Any:
            return dist.group.WORLD

    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    out = {}
    for which, zero in (("ours", ours.ZeroRedundancyOptimizer), ("torch", TorchZero)):
        model = make_model("shapes", DTYPE, seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = zero(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        giver = GradientGiver(opt)
        with Join([ddp, giver, opt]):  # DDP first: its notification drives Join's per-step all-reduce
            for x, y in local_batches(rank, world_size, steps=5)[: 2 + rank]:
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()
        out[which] = params_of(model)
    return out


def zero_on_a_subgroup(rank: int, world_size: int) -> dict:
    """ZeRO over the even and the odd ranks separately (4 ranks), gradients averaged within each."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    mine, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    out = {}
    for which, zero in (("ours", ours.ZeroRedundancyOptimizer), ("torch", TorchZero)):
        model = make_model("shapes", DTYPE, seed=0)
        opt = zero(model.parameters(), optimizer_class=torch.optim.Adam, process_group=mine, lr=1e-2, foreach=False)
        trace = []
        for x, y in local_batches(rank, world_size, steps=3):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=mine)
                p.grad /= 2
            opt.step()
            trace.append(params_of(model))
        out[which] = dict(trace=trace, local=len(opt.optim.state))
    return out
