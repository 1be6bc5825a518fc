"""Links of a chain computing in their predecessor's fresh updates (functional_bagua.ownership):
the same bits as the links run one by one outside a chain (where nothing is granted), the
caller's gradients and the state untouched, and no grant reaching a transform nested in a link."""

from __future__ import annotations

import inspect

import pytest
import torch
from devices import ON_CUDA, seeded
from helpers import ALL_ALIASES, RICH_SETTINGS, assert_trees_equal, clone_tree

import functional_bagua as fb
from functional_bagua.base import GradientTransformation


def problem(dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.complex64)):
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
