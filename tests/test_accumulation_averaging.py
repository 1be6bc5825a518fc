"""Gradient accumulation (multi_steps), parameter EMA and lookahead, against torch and written-out rules."""

from __future__ import annotations

import pytest
import torch
from devices import seeded
from models import batches, default_dtype, loss_fn, make_model
from torch._dynamo.testing import CompileCounter

import functional_bagua as fb

DTYPE = torch.float64
K = 4


def grads_of(model):
    def loss_of(p, x, y):
        return loss_fn(torch.func.functional_call(model, p, (x,)), y)

    return torch.func.grad(loss_of)


def assert_close(actual, expected, tol=1e-12):
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


def detached(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# --- multi_steps ------------------------------------------------------------------------------


def test_multi_steps_equals_torch_gradient_accumulation():
    """k micro-batches per step == torch's ``(loss / k).backward()`` x k then ``opt.step()``, and the
    parameters stay put inside a window."""
    data = batches(3 * K, DTYPE)
    model = make_model("shapes", DTYPE)
    params = fb.params_of(model)
    tx = fb.multi_steps(fb.adamw(lr=1e-2, weight_decay=0.1), K)
    state = tx.init(params)

    reference = make_model("shapes", DTYPE)
    with default_dtype(DTYPE):
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for i, (x, y) in enumerate(data):
        updates, state = tx.update(grads_of(model)(params, x, y), state, params)
        params = fb.apply_updates(params, updates)
        (loss_fn(reference(x), y) / K).backward()
        if (i + 1) % K == 0:
            with default_dtype(DTYPE):
                opt.step()
            opt.zero_grad()
        assert_close(params, detached(reference))
        assert state.mini_step.item() == (i + 1) % K and state.gradient_step.item() == (i + 1) // K
    assert not torch.equal(params["fc.weight"], fb.params_of(make_model("shapes", DTYPE))["fc.weight"])


def test_multi_steps_equals_one_step_on_the_k_times_batch():
    micro = batches(K, DTYPE)
    model = make_model("shapes", DTYPE)
    params = fb.params_of(model)
    tx = fb.multi_steps(fb.adam(lr=1e-2), K)
    state = tx.init(params)
    for x, y in micro:
        updates, state = tx.update(grads_of(model)(params, x, y), state, params)
        params = fb.apply_updates(params, updates)

    big = make_model("shapes", DTYPE)
    with default_dtype(DTYPE):
        opt = torch.optim.Adam(big.parameters(), lr=1e-2)
        loss_fn(big(torch.cat([x for x, _ in micro])), torch.cat([y for _, y in micro])).backward()
        opt.step()
    assert_close(params, detached(big))


def test_multi_steps_sum_equals_torch_accumulation_without_division():
    model = make_model("shapes", DTYPE)
    params = fb.params_of(model)
    tx = fb.multi_steps(fb.sgd(lr=1e-2, momentum=0.9), 2, use_grad_mean=False)
    state = tx.init(params)
    reference = make_model("shapes", DTYPE)
    opt = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    for i, (x, y) in enumerate(batches(6, DTYPE)):
        updates, state = tx.update(grads_of(model)(params, x, y), state, params)
        params = fb.apply_updates(params, updates)
        loss_fn(reference(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    assert_close(params, detached(reference))


def test_multi_steps_accumulates_in_the_accumulator_dtype():
    """bf16 gradients summed in float32, the mean rounded to bf16 once, then the inner step."""
    gen = seeded(0)
    params = {"w": torch.randn(256, generator=gen).bfloat16()}
    micro_grads = [{"w": torch.randn(256, generator=gen).bfloat16()} for _ in range(8)]

    def accumulate(accumulator_dtype):
        tx = fb.multi_steps(fb.sgd(lr=0.5), 8, accumulator_dtype=accumulator_dtype)
        state = tx.init(params)
        new_params = params
        for g in micro_grads:
            updates, state = tx.update(g, state, new_params)
            new_params = fb.apply_updates(new_params, updates)
        return new_params["w"], state.acc_grads["w"].dtype

    in_float32, acc_dtype = accumulate(torch.float32)
    mean = (sum(g["w"].float() for g in micro_grads) / 8).bfloat16()
    sgd = fb.sgd(lr=0.5)
    expected = fb.apply_updates(params, sgd.update({"w": mean}, sgd.init(params), params)[0])["w"]
    assert acc_dtype == torch.float32 and in_float32.dtype == torch.bfloat16
    assert torch.equal(in_float32, expected)
    # the default accumulator is the parameter's dtype: bf16 rounds every partial sum
    in_bf16, acc_dtype = accumulate(None)
    assert acc_dtype == torch.bfloat16 and not torch.equal(in_bf16, in_float32)


def test_multi_steps_compiled_is_one_graph_and_equals_eager():
    gen = seeded(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    tx = fb.MultiSteps(fb.adam(lr=1e-2), 3)
    counter = CompileCounter()
    compiled = torch.compile(tx.update, backend=counter, fullgraph=True)
    state, eager_state, eager_params = tx.init(params), tx.init(params), dict(params)
    updated = []
    for _ in range(7):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        updates, state = compiled(grads, state, params)
        params = fb.apply_updates(params, updates)
        eager_updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = fb.apply_updates(eager_params, eager_updates)
        assert_close(params, eager_params, tol=0)
        updated.append(bool(fb.MultiSteps.has_updated(state)))
    assert counter.frame_count == 1
    assert updated == [False, False, True, False, False, True, False]
    assert torch.equal(state.acc_grads["w"], eager_state.acc_grads["w"])


def test_multi_steps_rejects_bad_arguments():
    with pytest.raises(ValueError, match="every_k_schedule must be an int >= 1, got 0"):
        fb.multi_steps(fb.sgd(), 0)
    with pytest.raises(TypeError, match="accumulator_dtype must be a floating point dtype"):
        fb.multi_steps(fb.sgd(), 2, accumulator_dtype=torch.int32)
    tx = fb.multi_steps(fb.sgd(), 2)
    state = tx.init({"w": torch.zeros(2), "b": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing from grads: 'b'"):
        tx.update({"w": torch.zeros(2)}, state)


# --- ema ----------------------------------------------------------------------------------------


def test_ema_equals_torch_averaged_model():
    decay = 0.8
    model = make_model("shapes", DTYPE)
    params = fb.params_of(model)
    tx = fb.chain(fb.sgd(lr=0.1, momentum=0.9), fb.ema(decay))
    state = tx.init(params)

    reference = make_model("shapes", DTYPE)
    averaged = torch.optim.swa_utils.AveragedModel(
        reference, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(decay)
    )
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(6, DTYPE):
        updates, state = tx.update(grads_of(model)(params, x, y), state, params)
        params = fb.apply_updates(params, updates)
        opt.zero_grad()
        loss_fn(reference(x), y).backward()
        opt.step()
        averaged.update_parameters(reference)
        assert_close(state[-1].ema, detached(averaged.module))
    assert_close(params, detached(reference))
    assert not torch.allclose(state[-1].ema["fc.weight"], params["fc.weight"])


def test_ema_decay_schedule_follows_the_written_rule():
    decay = lambda t: (1.0 + t) / (10.0 + t)  # noqa: E731  (a warmup of the decay, as in timm)
    gen = seeded(0)
    params = {"w": torch.randn(5, generator=gen, dtype=DTYPE)}
    tx = fb.ema(decay)
    state = tx.init(params)
    expected = None
    for t in range(5):
        updates = {"w": torch.randn(5, generator=gen, dtype=DTYPE)}
        _, state = tx.update(updates, state, params)
        params = fb.apply_updates(params, updates)
        d = (1.0 + t) / (10.0 + t)
        expected = params["w"].clone() if t == 0 else d * expected + (1 - d) * params["w"]
        torch.testing.assert_close(state.inner_state.ema["w"], expected, rtol=1e-14, atol=1e-14)


def test_ema_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"Invalid decay value 1.5 provided. Please provide a value in \[0,1\] range."):
        fb.ema(1.5)
    tx = fb.ema()
    with pytest.raises(ValueError, match="ema needs the parameters"):
        tx.update({"w": torch.zeros(1)}, tx.init({"w": torch.zeros(1)}))


# --- lookahead ---------------------------------------------------------------------------------


def test_lookahead_follows_the_written_rule_with_torch_adam_inside():
    """Reference: torch.optim.Adam moves the fast weights; every k steps
    ``slow += alpha * (fast - slow)`` and the fast weights restart from ``slow``."""
    k, alpha = 3, 0.6
    model = make_model("shapes", DTYPE)
    params = fb.params_of(model)
    tx = fb.lookahead(fb.adam(lr=1e-2), sync_period=k, alpha=alpha)
    state = tx.init(params)

    fast = make_model("shapes", DTYPE)
    slow = detached(fast)
    with default_dtype(DTYPE):
        opt = torch.optim.Adam(fast.parameters(), lr=1e-2)
    for t, (x, y) in enumerate(batches(2 * k + 2, DTYPE), start=1):
        updates, state = tx.update(grads_of(model)(params, x, y), state, params)
        params = fb.apply_updates(params, updates)
        opt.zero_grad()
        loss_fn(fast(x), y).backward()
        with default_dtype(DTYPE):
            opt.step()
        if t % k == 0:
            with torch.no_grad():
                for name, p in fast.named_parameters():
                    slow[name] += alpha * (p - slow[name])
                    p.copy_(slow[name])
        assert_close(params, detached(fast))
        assert_close(state.slow, slow)


def train_side_by_side(first, second, steps):
    """The final params of two transforms fed the same random gradients, and their states."""
    gen = seeded(0)
    params = {"w": torch.randn(4, 3, generator=gen, dtype=DTYPE)}
    runs = [[tx, params, tx.init(params)] for tx in (first, second)]
    for _ in range(steps):
        g = {"w": torch.randn(4, 3, generator=gen, dtype=DTYPE)}
        for run in runs:
            tx, p, s = run
            u, run[2] = tx.update(g, s, p)
            run[1] = fb.apply_updates(p, u)
    return [(p, s) for _, p, s in runs]


def test_lookahead_with_alpha_one_is_the_inner_optimizer():
    (inner, _), (wrapped, _) = train_side_by_side(
        fb.adam(lr=0.1), fb.lookahead(fb.adam(lr=0.1), sync_period=2, alpha=1.0), 6
    )
    torch.testing.assert_close(wrapped["w"], inner["w"], rtol=1e-14, atol=1e-14)


def test_lookahead_rejects_bad_arguments():
    with pytest.raises(ValueError, match="Invalid sync_period: 0"):
        fb.lookahead(fb.sgd(), sync_period=0)
    with pytest.raises(ValueError, match="Invalid alpha: 2.0"):
        fb.lookahead(fb.sgd(), alpha=2.0)
    with pytest.raises(TypeError, match="inner is function, not a GradientTransformation"):
        fb.lookahead(fb.sgd)


def test_lookahead_alpha_as_a_schedule_equals_the_constant():
    (fixed, _), (scheduled, state) = train_side_by_side(
        fb.lookahead(fb.sgd(lr=0.1, momentum=0.9), sync_period=2, alpha=0.6),
        fb.lookahead(fb.sgd(lr=0.1, momentum=0.9), sync_period=2, alpha=fb.schedules.constant(0.6)),
        5,
    )
    assert isinstance(state, fb.InjectHyperparamsState)
    torch.testing.assert_close(scheduled["w"], fixed["w"], rtol=1e-14, atol=1e-14)


def test_ema_inside_multi_steps_averages_once_per_window():
    gen = seeded(0)
    params = {"w": torch.randn(3, generator=gen, dtype=DTYPE)}
    tx = fb.multi_steps(fb.chain(fb.sgd(lr=0.1), fb.ema(0.5)), 3)
    state = tx.init(params)
    window_ends = []
    for t in range(1, 7):
        updates, state = tx.update({"w": torch.randn(3, generator=gen, dtype=DTYPE)}, state, params)
        params = fb.apply_updates(params, updates)
        if t % 3 == 0:
            window_ends.append(params["w"])
    assert state.inner_state[-1].count.item() == 2
    torch.testing.assert_close(
        state.inner_state[-1].ema["w"], 0.5 * window_ends[0] + 0.5 * window_ends[1], rtol=1e-14, atol=1e-14
    )
