"""Every alias minimises a simple quadratic ``f(p) = 1/2 sum_k ||p_k - c_k||^2``."""

from __future__ import annotations

import pytest
import torch
from devices import seeded

import functional_bagua as fb

STEPS = 300

# alias and arguments that make it converge within STEPS on this problem
CONVERGING = [
    (fb.sgd, dict(lr=0.1)),
    (fb.sgd, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (fb.adam, dict(lr=0.05)),
    (fb.adamw, dict(lr=0.05, weight_decay=1e-4)),
    (fb.adamax, dict(lr=0.05)),
    (fb.nadam, dict(lr=0.05)),
    (fb.radam, dict(lr=0.05)),
    (fb.adagrad, dict(lr=0.5)),
    (fb.adadelta, dict(lr=1.0, eps=1e-3)),
    (fb.rmsprop, dict(lr=0.01)),
    (fb.rprop, dict(lr=0.01)),
    (fb.asgd, dict(lr=0.1)),
    (fb.adafactor, dict(lr=0.1)),
    (fb.muon, dict(lr=0.05, weight_decay=0.0)),
    (fb.lamb, dict(lr=lambda t: 0.05 * 0.99**t)),  # a decaying schedule: LAMB oscillates at ~lr*||p||
    (fb.lars, dict(lr=5.0, trust_coefficient=0.02)),
    (fb.lion, dict(lr=0.03)),
    (fb.adabelief, dict(lr=0.05)),
]


def loss(params, targets):
    return sum(0.5 * (params[k] - targets[k]).pow(2).sum() for k in params)


@pytest.mark.parametrize("alias, kwargs", [pytest.param(a, kw, id=a.__name__) for a, kw in CONVERGING])
def test_minimises_quadratic(alias, kwargs):
    gen = seeded(0)
    if alias is fb.muon:  # 2-D parameters only
        shapes = {"a": (6, 4), "b": (3, 5)}
    elif alias is fb.lamb:  # a trust ratio ~ ||p|| all but stops a scalar from crossing zero
        shapes = {"a": (6, 4), "b": (5,)}
    else:
        shapes = {"a": (6, 4), "b": (5,), "c": ()}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    targets = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    tx = alias(**kwargs)
    state = tx.init(params)
    initial = loss(params, targets).item()
    for _ in range(STEPS):
        grads = torch.func.grad(loss)(params, targets)
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
    assert loss(params, targets).item() < 1e-2 * initial
