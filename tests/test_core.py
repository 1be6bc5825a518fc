"""The core contract: chain, identity, apply_updates, purity, None gradients, dtypes, errors."""

from __future__ import annotations

import hypothesis.strategies as st
import optree
import pytest
import torch
from helpers import ALL_ALIASES, RICH_SETTINGS, assert_trees_equal, clone_tree, problem, tensor_leaves
from hypothesis import given, settings
from models import ShapesNet, make_model

import functional_bagua as fb

# --- chain, identity, apply_updates ------------------------------------------------------------


def test_identity_returns_gradients_and_empty_state():
    params, grads = problem(fb.sgd)
    tx = fb.identity()
    state = tx.init(params)
    assert state == fb.EmptyState()
    updates, new_state = tx.update(grads, state, params)
    assert updates is grads and new_state == state


@settings(max_examples=25, deadline=None)
@given(a=st.floats(-10, 10), b=st.floats(-10, 10), c=st.floats(-10, 10))
def test_chain_of_scales_is_the_product(a, b, c):
    g = {"x": torch.linspace(-3, 3, 7, dtype=torch.float64)}
    tx = fb.chain(fb.scale(a), fb.scale(b), fb.scale(c))
    updates, state = tx.update(g, tx.init(g), g)
    torch.testing.assert_close(updates["x"], g["x"] * a * b * c, rtol=1e-14, atol=1e-300)
    assert len(state) == 3


def test_chain_equals_manual_composition():
    params, grads = problem(fb.sgd, torch.float64)
    first, second = fb.scale_by_adam(), fb.trace(momentum=0.5)
    u1, _ = first.update(grads, first.init(params), params)
    u2, _ = second.update(u1, second.init(params), params)
    chained = fb.chain(first, second)
    u, _ = chained.update(grads, chained.init(params), params)
    assert_trees_equal(u, u2)


def test_chain_rejects_a_state_from_elsewhere():
    params, grads = problem(fb.sgd)
    with pytest.raises(ValueError, match="chain of 4 transforms"):
        fb.adam().update(grads, fb.identity().init(params), params)


def test_chain_rejects_non_transforms():
    with pytest.raises(TypeError, match="argument 1 is function"):
        fb.chain(fb.identity(), lambda g: g)


def test_apply_updates_adds_and_skips_none():
    params = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
    new = fb.apply_updates(params, {"a": torch.tensor([0.5, -1.0]), "b": None})
    assert torch.equal(new["a"], torch.tensor([1.5, 1.0]))
    assert new["b"] is params["b"]
    assert torch.equal(params["a"], torch.tensor([1.0, 2.0]))  # pure


def test_apply_updates_keeps_parameter_dtype():
    p = torch.tensor([1.0, 256.0], dtype=torch.bfloat16)
    u = torch.tensor([1e-3, 1.5], dtype=torch.float32)
    new = fb.apply_updates({"p": p}, {"p": u})["p"]
    assert new.dtype == torch.bfloat16
    assert torch.equal(new, (p.float() + u).bfloat16())


def test_apply_updates_names_mismatched_keys():
    with pytest.raises(ValueError, match=r"missing from updates: 'b'.*in updates but not in params: 'c'"):
        fb.apply_updates({"a": torch.zeros(1), "b": torch.zeros(1)}, {"a": torch.zeros(1), "c": torch.zeros(1)})


# --- every alias: purity, None gradients, dtypes, bad input -----------------------------------


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_update_is_pure(alias):
    params, grads = problem(alias)
    tx = alias(**RICH_SETTINGS.get(alias, {}))
    state = tx.init(params)
    for _ in range(2):  # second step: state is no longer all zeros
        before = clone_tree((grads, state, params))
        updates, new_state = tx.update(grads, state, params)
        assert_trees_equal((grads, state, params), before)
        new_tensors = tensor_leaves(new_state) + tensor_leaves(updates)
        old_storage = {t.untyped_storage().data_ptr() for t in tensor_leaves((state, params, grads)) if t.numel()}
        assert all(
            t.untyped_storage().data_ptr() not in old_storage or t.numel() == 0 for t in tensor_leaves(updates)
        ), "an update aliases an input"
        params, state = fb.apply_updates(params, updates), new_state
        assert new_tensors


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_none_gradient_leaves_parameter_and_state_untouched(alias):
    params, grads = problem(alias)
    tx = alias(**RICH_SETTINGS.get(alias, {}))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)  # one real step first
    params = fb.apply_updates(params, updates)
    frozen = "w"
    grads = {k: (None if k == frozen else g) for k, g in grads.items()}
    updates, new_state = tx.update(grads, state, params)
    assert updates[frozen] is None
    assert all(updates[k] is not None for k in grads if k != frozen)
    assert fb.apply_updates(params, updates)[frozen] is params[frozen]
    for field_old, field_new in zip(_per_param_fields(state), _per_param_fields(new_state)):
        assert field_new[frozen] is field_old[frozen]


def _per_param_fields(state):
    """Every dict-of-parameters subtree in a state (the per-parameter fields of each transform)."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            found.append(node)
        elif isinstance(node, tuple):
            for child in node:
                visit(child)

    visit(state)
    return found


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_bfloat16_parameters_stay_bfloat16(alias):
    params, grads = problem(alias, torch.bfloat16)
    tx = alias(**RICH_SETTINGS.get(alias, {}))
    state = tx.init(params)
    start = clone_tree(params)
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        assert all(u.dtype == torch.bfloat16 for u in updates.values())
        params = fb.apply_updates(params, updates)
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all() for p in params.values())
    assert any(not torch.equal(params[k], start[k]) for k in params)
    for t in tensor_leaves(state):
        assert t.dtype == torch.bfloat16 or (t.dim() == 0 and t.dtype in (torch.int64, torch.float64))


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_mismatched_grads_name_the_keys(alias):
    params, grads = problem(alias)
    tx = alias()
    state = tx.init(params)
    missing = dict(grads)
    del missing["w"]
    with pytest.raises(ValueError, match=r"missing from grads: 'w'"):
        tx.update(missing, state, params)
    extra = dict(grads, typo=torch.zeros(2))
    with pytest.raises(ValueError, match=r"'typo'"):
        tx.update(extra, state, params)


def test_wrong_shape_dtype_and_sparse_gradients_are_named():
    params, grads = problem(fb.adam)
    tx = fb.adam()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"gradient of 'b' has shape \(4,\), parameter has \(3,\)"):
        tx.update(dict(grads, b=torch.zeros(4)), state, params)
    with pytest.raises(TypeError, match=r"gradient of 'b' is torch.float64, parameter is torch.float32"):
        tx.update(dict(grads, b=grads["b"].double()), state, params)
    with pytest.raises(TypeError, match=r"gradient of 'b' is sparse"):
        tx.update(dict(grads, b=grads["b"].to_sparse()), state, params)


def test_transforms_that_need_params_say_so():
    params, grads = problem(fb.adamw)
    tx = fb.adamw()
    with pytest.raises(ValueError, match="add_decayed_weights needs the parameters"):
        tx.update(grads, tx.init(params), None)


def test_muon_rejects_non_matrix_parameters_at_init():
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters.*'b'"):
        fb.muon().init({"w": torch.zeros(3, 3), "b": torch.zeros(3)})


def test_works_on_nested_pytrees():
    params = {"enc": [torch.ones(2, 2), torch.zeros(3)], "head": (torch.ones(1),)}
    grads = optree.tree_map(torch.ones_like, params)
    tx = fb.sgd(lr=0.5, momentum=0.9)
    updates, state = tx.update(grads, tx.init(params), params)
    new = fb.apply_updates(params, updates)
    assert torch.equal(new["enc"][0], torch.full((2, 2), 0.5))
    assert torch.equal(new["head"][0], torch.tensor([0.5]))


# --- invalid hyperparameters: the same ValueError as torch.optim -------------------------------

INVALID = [
    (fb.sgd, torch.optim.SGD, dict(lr=-1.0)),
    (fb.sgd, torch.optim.SGD, dict(momentum=-0.1)),
    (fb.sgd, torch.optim.SGD, dict(weight_decay=-1e-3)),
    (fb.sgd, torch.optim.SGD, dict(nesterov=True)),
    (fb.sgd, torch.optim.SGD, dict(momentum=0.9, dampening=0.1, nesterov=True)),
    (fb.adam, torch.optim.Adam, dict(lr=-1e-3)),
    (fb.adam, torch.optim.Adam, dict(eps=-1.0)),
    (fb.adam, torch.optim.Adam, dict(betas=(1.0, 0.999))),
    (fb.adam, torch.optim.Adam, dict(betas=(0.9, -0.1))),
    (fb.adam, torch.optim.Adam, dict(weight_decay=-1.0)),
    (fb.adamw, torch.optim.AdamW, dict(betas=(0.9, 1.5))),
    (fb.adamax, torch.optim.Adamax, dict(eps=-1.0)),
    (fb.nadam, torch.optim.NAdam, dict(momentum_decay=-1.0)),
    (fb.radam, torch.optim.RAdam, dict(betas=(-0.5, 0.9))),
    (fb.adagrad, torch.optim.Adagrad, dict(lr_decay=-1.0)),
    (fb.adagrad, torch.optim.Adagrad, dict(initial_accumulator_value=-1.0)),
    (fb.adadelta, torch.optim.Adadelta, dict(rho=1.5)),
    (fb.rmsprop, torch.optim.RMSprop, dict(alpha=-0.5)),
    (fb.rmsprop, torch.optim.RMSprop, dict(momentum=-0.5)),
    (fb.rprop, torch.optim.Rprop, dict(etas=(1.1, 1.2))),
    (fb.asgd, torch.optim.ASGD, dict(weight_decay=-1.0)),
    (fb.adafactor, torch.optim.Adafactor, dict(beta2_decay=0.5)),
    (fb.adafactor, torch.optim.Adafactor, dict(d=0.5)),
    (fb.adafactor, torch.optim.Adafactor, dict(eps=(None, -1.0))),
    (fb.muon, torch.optim.Muon, dict(momentum=-1.0)),
    (fb.muon, torch.optim.Muon, dict(adjust_lr_fn="bogus")),
]


@pytest.mark.parametrize(
    "alias, torch_cls, kwargs", [pytest.param(a, t, kw, id=f"{a.__name__}-{kw}") for a, t, kw in INVALID]
)
def test_invalid_hyperparameters_raise_torchs_error(alias, torch_cls, kwargs):
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError) as torch_error:
        torch_cls(params, **kwargs)
    with pytest.raises(ValueError) as our_error:
        alias(**kwargs)
    assert str(our_error.value) == str(torch_error.value)


@pytest.mark.parametrize("alias", [fb.lamb, fb.lars, fb.lion, fb.adabelief], ids=lambda a: a.__name__)
def test_invalid_hyperparameters_of_paper_optimizers(alias):
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        alias(lr=-1.0)
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        alias(weight_decay=-1.0)


# --- modules -------------------------------------------------------------------------------------


def test_params_of_names_trainable_parameters_and_skips_frozen():
    model = ShapesNet()
    model.conv.bias.requires_grad_(False)
    params = fb.params_of(model)
    assert list(params) == [n for n, p in model.named_parameters() if n != "conv.bias"]
    assert set(params) == {"conv.weight", "fc.weight", "fc.bias", "scale"}
    assert all(not p.requires_grad for p in params.values())
    assert params["fc.weight"].data_ptr() == model.fc.weight.data_ptr()  # an alias, not a copy


def test_functional_call_with_params_of_matches_the_module():
    model = make_model("shapes", torch.float64)
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    out = torch.func.functional_call(model, fb.params_of(model), (x,))
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_load_params_writes_back_and_checks_keys_and_shapes():
    model = make_model("shapes", torch.float32)
    params = {k: torch.full_like(v, 0.25) for k, v in fb.params_of(model).items()}
    fb.load_params(model, params)
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in model.parameters())
    with pytest.raises(ValueError, match="not parameters of ShapesNet: \\['nope'\\]"):
        fb.load_params(model, {"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape of 'scale' is \\(2,\\)"):
        fb.load_params(model, {"scale": torch.zeros(2)})
    assert fb.buffers_of(torch.nn.BatchNorm1d(3)).keys() == {"running_mean", "running_var", "num_batches_tracked"}
