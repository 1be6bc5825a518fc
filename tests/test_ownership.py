"""Links of a chain computing in their predecessor's fresh updates (functional_bagua.ownership):
the same bits as the links run one by one outside a chain (where nothing is granted), the
caller's gradients and the state untouched, and no grant reaching a transform nested in a link."""

from __future__ import annotations

import inspect
from typing import NamedTuple

import pytest
import torch
from devices import ON_CUDA, seeded
from helpers import ALL_ALIASES, NEWER_FIRST_ORDER, RICH_SETTINGS, assert_trees_equal, clone_tree, run_updates

import functional_bagua as fb
from functional_bagua import foreach, ownership
from functional_bagua.base import GradientTransformation

PROBLEM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.complex64)


def problem(dtypes=PROBLEM_DTYPES):
    gen = seeded(5)
    params = {f"p{i}": torch.randn(3, 4, generator=gen).to(dt) for i, dt in enumerate(dtypes)}
    grads = [{k: torch.randn(p.shape, generator=gen).to(p.dtype) for k, p in params.items()} for _ in range(3)]
    return params, grads


def link_by_link(tx, grads, state, params):
    """The chain's links called one after the other by hand: no link is granted anything."""
    updates, new_state = grads, []
    for link, s in zip(tx.update.transforms, state):
        updates, s = link.update(updates, s, params)
        new_state.append(s)
    return updates, tuple(new_state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fb.adamw(1e-2, weight_decay=0.1),
        lambda: fb.adam(1e-2, weight_decay=0.1, amsgrad=True),
        lambda: fb.chain(fb.scale_by_adam(), fb.add_decayed_weights(torch.tensor(0.1)), fb.scale(torch.tensor(-0.01))),
        lambda: fb.chain(fb.scale_by_adam(), fb.add_decayed_weights(0.1), fb.scale(-1e-2), fb.scale(0.5)),
    ],
    ids=["adamw", "adam amsgrad L2", "tensor numbers", "hand chain"],
)
def test_a_chain_gives_the_bits_of_its_links_run_one_by_one(make):
    tx = make()
    params, steps = problem()
    state_chain = state_hand = tx.init(params)
    for grads in steps:
        before = clone_tree(grads)
        got, state_chain = tx.update(grads, state_chain, params)
        expected, state_hand = link_by_link(tx, clone_tree(grads), state_hand, params)
        assert_trees_equal(got, expected)
        assert_trees_equal(state_chain, state_hand)
        assert_trees_equal(grads, before)  # the caller's gradients are never overwritten
        kept = {id(t) for t in fb.tree.flatten(state_chain)[0] if isinstance(t, torch.Tensor)}
        assert not any(id(u) in kept for u in got.values())  # the updates alias no state


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
@pytest.mark.parametrize("weight_decay", [None, 0.1], ids=["own settings", "weight decay"])
def test_every_alias_chain_gives_the_bits_of_its_links_one_by_one(alias, weight_decay):
    """Every alias that is a chain, with its stateful paths on (and weight decay, whose link takes
    the grant): updates, state and the caller's gradients as with nothing granted."""
    settings = dict(RICH_SETTINGS.get(alias, {}))
    if weight_decay is not None:
        if "weight_decay" not in inspect.signature(alias).parameters:
            pytest.skip(f"{alias.__name__} has no weight decay")
        settings["weight_decay"] = weight_decay
    tx = alias(**settings)
    if not hasattr(tx.update, "transforms"):
        pytest.skip(f"{alias.__name__} is not a chain")
    shapes = {"w": (4, 3), "v": (3, 5)} if alias is fb.muon else {"w": (4, 3), "b": (3,), "k": (2, 1, 3, 3)}
    gen = seeded(7)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    state_chain = state_hand = tx.init(params)
    for _ in range(3):
        grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
        before = clone_tree(grads)
        got, state_chain = tx.update(grads, state_chain, params)
        expected, state_hand = link_by_link(tx, clone_tree(grads), state_hand, params)
        assert_trees_equal(got, expected)
        assert_trees_equal(state_chain, state_hand)
        assert_trees_equal(grads, before)
        params = fb.apply_updates(params, got)


def test_the_first_link_never_overwrites_the_callers_updates():
    grads = {"w": torch.ones(3)}
    tx = fb.chain(fb.scale(2.0), fb.scale(3.0))
    updates, _ = tx.update(grads, tx.init(grads))
    assert torch.equal(grads["w"], torch.ones(3)) and torch.equal(updates["w"], torch.full((3,), 6.0))


def twice(inner: GradientTransformation) -> GradientTransformation:
    """A container that gives its inner transform the same updates twice and adds the results:
    an inner transform that overwrote what it was given would double count."""

    def update(updates, state, params=None):
        first, _ = inner.update(updates, state, params)
        second, state = inner.update(updates, state, params)
        return {k: first[k] + second[k] for k in updates}, state

    return GradientTransformation(inner.init, update)


def test_no_grant_reaches_a_transform_nested_in_a_link():
    params, steps = problem(dtypes=(torch.float64,))
    nested = fb.chain(fb.scale_by_adam(), twice(fb.scale(3.0)))
    adam = fb.scale_by_adam()
    got, _ = nested.update(steps[0], nested.init(params), params)
    plain, _ = adam.update(steps[0], adam.init(params), params)
    for k in params:
        torch.testing.assert_close(got[k], 6.0 * plain[k], rtol=0, atol=0)


def recording_fresh(addresses: list) -> GradientTransformation:
    """A link that returns new tensors (declared fresh) and records where they live."""

    def update(updates, state, params=None):
        out = {k: u * 1.0 for k, u in updates.items()}
        addresses.append({k: u.data_ptr() for k, u in out.items()})
        return out, state

    update.fresh_updates = True
    return GradientTransformation(lambda params: fb.EmptyState(), update)


@pytest.mark.parametrize("nested", [False, True], ids=["flat chain", "nested chain"])
def test_a_granted_link_computes_in_its_predecessors_tensors(nested):
    """The in-place path runs: the chain's result lives where the fresh link put its own (and
    where a nested chain's first link was granted, too); without a fresh predecessor it does not."""
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    grads = {k: torch.randn(p.shape) for k, p in params.items()}
    addresses: list = []
    tail = fb.chain(fb.add_decayed_weights(0.1), fb.scale(-0.1)) if nested else fb.scale(-0.1)
    tx = fb.chain(recording_fresh(addresses), tail)
    got, _ = tx.update(grads, tx.init(params), params)
    assert {k: u.data_ptr() for k, u in got.items()} == addresses[0]
    plain = fb.chain(fb.identity(), tail)  # identity declares nothing: a new tensor is written
    again, _ = plain.update(grads, plain.init(params), params)
    assert all(again[k].data_ptr() != grads[k].data_ptr() for k in grads)
    assert tx.update.fresh_updates and not fb.chain(fb.trace(0.9)).update.fresh_updates


def test_gradients_flow_through_an_adamw_update():
    """Differentiating the update with respect to the gradients (meta-learning, hypergradients):
    autograd's result equals the one through AdamW's first step written out by hand."""
    params = {"w": torch.randn(3, 4, dtype=torch.float64)}
    grads = {"w": torch.randn(3, 4, dtype=torch.float64, requires_grad=True)}
    tx = fb.adamw(1e-2, weight_decay=0.1)
    updates, _ = tx.update(grads, tx.init(params), params)
    (got,) = torch.autograd.grad((updates["w"] ** 2).sum(), grads["w"])
    g = grads["w"].detach().clone().requires_grad_(True)
    b1, b2, eps, lr, wd = 0.9, 0.999, 1e-8, 1e-2, 0.1
    m, v = (1 - b1) * g, (1 - b2) * g * g
    u = -lr * ((m / (1 - b1)) / ((v.sqrt() / (1 - b2) ** 0.5) + eps) + wd * params["w"])
    (expected,) = torch.autograd.grad((u**2).sum(), g)
    torch.testing.assert_close(got, expected)


def test_a_compiled_chain_gives_the_eager_bits():
    params, steps = problem(dtypes=(torch.float32, torch.float64))
    tx = fb.adamw(1e-2, weight_decay=0.1)
    compiled = torch.compile(tx.update, fullgraph=True, backend="aot_eager")
    state_c = state_e = tx.init(params)
    for grads in steps:
        got, state_c = compiled(grads, state_c, params)
        expected, state_e = tx.update(grads, state_e, params)
        if ON_CUDA:  # aot_eager's decomposed ops round otherwise than CUDA's multi-tensor kernels
            torch.testing.assert_close(got, expected)
        else:
            assert_trees_equal(got, expected)


# --- state given up: a caller that keeps only the new state (fb.Optimizer) -------------------------

NEWER = {**NEWER_FIRST_ORDER, fb.prodigy: dict(weight_decay=0.1), fb.dadapt_adam: dict(weight_decay=0.1)}
WHOLE_TENSOR_RULES = {
    fb.muon,
    fb.adafactor,
    fb.lamb,
    fb.lars,
    fb.prodigy,
    fb.dadapt_adam,
    fb.mars_adamw,
}  # norms or shapes: no complex
REAL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
COMPUTED_IN_PLACE = {fb.adam, fb.adamw, fb.nadam, fb.radam, fb.adabelief, fb.lion, fb.adopt, fb.ademamix}
COMPUTED_IN_PLACE |= {fb.laprop, fb.schedule_free_adamw, fb.schedule_free_sgd, fb.prodigy, fb.dadapt_adam}


@pytest.mark.parametrize(
    "alias, settings",
    [(a, RICH_SETTINGS.get(a, {})) for a in ALL_ALIASES] + list(NEWER.items()),
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_state_given_up_gives_the_pure_bits_and_is_stepped_in_its_own_tensors(alias, settings):
    """Every alias, its state given up (as fb.Optimizer gives it) against the pure update on a
    copy: the same updates and new state, bit for bit (float32, float64, bfloat16 and complex
    parameters); the rules written with foreach.updated step their state in its own tensors."""
    settings = dict(settings)
    if alias is fb.adam:
        settings.pop("amsgrad")  # nu_max has no in-place form; its own path is covered below
    tx = alias(**settings)
    params, steps = problem(dtypes=REAL_DTYPES if alias in WHOLE_TENSOR_RULES else PROBLEM_DTYPES)
    state_pure = tx.init(params)
    state_given = clone_tree(state_pure)
    for grads in steps:
        before = fb.state_dict(state_given)
        want, state_pure = tx.update(grads, state_pure, params)
        got, state_given = ownership.update_giving_state(tx, grads, state_given, params)
        assert_trees_equal(got, want)
        assert_trees_equal(state_given, state_pure)
        after = fb.state_dict(state_given)
        passed_through = {"p0", "count"}  # fields a step hands on unchanged: not stepped in place
        reused = [k for k, t in before.items() if after[k] is t and not passed_through & set(k.split("/"))]
        if alias in COMPUTED_IN_PLACE:
            assert reused, "no state tensor was stepped in place"
        params = fb.apply_updates(params, got)


def test_a_pure_update_leaves_the_state_it_is_given_untouched():
    params, steps = problem()
    tx = fb.adopt(1e-2, weight_decay=0.1, decouple=True)
    state = tx.init(params)
    for grads in steps:
        copy = clone_tree(state)
        _, new_state = tx.update(grads, state, params)
        assert_trees_equal(state, copy)
        state = new_state


def test_a_wrapper_that_keeps_the_old_state_never_passes_it_on_given_up():
    """fb.Optimizer gives its state up; apply_if_finite, which keeps the old state after a
    non-finite gradient (the second one here), does not pass that on: the steps are those of the
    pure update."""
    params, steps = problem(dtypes=(torch.float32, torch.float64))
    steps[1] = {k: torch.full_like(g, float("nan")) for k, g in steps[1].items()}
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = fb.Optimizer(tensors.values(), fb.apply_if_finite(fb.adam(1e-2), 3))
    want, _ = run_updates(fb.apply_if_finite(fb.adam(1e-2), 3), params, steps)
    for grads in steps:
        for k, p in tensors.items():
            p.grad = grads[k].clone()
        opt.step()
    assert_trees_equal({k: p.detach() for k, p in tensors.items()}, want)


class _Held(NamedTuple):
    x: torch.Tensor


def test_given_state_that_shares_a_tensor_with_the_parameters_is_not_overwritten():
    """A rule whose state holds the parameter tensor itself: given up or not, the parameter is
    not written in (a column sharing a tensor with another is computed as new tensors)."""
    tx = fb.leafwise(
        _Held, lambda p: _Held(p), lambda g, s, p: (g * 0, _Held(foreach.updated(s.x, "add", g))), name="held"
    )
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    state = tx.init(params)
    _, new_state = ownership.update_giving_state(tx, {k: torch.ones_like(v) for k, v in params.items()}, state, params)
    assert torch.equal(params["a"], torch.ones(3)) and torch.equal(new_state.x["a"], torch.full((3,), 2.0))


def test_a_rule_that_fails_after_overwriting_given_state_raises_instead_of_running_again():
    """The grouped path falls back to one tensor at a time when a rule raises; after the rule has
    overwritten state given up, running it again would step that state twice: it raises."""

    def rule(g, s, p):
        x = foreach.updated(s.x, "add", g)
        if isinstance(x, foreach.Leaves):
            raise foreach.PerTensorOnly("only one tensor at a time from here")
        return g, _Held(x)

    tx = fb.leafwise(_Held, lambda p: _Held(torch.zeros_like(p)), rule, name="fails")
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    _, pure = tx.update(grads, tx.init(params), params)  # not given: falls back, one tensor at a time
    assert torch.equal(pure.x["a"], torch.ones(3))
    with pytest.raises(RuntimeError, match="after overwriting the state it was given"):
        ownership.update_giving_state(tx, grads, tx.init(params), params)


@pytest.mark.parametrize(
    "alias",
    [fb.adam, fb.nadam, fb.radam, fb.adabelief, fb.lion, fb.rmsprop, fb.adadelta, fb.adopt, fb.ademamix, fb.laprop],
    ids=lambda a: a.__name__,
)
def test_0_dim_parameters_with_hyperparameters_held_as_tensors_step_as_the_pure_update(alias):
    """Every float hyperparameter held as a 0-dim float64 tensor (as fb.Optimizer's factory form
    holds them): a 0-dim float32 parameter's state then computes in float64 out of place, in
    float32 in place, so a group that holds a 0-dim tensor computes its state as new tensors,
    given up or not: the same bits either way."""
    gen = seeded(9)
    params = {f"s{i}": torch.randn((), generator=gen) for i in range(40)}
    params.update({f"w{i}": torch.randn(3, 4, generator=gen) for i in range(3)})
    steps = [{k: torch.randn(p.shape, generator=gen) for k, p in params.items()} for _ in range(4)]
    numbers = {
        k: v.default
        for k, v in inspect.signature(alias).parameters.items()
        if isinstance(v.default, (float, tuple)) and k != "lr"
    }
    tx = fb.inject_hyperparams(alias)(lr=1e-2, **numbers)
    state_pure = tx.init(params)
    state_given = clone_tree(state_pure)
    for grads in steps:
        want, state_pure = tx.update(grads, state_pure, params)
        got, state_given = ownership.update_giving_state(tx, grads, state_given, params)
        assert_trees_equal(got, want)
        assert_trees_equal(state_given, state_pure)
        params = fb.apply_updates(params, got)
