"""fb.lbfgs against torch.optim.LBFGS, step for step, on deterministic problems."""

from __future__ import annotations

import pytest
import torch
from devices import seeded

import functional_bagua as fb


def problem(dtype):
    """A smooth, non-quadratic loss of two parameters (so that curvature pairs and the line
    search's interpolation all matter)."""
    gen = seeded(0)
    a, b = torch.randn(20, 10, generator=gen, dtype=dtype), torch.randn(20, generator=gen, dtype=dtype)
    start = {"c": torch.randn(3, generator=gen, dtype=dtype), "w": torch.randn(10, generator=gen, dtype=dtype)}

    def loss_of(p):
        residual = a @ p["w"] - b
        return (
            (residual**2).mean()
            + 0.1 * torch.log1p(p["w"] ** 2).sum()
            + (p["c"] ** 4).sum()
            + (p["c"] @ p["w"][:3]) ** 2
        )

    return loss_of, start


SETTINGS = [
    dict(),
    dict(history_size=3, max_iter=7),
    dict(line_search_fn="strong_wolfe"),
    dict(line_search_fn="strong_wolfe", history_size=3, max_iter=7, lr=0.5),
]
# float32: bit for bit (the updates are float64, so p + u lands on torch's p exactly); float64:
# p + (x - p) can differ from x in its last place, and near the minimum later iterations magnify it
TOLERANCES = {torch.float32: dict(rtol=0, atol=0), torch.float64: dict(rtol=1e-9, atol=1e-10)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "settings", SETTINGS, ids=["fixed-step", "short-history", "strong-wolfe", "strong-wolfe-short"]
)
def test_lbfgs_equals_torch_lbfgs_step_for_step(settings, dtype):
    loss_of, start = problem(dtype)
    reference = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}  # sorted names: the tree's order
    optimizer = torch.optim.LBFGS(reference.values(), **settings)
    tx = fb.lbfgs(**settings)
    params = {k: v.clone() for k, v in start.items()}
    state = tx.init(params)

    def closure():
        optimizer.zero_grad()
        loss = loss_of(reference)
        loss.backward()
        return loss

    for _ in range(4):
        optimizer.step(closure)
        grads, value = torch.func.grad_and_value(loss_of)(params)
        updates, state = tx.update(grads, state, params, value_fn=loss_of, value=value)
        params = fb.apply_updates(params, updates)
        for k in params:
            torch.testing.assert_close(params[k], reference[k].detach(), **TOLERANCES[dtype])
        torch_state = optimizer.state[optimizer.param_groups[0]["params"][0]]
        assert (int(state.func_evals), int(state.n_iter)) == (torch_state["func_evals"], torch_state["n_iter"])
    assert loss_of(params) < 0.5 * loss_of(start)


def test_lbfgs_state_round_trips_through_a_checkpoint():
    loss_of, start = problem(torch.float64)
    tx = fb.lbfgs(history_size=5, max_iter=3)

    def run(params, state, steps):
        for _ in range(steps):
            grads, value = torch.func.grad_and_value(loss_of)(params)
            updates, state = tx.update(grads, state, params, value_fn=loss_of, value=value)
            params = fb.apply_updates(params, updates)
        return params, state

    straight, _ = run(start, tx.init(start), 4)
    halfway, state = run(start, tx.init(start), 2)
    resumed, _ = run(halfway, fb.load_state_dict(tx.init(start), fb.state_dict(state)), 2)
    assert all(torch.equal(straight[k], resumed[k]) for k in start)


def test_lbfgs_says_what_it_needs():
    params = {"w": torch.zeros(3)}
    tx = fb.lbfgs()
    with pytest.raises(ValueError, match=r"call update\(grads, state, params, value_fn=loss_of\)"):
        tx.update(params, tx.init(params), params)
    with pytest.raises(ValueError, match="line_search_fn must be one of"):
        fb.lbfgs(line_search_fn="backtracking")
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fb.lbfgs(lr=-1.0)
    with pytest.raises(ValueError, match="one \\(real\\) dtype and device"):
        tx.init({"w": torch.zeros(3), "v": torch.zeros(3, dtype=torch.float64)})
