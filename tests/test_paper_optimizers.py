"""Optimizers torch.optim lacks (LAMB, LARS, Lion, AdaBelief) against their update rules, written
out here independently: plain per-tensor loops in float64, no functional_bagua code."""

from __future__ import annotations

import math

import pytest
import torch
from devices import seeded

import functional_bagua as fb

SHAPES = {"scalar": (), "bias": (5,), "matrix": (5, 4), "kernel": (3, 2, 3, 3)}
STEPS = 10


def random_problem(seed=0, dtype=torch.float64):
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def run_functional(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = fb.apply_updates(params, updates)
    return params


def run_reference(step_fn, init_fn, params, grads):
    params = {k: v.clone() for k, v in params.items()}
    state = {k: init_fn(v) for k, v in params.items()}
    for t, g in enumerate(grads, start=1):
        for k in params:
            params[k], state[k] = step_fn(params[k], g[k], state[k], t)
    return params


def lamb_reference(lr, b1, b2, eps, wd, maximize=False):
    def init(p):
        return (torch.zeros_like(p), torch.zeros_like(p))

    def step(p, g, s, t):
        g = -g if maximize else g
        m = b1 * s[0] + (1 - b1) * g
        v = b2 * s[1] + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        r = m_hat / (torch.sqrt(v_hat) + eps) + wd * p
        p_norm, r_norm = torch.linalg.vector_norm(p).item(), torch.linalg.vector_norm(r).item()
        ratio = p_norm / r_norm if p_norm > 0 and r_norm > 0 else 1.0
        return p - lr * ratio * r, (m, v)

    return init, step


def lars_reference(lr, momentum, wd, tc, eps, nesterov, maximize=False):
    def init(p):
        return torch.zeros_like(p)

    def step(p, g, buf, t):
        g = -g if maximize else g
        r = g + wd * p
        p_norm, r_norm = torch.linalg.vector_norm(p).item(), torch.linalg.vector_norm(r).item()
        ratio = tc * p_norm / (r_norm + eps) if p_norm > 0 and r_norm > 0 else 1.0
        d = lr * ratio * r
        buf = d if t == 1 else momentum * buf + d
        return p - (d + momentum * buf if nesterov else buf), buf

    return init, step


def lion_reference(lr, b1, b2, wd, maximize=False):
    def init(p):
        return torch.zeros_like(p)

    def step(p, g, m, t):
        g = -g if maximize else g
        c = b1 * m + (1 - b1) * g
        return p - lr * (torch.sign(c) + wd * p), b2 * m + (1 - b2) * g

    return init, step


def adabelief_reference(lr, b1, b2, eps, wd, decoupled, maximize=False):
    def init(p):
        return (torch.zeros_like(p), torch.zeros_like(p))

    def step(p, g, s, t):
        g = -g if maximize else g
        if not decoupled:
            g = g + wd * p
        m = b1 * s[0] + (1 - b1) * g
        belief = b2 * s[1] + (1 - b2) * (g - m) ** 2 + eps
        m_hat, s_hat = m / (1 - b1**t), belief / (1 - b2**t)
        u = m_hat / (torch.sqrt(s_hat) + eps)
        if decoupled:
            u = u + wd * p
        return p - lr * u, (m, belief)

    return init, step


CASES = [
    ("lamb", fb.lamb(), lamb_reference(1e-3, 0.9, 0.999, 1e-6, 0.0)),
    (
        "lamb-wd",
        fb.lamb(lr=1e-2, betas=(0.8, 0.99), eps=1e-4, weight_decay=0.1),
        lamb_reference(1e-2, 0.8, 0.99, 1e-4, 0.1),
    ),
    ("lamb-max", fb.lamb(maximize=True, weight_decay=0.01), lamb_reference(1e-3, 0.9, 0.999, 1e-6, 0.01, True)),
    ("lars", fb.lars(), lars_reference(0.1, 0.9, 0.0, 1e-3, 0.0, False)),
    (
        "lars-wd-nesterov",
        fb.lars(lr=0.5, momentum=0.8, weight_decay=0.1, trust_coefficient=0.02, eps=1e-3, nesterov=True),
        lars_reference(0.5, 0.8, 0.1, 0.02, 1e-3, True),
    ),
    ("lars-max", fb.lars(maximize=True), lars_reference(0.1, 0.9, 0.0, 1e-3, 0.0, False, True)),
    ("lion", fb.lion(), lion_reference(1e-4, 0.9, 0.99, 0.0)),
    ("lion-wd", fb.lion(lr=1e-2, betas=(0.95, 0.98), weight_decay=0.1), lion_reference(1e-2, 0.95, 0.98, 0.1)),
    ("lion-max", fb.lion(maximize=True), lion_reference(1e-4, 0.9, 0.99, 0.0, True)),
    ("adabelief", fb.adabelief(), adabelief_reference(1e-3, 0.9, 0.999, 1e-16, 0.0, False)),
    (
        "adabelief-l2",
        fb.adabelief(lr=1e-2, weight_decay=0.1, eps=1e-8),
        adabelief_reference(1e-2, 0.9, 0.999, 1e-8, 0.1, False),
    ),
    (
        "adabelief-decoupled",
        fb.adabelief(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
        adabelief_reference(1e-2, 0.9, 0.999, 1e-16, 0.1, True),
    ),
    ("adabelief-max", fb.adabelief(maximize=True), adabelief_reference(1e-3, 0.9, 0.999, 1e-16, 0.0, False, True)),
]


@pytest.mark.parametrize("tx, reference", [pytest.param(tx, ref, id=name) for name, tx, ref in CASES])
def test_matches_written_out_update_rule(tx, reference):
    params, grads = random_problem()
    expected = run_reference(reference[1], reference[0], params, grads)
    actual = run_functional(tx, params, grads)
    for k in SHAPES:
        torch.testing.assert_close(actual[k], expected[k], rtol=1e-12, atol=1e-12, msg=lambda m: f"{k}: {m}")
        assert not torch.equal(actual[k], params[k])


def test_trust_ratio_is_one_for_zero_parameters():
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    grads = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)}
    tx = fb.lamb(lr=0.1)
    updates, _ = tx.update(grads, tx.init(params), params)
    adam = fb.adam(lr=0.1, eps=1e-6)  # LAMB's default eps
    adam_updates, _ = adam.update(grads, adam.init(params), params)
    torch.testing.assert_close(updates["w"], adam_updates["w"], rtol=1e-12, atol=0)
    assert math.isfinite(updates["w"].abs().max().item())
