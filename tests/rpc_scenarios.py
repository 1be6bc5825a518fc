"""Scenarios of functional_bagua.compat.optim.DistributedOptimizer, run on worker 0 of several RPC
workers by dist_harness.run_rpc; the parameters live on workers 1 and 2."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from devices import seeded
from helpers import errors_of
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

from functional_bagua.compat.optim import DistributedOptimizer

DTYPE = torch.float64
SHAPES = {"w1": (3, 4), "b1": (4,), "w2": (4, 2)}
OWNERS = {"w1": "worker1", "b1": "worker1", "w2": "worker2"}


def make_param(seed: int, shape: tuple, requires_grad: bool = True) -> torch.Tensor:
    gen = seeded(seed)
    return torch.randn(shape, generator=gen, dtype=DTYPE).requires_grad_(requires_grad)


def remote_params() -> dict:
    return {
        name: rpc.remote(OWNERS[name], make_param, args=(i, shape)) for i, (name, shape) in enumerate(SHAPES.items())
    }


def data(steps: int) -> list:
    gen = seeded(7)
    return [
        (torch.randn(5, 3, generator=gen, dtype=DTYPE), torch.randn(5, 2, generator=gen, dtype=DTYPE))
        for _ in range(steps)
    ]


def train(optimizer_cls: Any, which: str, steps: int = 5, skip: int = 2, **kwargs: Any) -> list:
    """A two-layer model whose weights live on workers 1 and 2; on step ``skip`` the bias is not
    used (no gradient; it is not even fetched: distributed autograd waits for a gradient of every
    tensor fetched in the context). The parameters after each step."""
    rrefs = remote_params()
    dist_optimizer = (DistributedOptimizer if which == "ours" else TorchDistributedOptimizer)(
        optimizer_cls, list(rrefs.values()), **kwargs
    )
    trace = []
    for t, (x, y) in enumerate(data(steps)):
        with dist_autograd.context() as context_id:
            w1, w2 = rrefs["w1"].to_here(), rrefs["w2"].to_here()
            hidden = x @ w1 if t == skip else x @ w1 + rrefs["b1"].to_here()  # step `skip` does not fetch b1
            loss = ((torch.tanh(hidden) @ w2 - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            dist_optimizer.step(context_id)
        trace.append({n: r.to_here().detach().clone() for n, r in rrefs.items()})
    return trace


def against_torch(world_size: int) -> dict:
    out = {}
    for name, (cls, kwargs) in {
        "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        "adam": (torch.optim.Adam, dict(lr=1e-2)),
        "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    }.items():
        out[name] = dict(ours=train(cls, "ours", **kwargs), torch=train(cls, "torch", **kwargs))
    # the bias's first gradient comes a step after the weights' (torch's fused SGD kernel: two calls)
    sgd = dict(lr=0.1, momentum=0.9, dampening=0.1)  # with dampening, a first step differs from a later one
    out["sgd-late-bias"] = dict(
        ours=train(torch.optim.SGD, "ours", skip=0, **sgd), torch=train(torch.optim.SGD, "torch", skip=0, **sgd)
    )
    # an alias without a torch kernel: the compiled pure update
    adagrad = dict(lr=0.1, lr_decay=0.01)
    out["adagrad"] = dict(
        ours=train(torch.optim.Adagrad, "ours", **adagrad), torch=train(torch.optim.Adagrad, "torch", **adagrad)
    )
    # torch's DistributedOptimizer refuses foreach=True (TorchScript); ours drops the flag
    out["adamw-foreach"] = dict(
        ours=train(torch.optim.AdamW, "ours", lr=1e-2, weight_decay=0.1, foreach=True), torch=out["adamw"]["torch"]
    )
    try:
        train(torch.optim.AdamW, "torch", lr=1e-2, weight_decay=0.1, foreach=True)
        out["torch refuses foreach"] = None
    except RuntimeError as e:
        out["torch refuses foreach"] = str(e)
    return out


class Scaled(torch.optim.Optimizer):
    """A user's optimizer (no functional_bagua alias): p <- p - lr * grad."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


TORCH_TEST_CONFIGS = {  # the configurations torch's own DistributedOptimizer tests step
    "adam-amsgrad": (torch.optim.Adam, dict(lr=0.05, amsgrad=True)),
    "adamw-amsgrad": (torch.optim.AdamW, dict(lr=0.05, amsgrad=True)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=1, weight_decay=1, nesterov=True)),
    "adadelta": (torch.optim.Adadelta, dict(rho=0.95)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.05)),
    "adamax": (torch.optim.Adamax, dict(lr=0.05)),
    "rprop": (torch.optim.Rprop, dict(lr=0.05)),
}


def train_locally(optimizer_cls: Any, steps: int = 5, skip: int = 2, **kwargs: Any) -> list:
    """:func:`train`'s model and data with local parameters and the torch.optim class itself."""
    params = {name: make_param(i, shape) for i, (name, shape) in enumerate(SHAPES.items())}
    optimizer = optimizer_cls(list(params.values()), **kwargs)
    trace = []
    for t, (x, y) in enumerate(data(steps)):
        optimizer.zero_grad()
        hidden = x @ params["w1"] if t == skip else x @ params["w1"] + params["b1"]
        ((torch.tanh(hidden) @ params["w2"] - y) ** 2).mean().backward()
        optimizer.step()
        trace.append({n: p.detach().clone() for n, p in params.items()})
    return trace


def torch_test_configs(world_size: int) -> dict:
    """Each configuration of torch's own tests: ours, torch's DistributedOptimizer, and the
    torch.optim class stepping local parameters (the reference torch's tests use)."""
    return {
        name: dict(
            ours=train(cls, "ours", **kwargs), torch=train(cls, "torch", **kwargs), local=train_locally(cls, **kwargs)
        )
        for name, (cls, kwargs) in TORCH_TEST_CONFIGS.items()
    }


def frozen_parameters(world_size: int) -> dict:
    """A parameter that does not require grad, used in the forward on another worker: accepted
    (with a warning on the caller), never stepped; the others as torch's."""
    import warnings

    out = {}
    for name, cls, kwargs in (("sgd", torch.optim.SGD, dict(lr=0.05)), ("rmsprop", torch.optim.RMSprop, dict(lr=0.05))):
        trace = {}
        for which in ("ours", "torch"):
            w = rpc.remote("worker1", make_param, args=(0, (3, 2)))
            frozen = rpc.remote("worker2", make_param, args=(1, (3, 2), False))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer = (DistributedOptimizer if which == "ours" else TorchDistributedOptimizer)(
                    cls, [w, frozen], **kwargs
                )
            steps = []
            for x, _ in data(3):
                with dist_autograd.context() as context_id:
                    loss = (x @ (w.to_here() * frozen.to_here())).pow(2).sum()
                    dist_autograd.backward(context_id, [loss])
                    optimizer.step(context_id)
                steps.append(dict(w=w.to_here().clone(), frozen=frozen.to_here().clone()))
            trace[which] = dict(steps=steps, warnings=[str(c.message) for c in caught])
        out[name] = trace
    return out


def custom_class(world_size: int) -> dict:
    """A class without an alias runs itself; the same as torch's DistributedOptimizer with it."""
    return dict(ours=train(Scaled, "ours", lr=0.1), torch=train(Scaled, "torch", lr=0.1))


def concurrent_clients(world_size: int) -> dict:
    """Two threads step one DistributedOptimizer at once, 6 steps each, with gradients of ones:
    every step lands (serialized per worker)."""
    rrefs = remote_params()
    start = {n: r.to_here().detach().clone() for n, r in rrefs.items()}
    optimizer = DistributedOptimizer(torch.optim.SGD, list(rrefs.values()), lr=0.125)

    def client() -> None:
        for _ in range(6):
            with dist_autograd.context() as context_id:
                loss = sum(r.to_here().sum() for r in rrefs.values())
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return dict(start=start, end={n: r.to_here().detach().clone() for n, r in rrefs.items()})


class Failing(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    def step(self, closure: Any = None) -> None:
        raise RuntimeError("this optimizer fails on purpose")


def errors(world_size: int) -> dict:
    rrefs = remote_params()
    return errors_of(
        {
            "remote step error": lambda: _one_step(DistributedOptimizer(Failing, list(rrefs.values())), rrefs),
            "remote constructor error": lambda: DistributedOptimizer(torch.optim.SGD, list(rrefs.values()), lr=-1.0),
            "not an rref": lambda: DistributedOptimizer(torch.optim.SGD, [torch.ones(2, requires_grad=True)], lr=0.1),
        }
    )


def _one_step(optimizer: Any, rrefs: dict) -> None:
    with dist_autograd.context() as context_id:
        loss = sum(r.to_here().sum() for r in rrefs.values())
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
