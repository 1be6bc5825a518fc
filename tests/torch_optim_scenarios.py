"""Scenarios of functional_bagua.compat.optim (torch.distributed.optim's classes), run on each gloo
rank by dist_harness.run_ranks (module "torch_optim_scenarios"); test_compat_torch_optim.py compares
them with torch's own classes on the same model, data and seeds."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
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
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    alone, _ = dist.new_subgroups(group_size=1)  # local SGD after the switch: no gradient all-reduce
    ddp.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=2), post_localSGD_hook
    )
    local = OPTIMIZERS[optimizer](model.parameters())
    module = our_averagers if which == "ours" else torch_averagers
    if averager == "periodic":
        avg = module.PeriodicModelAverager(period=3, warmup_steps=2)
    else:
        cls = (
            our_averagers.HierarchicalModelAverager if which == "ours" else torch_hierarchical.HierarchicalModelAverager
        )
        avg = cls(period_group_size_dict=OrderedDict([(2, 2), (4, world_size)]), warmup_steps=2)
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
        for averager in ("periodic", "hierarchical"):
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
    out = {}
    for name, make in {
        "period 0": lambda: our_averagers.PeriodicModelAverager(period=0),
        "negative warmup": lambda: our_averagers.PeriodicModelAverager(period=2, warmup_steps=-1),
        "empty hierarchy": lambda: our_averagers.HierarchicalModelAverager({}),
        "last size not the world": lambda: our_averagers.HierarchicalModelAverager(OrderedDict([(2, 1), (4, 1)])),
        "not an optimizer": lambda: ours.PostLocalSGDOptimizer("sgd", our_averagers.PeriodicModelAverager(period=2)),
    }.items():
        try:
            make()
            out[name] = None
        except Exception as e:  # the test reads type and message
            out[name] = (type(e).__name__, str(e))
    return out
