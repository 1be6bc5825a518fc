"""Every torch.optim alias against torch.optim itself, step for step.

One parameterised table (as optax's alias tests): alias x hyperparameter settings x dtype, ten
steps of a small network with a 4-D conv kernel, biases, a matrix and a 0-dim parameter, fresh
random data each step. The functional side computes gradients with torch.func and applies pure
updates; the reference is torch.optim's default (for-loop) implementation on an identical copy.
"""

from __future__ import annotations

import pytest
import torch

import functional_bagua as fb
from models import batches, default_dtype, loss_fn, make_model

STEPS = 10
TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}

# (fb alias, torch optimizer, model kind, list of hyperparameter settings)
TABLE = [
    (fb.sgd, torch.optim.SGD, "shapes", [
        dict(lr=0.1),
        dict(lr=0.1, momentum=0.9),
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        dict(lr=0.05, momentum=0.5, maximize=True),
    ]),
    (fb.adam, torch.optim.Adam, "shapes", [
        dict(),
        dict(lr=1e-2, weight_decay=0.1),
        dict(lr=1e-2, amsgrad=True),
        dict(lr=1e-2, maximize=True, weight_decay=0.05),
        dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    ]),
    (fb.adamw, torch.optim.AdamW, "shapes", [
        dict(),
        dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
        dict(lr=1e-2, maximize=True),
    ]),
    (fb.adamax, torch.optim.Adamax, "shapes", [
        dict(),
        dict(weight_decay=0.1, maximize=True),
    ]),
    (fb.nadam, torch.optim.NAdam, "shapes", [
        dict(),
        dict(weight_decay=0.1),
        dict(weight_decay=0.1, decoupled_weight_decay=True),
        dict(momentum_decay=0.01, maximize=True),
    ]),
    (fb.radam, torch.optim.RAdam, "shapes", [
        dict(),
        dict(lr=1e-2, weight_decay=0.1),
        dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
        dict(maximize=True),
    ]),
    (fb.adagrad, torch.optim.Adagrad, "shapes", [
        dict(),
        dict(lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.1),
        dict(maximize=True),
    ]),
    (fb.adadelta, torch.optim.Adadelta, "shapes", [
        dict(),
        dict(rho=0.8, weight_decay=0.1),
        dict(lr=0.5, maximize=True),
    ]),
    (fb.rmsprop, torch.optim.RMSprop, "shapes", [
        dict(),
        dict(centered=True),
        dict(momentum=0.9),
        dict(centered=True, momentum=0.5, weight_decay=0.1),
        dict(maximize=True),
    ]),
    (fb.rprop, torch.optim.Rprop, "shapes", [
        dict(),
        dict(etas=(0.3, 1.5), step_sizes=(1e-4, 0.1)),
        dict(maximize=True),
    ]),
    (fb.asgd, torch.optim.ASGD, "shapes", [
        dict(),
        dict(lr=0.05, lambd=1e-2, t0=3, weight_decay=0.1),
        dict(maximize=True),
    ]),
    (fb.adafactor, torch.optim.Adafactor, "shapes", [
        dict(),
        dict(weight_decay=0.1, d=2.0, beta2_decay=-0.5),
        dict(eps=(1e-30, 1e-2)),
        dict(maximize=True),
    ]),
    (fb.muon, torch.optim.Muon, "matrix", [
        dict(),
        dict(lr=0.02, nesterov=False, momentum=0.9),
        dict(lr=0.02, adjust_lr_fn="match_rms_adamw", weight_decay=0.05),
    ]),
]

CASES = [
    pytest.param(alias, torch_cls, kind, kwargs, id=f"{alias.__name__}-{i}")
    for alias, torch_cls, kind, settings in TABLE
    for i, kwargs in enumerate(settings)
]


def run_torch(torch_cls, kind, kwargs, dtype, data, none_grads=frozenset()):
    """Train with torch.optim; ``none_grads`` holds (step, name) pairs whose grad is set to None."""
    model = make_model(kind, dtype)
    with default_dtype(dtype):
        opt = torch_cls(model.parameters(), **kwargs)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            for name, p in model.named_parameters():
                if (step, name) in none_grads:
                    p.grad = None
            opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


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


def assert_params_close(actual, expected, dtype):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("alias, torch_cls, kind, kwargs", CASES)
def test_matches_torch_optim(alias, torch_cls, kind, kwargs, dtype):
    data = batches(STEPS, dtype)
    expected = run_torch(torch_cls, kind, kwargs, dtype, data)
    actual, _ = run_functional(alias(**kwargs), kind, dtype, data)
    initial = fb.params_of(make_model(kind, dtype))
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "reference did not move"
    assert_params_close(actual, expected, dtype)


@pytest.mark.parametrize(
    "alias, torch_cls, kind", [pytest.param(a, t, k, id=a.__name__) for a, t, k, _ in TABLE]
)
def test_none_gradient_skips_parameter_like_torch(alias, torch_cls, kind):
    """A None gradient leaves its parameter and its state (step count included) untouched, as
    torch.optim skips a parameter whose .grad is None; its later steps use its own count."""
    dtype = torch.float64
    data = batches(STEPS, dtype)
    skipped = "up.weight" if kind == "matrix" else "fc.bias"
    none_grads = frozenset({(2, skipped), (3, skipped), (7, skipped)})
    expected = run_torch(torch_cls, kind, {}, dtype, data, none_grads)
    actual, _ = run_functional(alias(), kind, dtype, data, none_grads)
    assert_params_close(actual, expected, dtype)
