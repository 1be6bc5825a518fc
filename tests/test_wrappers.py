"""Parameter groups, masks, freezing, clipping and skipping non-finite steps."""

from __future__ import annotations

import pytest
import torch
from devices import seeded
from helpers import assert_trees_equal, clone_tree
from models import batches, default_dtype, loss_fn, make_model

import functional_bagua as fb

DTYPE = torch.float64


def train_functional(tx, steps=8):
    model = make_model("shapes", DTYPE)
    params = fb.params_of(model)
    state = tx.init(params)

    def loss_of(p, x, y):
        return loss_fn(torch.func.functional_call(model, p, (x,)), y)

    for x, y in batches(steps, DTYPE):
        grads = torch.func.grad(loss_of)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
    return params, state


def train_torch(make_groups, optimizer_cls, steps=8, clip_norm=None):
    model = make_model("shapes", DTYPE)
    with default_dtype(DTYPE):
        opt = optimizer_cls(make_groups(model))
        for x, y in batches(steps, DTYPE):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def assert_close(actual, expected):
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=1e-12, atol=1e-12, msg=lambda m: f"{k}: {m}")


def is_matrix(params):
    return {k: v.dim() > 1 for k, v in params.items()}


def test_partition_equals_torch_param_groups():
    """Two groups with different lr and weight_decay == torch.optim.AdamW with two param_groups."""
    labels = lambda p: {k: ("weights" if v.dim() > 1 else "rest") for k, v in p.items()}  # noqa: E731
    tx = fb.partition(
        {"weights": fb.adamw(lr=1e-2, weight_decay=0.1), "rest": fb.adamw(lr=3e-3, weight_decay=0.0)}, labels
    )
    actual, state = train_functional(tx)
    expected = train_torch(
        lambda m: [
            {"params": [p for p in m.parameters() if p.dim() > 1], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [p for p in m.parameters() if p.dim() <= 1], "lr": 3e-3, "weight_decay": 0.0},
        ],
        torch.optim.AdamW,
    )
    assert_close(actual, expected)
    assert state.inner_states["weights"][1].mu["fc.bias"] is None  # no state outside the group


def test_masked_weight_decay_equals_torch_groups_without_decay_on_biases():
    tx = fb.chain(
        fb.scale_by_adam(), fb.masked(fb.add_decayed_weights(0.1), is_matrix), fb.scale_by_learning_rate(1e-2)
    )
    actual, _ = train_functional(tx)
    expected = train_torch(
        lambda m: [
            {"params": [p for p in m.parameters() if p.dim() > 1], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [p for p in m.parameters() if p.dim() <= 1], "lr": 1e-2, "weight_decay": 0.0},
        ],
        lambda groups: torch.optim.AdamW(groups),
    )
    assert_close(actual, expected)


def test_freeze_does_no_work_for_frozen_leaves():
    frozen = {"conv.weight": True, "conv.bias": False, "fc.weight": True, "fc.bias": False, "scale": False}
    tx = fb.chain(fb.freeze(frozen), fb.adam(lr=1e-2))
    start = fb.params_of(make_model("shapes", DTYPE))
    actual, state = train_functional(tx)
    expected = train_torch(
        lambda m: [p for n, p in m.named_parameters() if not frozen[n]], lambda g: torch.optim.Adam(g, lr=1e-2)
    )
    for name, is_frozen in frozen.items():
        if is_frozen:
            assert torch.equal(actual[name], start[name])
            assert state[1][2].count[name].item() == 0  # never stepped: its state untouched
            assert not state[1][2].mu[name].any()
        else:
            torch.testing.assert_close(actual[name], expected[name], rtol=1e-12, atol=1e-12)


def test_partition_with_set_to_zero_keeps_no_state_for_frozen_leaves():
    labels = {
        "conv.weight": "frozen",
        "conv.bias": "train",
        "fc.weight": "frozen",
        "fc.bias": "train",
        "scale": "train",
    }
    tx = fb.partition({"train": fb.adam(lr=1e-2), "frozen": fb.set_to_zero()}, labels)
    start = fb.params_of(make_model("shapes", DTYPE))
    actual, state = train_functional(tx)
    assert torch.equal(actual["fc.weight"], start["fc.weight"])
    assert state.inner_states["train"][2].mu["fc.weight"] is None
    assert not torch.equal(actual["fc.bias"], start["fc.bias"])


def test_partition_names_unknown_labels():
    with pytest.raises(ValueError, match=r"labels without a transform: \['typo'\]"):
        fb.partition({"a": fb.sgd()}, {"w": "typo"}).init({"w": torch.zeros(1)})


def test_clip_by_global_norm_equals_clip_grad_norm():
    actual, _ = train_functional(fb.chain(fb.clip_by_global_norm(0.05), fb.sgd(lr=0.1, momentum=0.9)))
    expected = train_torch(lambda m: m.parameters(), lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9), clip_norm=0.05)
    assert_close(actual, expected)


def test_clip_by_global_norm_directly_against_clip_grad_norm():
    gen = seeded(3)
    grads = {
        "a": torch.randn(4, 5, generator=gen, dtype=DTYPE),
        "b": torch.randn(3, generator=gen, dtype=DTYPE),
        "c": None,
    }
    tensors = [torch.nn.Parameter(torch.zeros_like(grads[k])) for k in ("a", "b")]
    for t, k in zip(tensors, ("a", "b")):
        t.grad = grads[k].clone()
    total = torch.nn.utils.clip_grad_norm_(tensors, 1.0)
    tx = fb.clip_by_global_norm(1.0)
    clipped, _ = tx.update(grads, tx.init(grads), None)
    assert total > 1.0
    torch.testing.assert_close(clipped["a"], tensors[0].grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(clipped["b"], tensors[1].grad, rtol=1e-14, atol=0)
    assert clipped["c"] is None


def test_clip_clamps_elementwise():
    g = {"x": torch.tensor([-3.0, -0.5, 0.2, 4.0])}
    tx = fb.clip(1.0)
    u, _ = tx.update(g, tx.init(g))
    assert torch.equal(u["x"], torch.tensor([-1.0, -0.5, 0.2, 1.0]))


def test_apply_if_finite_skips_non_finite_steps_bitwise():
    gen = seeded(0)
    params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    tx = fb.apply_if_finite(fb.adam(lr=1e-2), max_consecutive_errors=2)
    state = tx.init(params)
    good = lambda: {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}  # noqa: E731
    updates, state = tx.update(good(), state, params)
    params = fb.apply_updates(params, updates)

    bad = good()
    bad["b"][1] = float("nan")
    before = clone_tree((params, state.inner_state))
    updates, state = tx.update(bad, state, params)
    new_params = fb.apply_updates(params, updates)
    assert_trees_equal((new_params, state.inner_state), before)
    assert (state.notfinite_count.item(), state.total_notfinite.item(), state.last_finite.item()) == (1, 1, False)

    bad["w"][0, 0] = float("inf")
    updates, state = tx.update(bad, state, new_params)
    assert state.notfinite_count.item() == 2 and all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    updates, state = tx.update(bad, state, new_params)  # third in a row > max_consecutive_errors: applied
    assert not torch.isfinite(updates["b"]).all()
    assert (state.notfinite_count.item(), state.total_notfinite.item()) == (0, 3)

    plain = fb.adam(lr=1e-2)
    g = good()
    ours, state = tx.update(g, tx.init(params), params)
    ref, _ = plain.update(g, plain.init(params), params)
    assert_trees_equal(ours, ref)
