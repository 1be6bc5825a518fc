"""A chain of elementwise links run on its input flattened, checked and grouped once
(functional_bagua.leaf_lists): the input checked once, a link's result that changes a leaf's
shape refused where the next link takes it, the trees' structures, the grouping itself, and a
0-dim parameter's Adam rounding.
(The bits against the links run one by one: tests/test_ownership.py.)"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from devices import seeded

import functional_bagua as fb
from functional_bagua import checks, foreach


def problem():
    gen = seeded(3)
    params = {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    return params, grads


def test_a_chain_checks_its_input_once(monkeypatch):
    calls = []
    original = checks.check_grads

    def counting(*args, **kwargs):
        calls.append(args[3])  # who
        return original(*args, **kwargs)

    monkeypatch.setattr(checks, "check_grads", counting)
    params, grads = problem()
    tx = fb.adamw(1e-2, weight_decay=0.1)  # four links: negate_if, scale_by_adam, add_decayed_weights, scale
    tx.update(grads, tx.init(params), params)
    assert calls == ["scale_by_adam"]


def test_a_link_that_changes_a_shape_is_refused_where_the_next_link_takes_it():
    """Run one by one, the next link's own check refuses the result; run on lists, the chain does."""

    def summed(g, s, p):
        return g.sum(), s  # a user's rule that is not elementwise, declared as if it were

    collapse = fb.leafwise(fb.EmptyState, lambda p: fb.EmptyState(), summed, name="summing")
    tx = fb.chain(collapse, fb.scale(-0.1))
    params, grads = problem()
    with pytest.raises(ValueError, match=r"scale: gradient of '(w|b)' has shape \(\), parameter has"):
        tx.update(grads, tx.init(params), params)


def test_a_rule_that_reads_shapes_runs_per_tensor_inside_a_chain():
    def by_rows(g, s, p):
        return g * g.shape[0], s

    rows = fb.leafwise(fb.EmptyState, lambda p: fb.EmptyState(), by_rows, name="by_rows")
    tx = fb.chain(fb.scale_by_adam(), rows, fb.scale(-0.1))
    params, grads = problem()
    got, _ = tx.update(grads, tx.init(params), params)
    adam = fb.scale_by_adam()
    direction, _ = adam.update(grads, adam.init(params), params)
    for k in params:
        expected = direction[k] * direction[k].shape[0] * -0.1
        torch.testing.assert_close(got[k], expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make",
    [lambda: fb.adam(1e-2), lambda: fb.masked(fb.scale(2.0), {"w": True, "b": False})],
    ids=["adam", "masked"],
)
def test_gradients_in_another_container_type_are_refused(make):
    """An OrderedDict is not the params' dict: a wrapper pairing leaves by position would pair
    them wrongly, so the structures must match exactly."""
    params, grads = problem()
    reordered = collections.OrderedDict((k, grads[k]) for k in reversed(list(grads)))
    tx = make()
    with pytest.raises(ValueError, match="same keys, different containers"):
        tx.update(reordered, tx.init(params), params)


def test_without_params_a_link_that_changes_a_shape_is_refused_naming_both_shapes():
    def summed(g, s, p):
        return g.sum(), s

    collapse = fb.leafwise(fb.EmptyState, lambda p: fb.EmptyState(), summed, name="summing")
    tx = fb.chain(collapse, fb.scale(-0.1))
    _, grads = problem()
    with pytest.raises(
        ValueError, match=r"scale: the update of '(w|b)' is torch.float32 of shape \(\), where the link"
    ):
        tx.update(grads, tx.init(grads))


@pytest.mark.parametrize("per_tensor", [False, True], ids=["grouped", "per tensor"])
@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "leafwise"])
def test_a_rule_that_returns_no_tensor_is_refused_inside_a_chain(per_tensor, stateful):
    if stateful:
        number = fb.leafwise(fb.EmptyState, lambda p: fb.EmptyState(), lambda g, s, p: (0.5, s), name="number")
    else:
        number = fb.stateless(lambda u, p: 0.5, name="number")
    tx = fb.chain(number, fb.scale(-0.1))
    params, grads = problem()
    with foreach.per_tensor() if per_tensor else contextlib.nullcontext():
        with pytest.raises(TypeError, match="number: the rule gave a float as an update, not a tensor"):
            tx.update(grads, tx.init(params), params)


def test_zero_dim_parameters_divide_in_float64_on_every_path():
    """A 0-dim float32 parameter's Adam direction: the bias corrections are 0-dim float64
    tensors, and 0-dim by 0-dim arithmetic promotes, so the quotient is formed in float64 and
    rounded once (written out below); the same bits grouped, one tensor at a time, and with
    autograd recording the gradients (where the root is not divided in place)."""
    gen = seeded(11)
    values = {f"s{i}": (torch.randn((), generator=gen), torch.randn((), generator=gen)) for i in range(400)}
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-2
    bc1, bc2 = torch.tensor(1 - b1, dtype=torch.float64), torch.tensor(1 - b2, dtype=torch.float64)
    expected = {}
    for k, (p, g) in values.items():
        m = torch.zeros(()).lerp(g, 1 - b1)
        v = torch.zeros(()).mul(b2).addcmul(g, g, value=1 - b2)
        direction = ((m.double() / bc1) / (v.sqrt().double() / bc2.sqrt() + eps)).float()
        expected[k] = p + direction * -lr
    tx = fb.adam(lr)
    for records in (False, True):
        for per_tensor in (False, True):
            params = {k: p.clone() for k, (p, g) in values.items()}
            grads = {k: g.clone().requires_grad_(records) for k, (p, g) in values.items()}
            with foreach.per_tensor() if per_tensor else contextlib.nullcontext():
                updates, _ = tx.update(grads, tx.init(params), params)
            new = fb.apply_updates(params, updates)
            differ = [k for k in values if not torch.equal(new[k].detach(), expected[k])]
            assert not differ, (records, per_tensor, differ[:3])


def test_a_subtree_where_a_gradient_belongs_is_refused():
    params, grads = problem()
    grads["b"] = {"inner": grads["b"]}
    tx = fb.adam(1e-2)
    with pytest.raises(ValueError, match="grads do not match the structure of params"):
        tx.update(grads, tx.init(params), params)


def test_groups_split_by_device_dtype_and_key_and_leave_complex_out():
    tensors = [
        torch.ones(2),
        torch.ones(2, dtype=torch.complex64),
        torch.ones(2, dtype=torch.float64),
        torch.ones(3),
        torch.ones(1, device="meta"),
        torch.ones(4),
    ]
    assert foreach.groups(tensors, range(6)) == [[0, 3, 5], [2], [4]]
    assert foreach.groups(tensors, [0, 3, 5], key=lambda i: i == 3) == [[0, 5], [3]]
    assert foreach.groups(tensors, [0, 3, 5]) == [[0, 3, 5]]
    assert foreach.groups(tensors, [1]) == []
    assert foreach.groups(tensors, []) == []


@pytest.mark.parametrize(
    "tree_, spec_of",
    [
        ({"a": torch.ones(2), "b": None}, {"a": torch.ones(2), "b": None}),  # the structure expected
        ({"a": torch.ones(2), "c": torch.ones(1)}, {"a": torch.ones(2), "b": None}),  # other keys
        ({"a": {"x": torch.ones(2)}, "b": None}, {"a": torch.ones(2), "b": None}),  # a subtree for a leaf
        ([torch.ones(2), torch.ones(3)], {"a": torch.ones(2), "b": None}),  # another container
        ({"a": (torch.ones(2), torch.ones(1))}, {"a": (torch.ones(2), torch.ones(1))}),  # nested
        ({"a": torch.ones(2)}, None),  # no structure expected
    ],
)
def test_flatten_like_gives_the_tree_own_leaves_and_structure(tree_, spec_of):
    """``tree.flatten_like(tree, spec)`` reads ``tree`` against ``spec`` in one pass where it
    has that structure, else flattens it: the leaves and structure of ``tree.flatten`` either way."""
    spec = None if spec_of is None else fb.tree.flatten(spec_of)[1]
    leaves, got = fb.tree.flatten_like(tree_, spec)
    want_leaves, want = fb.tree.flatten(tree_)
    assert got == want
    assert len(leaves) == len(want_leaves) and all(a is b for a, b in zip(leaves, want_leaves))


def test_read_each_reads_eagerly_and_traced_as_the_comprehension():
    """``checks.read_each``: each tensor's attribute, in order; the same under torch.compile
    (where it falls back to the comprehension dynamo traces), without a graph break."""
    tensors = [torch.ones(2, 3), torch.zeros(4, dtype=torch.float64)]
    assert checks.read_each("shape", tensors) == [t.shape for t in tensors]
    assert checks.read_each("dtype", tensors) == [torch.float32, torch.float64]

    @torch.compile(backend="eager", fullgraph=True)
    def numel_of_first(xs):
        return xs[0] * len(checks.read_each("shape", xs)) + sum(s.numel() for s in checks.read_each("shape", xs))

    assert torch.equal(numel_of_first([torch.ones(2, 3), torch.ones(4)]), torch.ones(2, 3) * 2 + 10)
