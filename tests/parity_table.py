"""The parity table shared by test_torch_parity.py (every alias against torch.optim),
test_fusion.py (fused against unfused) and resume_cases.py (checkpoint resume): each alias with
its torch.optim class, model kind and hyperparameter settings, as pytest cases, the number of
steps, and the functional training loop (gradients by torch.func, pure updates)."""

from __future__ import annotations

import pytest
import torch
from models import loss_fn, make_model

import functional_bagua as fb

STEPS = 10

# (fb alias, torch optimizer, model kind, list of hyperparameter settings)
TABLE = [
    (
        fb.sgd,
        torch.optim.SGD,
        "shapes",
        [
            dict(lr=0.1),
            dict(lr=0.1, momentum=0.9),
            dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
            dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
            dict(lr=0.05, momentum=0.5, maximize=True),
        ],
    ),
    (
        fb.adam,
        torch.optim.Adam,
        "shapes",
        [
            dict(),
            dict(lr=1e-2, weight_decay=0.1),
            dict(lr=1e-2, amsgrad=True),
            dict(lr=1e-2, maximize=True, weight_decay=0.05),
            dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
        ],
    ),
    (
        fb.adamw,
        torch.optim.AdamW,
        "shapes",
        [
            dict(),
            dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
            dict(lr=1e-2, maximize=True),
        ],
    ),
    (
        fb.adamax,
        torch.optim.Adamax,
        "shapes",
        [
            dict(),
            dict(weight_decay=0.1, maximize=True),
        ],
    ),
    (
        fb.nadam,
        torch.optim.NAdam,
        "shapes",
        [
            dict(),
            dict(weight_decay=0.1),
            dict(weight_decay=0.1, decoupled_weight_decay=True),
            dict(momentum_decay=0.01, maximize=True),
        ],
    ),
    (
        fb.radam,
        torch.optim.RAdam,
        "shapes",
        [
            dict(),
            dict(lr=1e-2, weight_decay=0.1),
            dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
            dict(maximize=True),
        ],
    ),
    (
        fb.adagrad,
        torch.optim.Adagrad,
        "shapes",
        [
            dict(),
            dict(lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.1),
            dict(maximize=True),
        ],
    ),
    (
        fb.adadelta,
        torch.optim.Adadelta,
        "shapes",
        [
            dict(),
            dict(rho=0.8, weight_decay=0.1),
            dict(lr=0.5, maximize=True),
        ],
    ),
    (
        fb.rmsprop,
        torch.optim.RMSprop,
        "shapes",
        [
            dict(),
            dict(centered=True),
            dict(momentum=0.9),
            dict(centered=True, momentum=0.5, weight_decay=0.1),
            dict(maximize=True),
        ],
    ),
    (
        fb.rprop,
        torch.optim.Rprop,
        "shapes",
        [
            dict(),
            dict(etas=(0.3, 1.5), step_sizes=(1e-4, 0.1)),
            dict(maximize=True),
        ],
    ),
    (
        fb.asgd,
        torch.optim.ASGD,
        "shapes",
        [
            dict(),
            dict(lr=0.05, lambd=1e-2, t0=3, weight_decay=0.1),
            dict(maximize=True),
        ],
    ),
    (
        fb.adafactor,
        torch.optim.Adafactor,
        "shapes",
        [
            dict(),
            dict(weight_decay=0.1, d=2.0, beta2_decay=-0.5),
            dict(eps=(1e-30, 1e-2)),
            dict(maximize=True),
        ],
    ),
    (
        fb.muon,
        torch.optim.Muon,
        "matrix",
        [
            dict(),
            dict(lr=0.02, nesterov=False, momentum=0.9),
            dict(lr=0.02, adjust_lr_fn="match_rms_adamw", weight_decay=0.05),
        ],
    ),
]

CASES = [
    pytest.param(alias, torch_cls, kind, kwargs, id=f"{alias.__name__}-{i}")
    for alias, torch_cls, kind, settings in TABLE
    for i, kwargs in enumerate(settings)
]


def run_functional(tx, kind, dtype, data, none_grads=frozenset()):
    model = make_model(kind, dtype)
    params = fb.params_of(model)
    state = tx.init(params)

    def loss_of(p, x, y):
        return loss_fn(torch.func.functional_call(model, p, (x,)), y)

    for step, (x, y) in enumerate(data):
        grads = torch.func.grad(loss_of)(params, x, y)
        grads = {k: (None if (step, k) in none_grads else g) for k, g in grads.items()}
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
    return params, state
