"""Every torch.optim alias against torch.optim itself, step for step.

One parameterised table (as optax's alias tests): alias x hyperparameter settings x dtype, ten
steps of a small network with a 4-D conv kernel, biases, a matrix and a 0-dim parameter, fresh
random data each step. The functional side computes gradients with torch.func and applies pure
updates; the reference is torch.optim's default (for-loop) implementation on an identical copy.
"""

from __future__ import annotations

import pytest
import torch
from devices import ON_CUDA
from models import batches, default_dtype, loss_fn, make_model
from parity_table import CASES, STEPS, TABLE, run_functional

import functional_bagua as fb

TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}
if ON_CUDA:  # torch.optim's CUDA default is its foreach kernels, whose float32 rounding differs more
    TOLERANCES[torch.float32] = dict(rtol=1e-4, atol=1e-5)


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


# Muon's Newton-Schulz runs in bfloat16: torch applies its result as p + (-lr * factor) * u in one
# rounding, the alias as a chain of scalings and an add, and on CUDA such last-bit differences of
# float32 parameters change which way later gradients round to bfloat16 (one bfloat16 step of the
# update: up to 3e-4 after ten steps on an H200; float64 parameters and the CPU stay within TOLERANCES)
BF16_ITERATION = dict(rtol=1e-2, atol=1e-3)


def assert_params_close(actual, expected, dtype, tolerance=None):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        tol = tolerance or TOLERANCES[dtype]
        torch.testing.assert_close(actual[name], expected[name], **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("alias, torch_cls, kind, kwargs", CASES)
def test_matches_torch_optim(alias, torch_cls, kind, kwargs, dtype):
    data = batches(STEPS, dtype)
    expected = run_torch(torch_cls, kind, kwargs, dtype, data)
    actual, _ = run_functional(alias(**kwargs), kind, dtype, data)
    initial = fb.params_of(make_model(kind, dtype))
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "reference did not move"
    bf16_iteration = ON_CUDA and alias is fb.muon and dtype == torch.float32
    assert_params_close(actual, expected, dtype, BF16_ITERATION if bf16_iteration else None)


@pytest.mark.parametrize("alias, torch_cls, kind", [pytest.param(a, t, k, id=a.__name__) for a, t, k, _ in TABLE])
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
