"""Shared by test_checkpoint.py and its fresh-process worker: the cases, the data, the loop."""

from __future__ import annotations

import torch
from models import batches, loss_fn, make_model
from parity_table import CASES

import functional_bagua as fb
from functional_bagua import schedules

FIRST_STEPS, MORE_STEPS = 4, 3
DTYPE = torch.float64


def all_cases():
    """(id, transform factory, model kind): every alias setting of the parity table, plus
    injected hyperparameters with schedules."""
    cases = [(c.id, (lambda a=c.values[0], kw=c.values[3]: a(**kw)), c.values[2]) for c in CASES]
    cases.append(
        (
            "inject-warmup-cosine",
            lambda: fb.inject_hyperparams(fb.adamw)(
                lr=schedules.warmup_cosine_decay(0.0, 1e-2, 3, 10),
                betas=(0.9, schedules.linear(0.9, 0.99, 5)),
                weight_decay=0.1,
            ),
            "shapes",
        )
    )
    cases.append(("lamb", lambda: fb.lamb(lr=1e-2, weight_decay=0.1), "shapes"))
    cases.append(("lars", lambda: fb.lars(nesterov=True), "shapes"))
    cases.append(("lion", lambda: fb.lion(lr=1e-2), "shapes"))
    cases.append(("adabelief", lambda: fb.adabelief(lr=1e-2), "shapes"))
    return cases


def train(tx, kind, params, state, data):
    model = make_model(kind, DTYPE)

    def loss_of(p, x, y):
        return loss_fn(torch.func.functional_call(model, p, (x,)), y)

    for x, y in data:
        grads = torch.func.grad(loss_of)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
    return params, state


def initial_params(kind):
    return fb.params_of(make_model(kind, DTYPE))


def data():
    return batches(FIRST_STEPS + MORE_STEPS, DTYPE)
