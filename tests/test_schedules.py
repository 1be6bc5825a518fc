"""Schedules against their closed forms and torch.optim.lr_scheduler; hyperparameters as data."""

from __future__ import annotations

import math

import pytest
import torch
from devices import seeded
from torch._dynamo.testing import CompileCounter

import functional_bagua as fb
from functional_bagua import schedules as S

LR = 0.1
SCHED = torch.optim.lr_scheduler


def torch_sequence(make_scheduler, steps):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=LR)
    scheduler = make_scheduler(opt)
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    return torch.tensor(values, dtype=torch.float64)


def our_sequence(schedule, steps):
    return torch.stack([schedule(torch.tensor(t)) for t in range(steps)])


TORCH_EQUIVALENTS = [
    ("StepLR", lambda o: SCHED.StepLR(o, 7, 0.5), S.exponential_decay(LR, 7, 0.5, staircase=True), 40),
    (
        "MultiStepLR",
        lambda o: SCHED.MultiStepLR(o, [5, 12, 20], 0.3),
        S.piecewise_constant(LR, {5: 0.3, 12: 0.3, 20: 0.3}),
        30,
    ),
    ("ExponentialLR", lambda o: SCHED.ExponentialLR(o, 0.9), S.exponential_decay(LR, 1, 0.9), 30),
    # torch's cosine is periodic past T_max (it anneals back up); ours holds eta_min: compare to T_max
    ("CosineAnnealingLR", lambda o: SCHED.CosineAnnealingLR(o, 25, 1e-3), S.cosine_decay(LR, 25, alpha=1e-3 / LR), 26),
    ("LinearLR", lambda o: SCHED.LinearLR(o, 0.2, 0.9, 12), S.linear(LR * 0.2, LR * 0.9, 12), 30),
    ("PolynomialLR", lambda o: SCHED.PolynomialLR(o, 15, 2.0), S.polynomial(LR, 0.0, 2.0, 15), 30),
    ("OneCycleLR", lambda o: SCHED.OneCycleLR(o, 0.5, total_steps=30), S.one_cycle(30, 0.5), 30),
    (
        "OneCycleLR-3phase-linear",
        lambda o: SCHED.OneCycleLR(o, 0.5, total_steps=40, pct_start=0.25, anneal_strategy="linear", three_phase=True),
        S.one_cycle(40, 0.5, pct_start=0.25, anneal_strategy="linear", three_phase=True),
        40,
    ),
]


@pytest.mark.parametrize("make, schedule, steps", [pytest.param(m, s, n, id=i) for i, m, s, n in TORCH_EQUIVALENTS])
def test_schedule_matches_torch_lr_scheduler(make, schedule, steps):
    torch.testing.assert_close(our_sequence(schedule, steps), torch_sequence(make, steps), rtol=1e-12, atol=1e-15)


CLOSED_FORMS = [
    ("constant", S.constant(0.3), lambda t: 0.3),
    ("linear", S.linear(1.0, 0.1, 10, transition_begin=5), lambda t: 1.0 + (0.1 - 1.0) * min(max(t - 5, 0) / 10, 1)),
    ("polynomial", S.polynomial(1.0, 0.2, 3.0, 12), lambda t: 0.2 + 0.8 * (1 - min(t / 12, 1)) ** 3),
    (
        "cosine_decay",
        S.cosine_decay(2.0, 20, alpha=0.1, exponent=2.0),
        lambda t: 2.0 * (0.9 * (0.5 * (1 + math.cos(math.pi * min(t, 20) / 20))) ** 2 + 0.1),
    ),
    (
        "exponential_decay",
        S.exponential_decay(1.0, 4, 0.5, transition_begin=3, end_value=0.2),
        lambda t: max(1.0 * 0.5 ** (max(t - 3, 0) / 4), 0.2),
    ),
    (
        "piecewise_constant",
        S.piecewise_constant(1.0, {3: 0.5, 8: 0.1}),
        lambda t: 1.0 * (0.5 if t >= 3 else 1) * (0.1 if t >= 8 else 1),
    ),
    (
        "join_schedules",
        S.join_schedules([S.constant(1.0), S.linear(2.0, 0.0, 4)], [5]),
        lambda t: 1.0 if t < 5 else 2.0 - 2.0 * min((t - 5) / 4, 1),
    ),
    (
        "warmup_cosine_decay",
        S.warmup_cosine_decay(0.0, 1.0, 5, 25, end_value=0.1),
        lambda t: t / 5 if t < 5 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t - 5, 20) / 20)),
    ),
]


@pytest.mark.parametrize("schedule, formula", [pytest.param(s, f, id=i) for i, s, f in CLOSED_FORMS])
def test_schedule_equals_closed_form(schedule, formula):
    for t in range(35):
        assert schedule(t).item() == pytest.approx(formula(t), rel=1e-12, abs=1e-15), t
        assert schedule(torch.tensor(t)).dtype == torch.float64


def test_lr_schedule_in_an_alias_equals_torch_scheduler_steps():
    """fb.sgd(lr=schedule) == torch.optim.SGD + StepLR, step for step."""
    gen = seeded(0)
    start = torch.randn(5, dtype=torch.float64, generator=gen)
    grads = [torch.randn(5, dtype=torch.float64, generator=gen) for _ in range(12)]
    p = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([p], lr=LR, momentum=0.9)
    scheduler = SCHED.StepLR(opt, 3, 0.5)
    tx = fb.sgd(lr=S.exponential_decay(LR, 3, 0.5, staircase=True), momentum=0.9)
    params = {"p": start.clone()}
    state = tx.init(params)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        scheduler.step()
        updates, state = tx.update({"p": g}, state, params)
        params = fb.apply_updates(params, updates)
    torch.testing.assert_close(params["p"], p.detach(), rtol=1e-13, atol=1e-15)


def test_every_float_hyperparameter_accepts_a_schedule():
    params = {"w": torch.randn(3, 2, dtype=torch.float64)}
    grads = {"w": torch.randn(3, 2, dtype=torch.float64)}
    scheduled = fb.adam(
        lr=S.constant(1e-2), betas=(S.constant(0.8), 0.99), eps=S.constant(1e-6), weight_decay=S.constant(0.1)
    )
    fixed = fb.adam(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    s1, s2 = scheduled.init(params), fixed.init(params)
    assert isinstance(s1, fb.InjectHyperparamsState)
    for _ in range(3):
        u1, s1 = scheduled.update(grads, s1, params)
        u2, s2 = fixed.update(grads, s2, params)
        torch.testing.assert_close(u1["w"], u2["w"], rtol=1e-14, atol=0)


def test_injected_hyperparameters_are_readable_and_writable():
    params = {"w": torch.ones(4, dtype=torch.float64)}
    grads = {"w": torch.ones(4, dtype=torch.float64)}
    tx = fb.inject_hyperparams(fb.sgd)(lr=0.1, momentum=0.0)
    state = tx.init(params)
    assert state.hyperparams["lr"].dtype == torch.float64 and state.hyperparams["lr"].item() == pytest.approx(0.1)
    updates, state = tx.update(grads, state, params)
    torch.testing.assert_close(updates["w"], torch.full((4,), -0.1, dtype=torch.float64))
    state.hyperparams["lr"].fill_(0.5)
    updates, state = tx.update(grads, state, params)
    torch.testing.assert_close(updates["w"], torch.full((4,), -0.5, dtype=torch.float64))
    state.hyperparams["lr"] = 0.25  # a plain number works too
    updates, state = tx.update(grads, state, params)
    torch.testing.assert_close(updates["w"], torch.full((4,), -0.25, dtype=torch.float64))


def test_held_values_are_read_as_numbers_only_where_the_state_keeps_its_structure():
    """Eagerly, inject_hyperparams builds its factory with the values it holds read as Python
    numbers, except where the transform so built makes a state of another structure: SGD at
    the number momentum 0 keeps no momentum buffer, so a held 0 stays a tensor and the buffer
    is kept; set to 0.9 later, the steps use it: ``b = 0.9 b + g``, ``u = -lr b``, written out."""
    gen = seeded(16)
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    grads = [torch.randn(3, generator=gen, dtype=torch.float64) for _ in range(5)]
    tx = fb.inject_hyperparams(fb.sgd)(lr=0.1, momentum=0.0)
    state = tx.init(params)
    buffer = torch.zeros(3, dtype=torch.float64)
    for t, g in enumerate(grads):
        momentum = 0.9 if t >= 2 else 0.0
        state.hyperparams["momentum"].fill_(momentum)
        updates, state = tx.update({"w": g}, state, params)
        buffer = momentum * buffer + g
        torch.testing.assert_close(updates["w"], -0.1 * buffer, rtol=1e-15, atol=0)
    assert not torch.equal(buffer, grads[-1])  # the buffer carried the earlier gradients


def _sgd_with_held_lr():
    gen = seeded(17)
    params = {"w": torch.randn(4, generator=gen, dtype=torch.float64)}
    grads = {"w": torch.randn(4, generator=gen, dtype=torch.float64)}
    tx = fb.inject_hyperparams(fb.sgd)(lr=0.1)
    return tx, tx.init(params), params, grads


def test_a_held_hyperparameter_differentiated_through_is_not_read_as_a_number():
    """Eagerly a held value is read as a Python number, but not where it is differentiated
    through: autograd recording it, torch.func's grad and vmap over it. There the update keeps
    it as a tensor: ``d/dlr sum(-lr g) = -sum(g)``, and vmap's updates ``-lr_i g``."""
    tx, state, params, grads = _sgd_with_held_lr()
    expected = -grads["w"].sum()

    lr = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    updates, _ = tx.update(grads, state._replace(hyperparams={"lr": lr}), params)
    updates["w"].sum().backward()
    torch.testing.assert_close(lr.grad, expected, rtol=1e-15, atol=0)

    def total(rate):
        return tx.update(grads, state._replace(hyperparams={"lr": rate}), params)[0]["w"].sum()

    got = torch.func.grad(total)(torch.tensor(0.1, dtype=torch.float64))
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=0)

    rates = torch.tensor([0.1, 0.5], dtype=torch.float64)
    batched = torch.vmap(lambda rate: tx.update(grads, state._replace(hyperparams={"lr": rate}), params)[0]["w"])(rates)
    torch.testing.assert_close(batched, -rates[:, None] * grads["w"], rtol=1e-15, atol=0)


def test_a_held_value_changed_reaches_the_transform_built_with_numbers():
    """The transform built with the held numbers is kept while they stay the same; a value
    written in place (as a scheduler does) builds it anew: ``u = -lr g`` with each new lr."""
    tx, state, params, grads = _sgd_with_held_lr()
    for lr in (0.1, 0.1, 0.5, 0.25, 0.25):
        state.hyperparams["lr"].fill_(lr)
        updates, state = tx.update(grads, state, params)
        torch.testing.assert_close(updates["w"], -lr * grads["w"], rtol=1e-15, atol=0)


def test_inject_hyperparams_validates_initial_values():
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        fb.inject_hyperparams(fb.adam)(lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):
        fb.adam(betas=(0.9, S.constant(1.5)))


def _compiled_training(tx, steps, change_lr_by_hand=False):
    gen = seeded(0)
    params = {
        "w": torch.randn(4, 3, generator=gen),
        "b": torch.randn(3, generator=gen),
        "s": torch.randn((), generator=gen),
    }
    eager_params = dict(params)
    counter = CompileCounter()
    compiled = torch.compile(tx.update, backend=counter, fullgraph=True)
    state, eager_state = tx.init(params), tx.init(params)
    lrs = []
    for step in range(steps):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        if change_lr_by_hand:
            state.hyperparams["lr"].fill_(1e-3 * (1 + step))
            eager_state.hyperparams["lr"].fill_(1e-3 * (1 + step))
        updates, state = compiled(grads, state, params)
        params = fb.apply_updates(params, updates)
        eager_updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = fb.apply_updates(eager_params, eager_updates)
        lrs.append(state.hyperparams["lr"].item())
    for k in params:
        torch.testing.assert_close(params[k], eager_params[k], rtol=1e-6, atol=1e-7)
    return counter.frame_count, lrs


def test_scheduled_lr_compiles_exactly_once():
    schedule = S.warmup_cosine_decay(0.0, 1e-2, 10, 50)
    tx = fb.inject_hyperparams(fb.adamw)(lr=schedule, weight_decay=0.1)
    frames, lrs = _compiled_training(tx, 50)
    assert frames == 1
    assert all(a != b for a, b in zip(lrs, lrs[1:]))  # the lr really changed every step
    assert lrs == pytest.approx([schedule(t).item() for t in range(50)], rel=1e-12, abs=1e-15)


def test_lr_changed_by_hand_compiles_exactly_once():
    frames, lrs = _compiled_training(fb.inject_hyperparams(fb.adamw)(lr=1e-3), 20, change_lr_by_hand=True)
    assert frames == 1
    assert lrs == pytest.approx([1e-3 * (1 + s) for s in range(20)])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_scheduled_hyperparameter_set_by_hand_takes_effect_and_stays(compiled):
    """fill_ on a scheduled lr: the next updates use that value (the schedule no longer drives
    it), eagerly and in a compiled update; untouched, the schedule drives it. Reference: SGD's
    update written out, u = -lr * g."""
    schedule = fb.schedules.linear(0.1, 0.0, 10)
    tx = fb.sgd(lr=schedule)
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    state = tx.init(params)
    update = torch.compile(tx.update, fullgraph=True, backend="eager") if compiled else tx.update
    g = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)}
    for t in range(3):
        u, state = update(g, state, params)
        torch.testing.assert_close(u["w"], -float(schedule(torch.tensor(float(t), dtype=torch.float64))) * g["w"])
    state.hyperparams["lr"].fill_(0.5)
    for _ in range(2):
        u, state = update(g, state, params)
        torch.testing.assert_close(u["w"], -0.5 * g["w"])
    assert float(state.hyperparams["lr"]) == 0.5


def test_one_static_argument_given_as_a_string_is_one_name():
    """inject_hyperparams(fb.lookahead, static_args="inner") passes the inner transform as it is
    (a string is one name, not its letters), as the tuple form does."""
    params, grads = {"w": torch.ones(3)}, {"w": torch.full((3,), 0.5)}
    runs = []
    for static in ("inner", ("inner",)):
        tx = fb.inject_hyperparams(fb.lookahead, static_args=static)(fb.adamw(1e-2), sync_period=2, alpha=0.5)
        state = tx.init(params)
        updates, _ = tx.update(grads, state, params)
        runs.append(updates["w"])
    assert torch.equal(runs[0], runs[1])
