"""Shampoo compiled and fused, each against a second code path: inside fb.fuse (flat buffers,
state stacked per shape) against the unfused update; compiled (torch.compile, make_train_step)
against the eager update; a fused state through a checkpoint; what it refuses."""

from __future__ import annotations

import re

import pytest
import torch
from devices import ON_CUDA, at
from second_order_helpers import (
    ShardLike,
    compiled_fused_and_eager_steps,
    draws,
    fused_trace,
    resumed_and_uninterrupted,
    trace,
)

import functional_bagua as fb

# shapes one size apart (a gather), back to back (a view), cut into blocks, merged, a vector, a
# scalar, an empty one
FUSED_SHAPES = {
    "a": (6, 4),
    "square": (5, 5),
    "b": (6, 4),
    "c": (6, 4),
    "tall": (9, 4),
    "conv": (4, 3, 2, 2),
    "bias": (7,),
    "scalar": (),
    "empty": (0, 3),
}
OPTIONS = [
    {},
    {"grafting": "adam", "max_preconditioner_dim": 4, "precondition_frequency": 2, "start_preconditioning_step": 3},
    {"betas": (0.0, 0.99), "grafting": "adagrad", "merge_dims": True, "max_preconditioner_dim": 8},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["defaults", "blocked_adam_grafting", "merged_adagrad_no_b1"])
def test_fused_shampoo_equals_unfused_shampoo(options):
    params, grads = draws(FUSED_SHAPES, steps=6)
    tx = fb.shampoo(lr=1e-2, weight_decay=0.1, **options)
    expected = trace(tx.update, tx.init(params), params, grads)
    got = fused_trace(tx, params, grads)
    # on CUDA cuBLAS's products differ in the last bits with the batch (and inductor's from cuBLAS's);
    # the inverse roots of near-singular statistics amplify that (up to 3e-7 measured on an H200)
    tolerance = dict(rtol=1e-6, atol=1e-7) if ON_CUDA else dict(rtol=1e-13, atol=1e-15)
    for t, (want, back) in enumerate(zip(expected, got)):
        for k in params:
            torch.testing.assert_close(back[k], want[k], **tolerance, msg=lambda m: f"step {t} {k}: {m}")


def test_a_fused_state_is_stacked_per_shape_and_block_and_resumes_from_a_checkpoint_bit_for_bit():
    params, grads = draws(FUSED_SHAPES, steps=6)
    layout = fb.FlatLayout.of(params)
    tx = fb.fuse(fb.shampoo(lr=1e-2, **OPTIONS[1]), layout)
    flat = layout.flatten(params)
    state = tx.init(flat)
    (key,) = layout.keys
    direction = state[0]
    groups = {shape: rows.number for shape, rows in layout.shape_groups(key)}
    assert groups[(6, 4)] == 3  # "a", "b" and "c" in one batch, though "square" lies between them
    j = list(groups).index((9, 4))
    # (9, 4) with blocks of at most 4: blocks of 4, 4 and 1 rows, each with its own statistics
    assert [tuple(m.shape) for m in direction.mu[key][j]] == [(1, 4, 4), (1, 4, 4), (1, 1, 4)]
    assert [[tuple(s.shape) for s in block] for block in direction.statistics[key][j]] == [
        [(1, 4, 4), (1, 4, 4)],
        [(1, 4, 4), (1, 4, 4)],
        [(1, 1, 1), (1, 4, 4)],
    ]
    p, p_loaded = resumed_and_uninterrupted(tx, layout, params, grads)
    assert torch.equal(p[key], p_loaded[key])


def test_a_fused_state_for_another_layout_or_blocking_is_refused():
    params, grads = draws({"a": (6, 4), "b": (5, 5)}, steps=1)
    other = {"a": torch.zeros(6, 4, dtype=torch.float64), "b": torch.zeros(4, 6, dtype=torch.float64)}
    tx = fb.scale_by_shampoo()
    layout, other_layout = fb.FlatLayout.of(params), fb.FlatLayout.of(other)
    flat = layout.flatten(params)
    for state in (
        fb.fuse(tx, other_layout).init(other_layout.flatten(other)),
        fb.fuse(fb.scale_by_shampoo(max_preconditioner_dim=3), layout).init(flat),
    ):
        with pytest.raises(
            ValueError, match=f"state of the flat buffer '{re.escape(at('float64'))}' was made for another layout"
        ):
            fb.fuse(tx, layout).update(layout.flatten(grads[0]), state, flat)


def test_shampoo_inside_shard_is_refused_with_the_reason():
    params, _ = draws({"a": (6, 4)}, steps=1)
    layout = fb.FlatLayout.of(params)

    from functional_bagua import layout_context

    with pytest.raises(NotImplementedError, match="scale_by_shampoo cannot run inside shard"):
        layout_context.run_on_flat_buffers(ShardLike(), fb.scale_by_shampoo().init, layout.flatten(params))


# ---- compiled: one compile of the update, one of a fused train step (compiles cost seconds) -------

COMPILED_SHAPES = {"a": (5, 5), "b": (5, 5), "tall": (6, 3), "bias": (4,), "scalar": ()}


def test_a_compiled_update_equals_the_eager_one_also_with_a_late_first_gradient():
    params, grads = draws(COMPILED_SHAPES, steps=7)
    # "b" gets its first gradient at step 1: in the compiled step it shares a batch with "a", each
    # row at its own count (its bias corrections, refreshes and start of preconditioning its own:
    # with roots every 2nd gradient, the two rows refresh in alternate steps)
    grads = [dict(g, b=None) if t < 1 else g for t, g in enumerate(grads)]
    tx = fb.shampoo(lr=1e-2, weight_decay=0.1, **OPTIONS[1])
    # dynamo's graphs (two: "b" absent, then present) run as traced, without AOT autograd or
    # inductor (a third of the time on 2 cores); inductor compiles this update in the dynamic-shapes and symbolic-float
    # tests of test_second_order_edges.py and in the fused train step below
    compiled = torch.compile(tx.update, fullgraph=True, backend="eager")
    expected = trace(tx.update, tx.init(params), params, grads)
    got = trace(compiled, tx.init(params), params, grads)
    # on CUDA cuBLAS's products differ in the last bits with the batch (and inductor's from cuBLAS's);
    # the inverse roots of near-singular statistics amplify that (up to 3e-7 measured on an H200)
    tolerance = dict(rtol=1e-6, atol=1e-6) if ON_CUDA else dict(rtol=1e-11, atol=1e-13)
    for t, (want, have) in enumerate(zip(expected, got)):
        for k in params:
            torch.testing.assert_close(have[k], want[k], **tolerance, msg=lambda m: f"step {t} {k}: {m}")


def test_a_compiled_update_with_newton_roots_runs_the_iteration_as_the_eager_one():
    """A loose Newton tolerance makes its roots differ from eigh's: the compiled refresh must
    run Newton's iteration, as the eager one does."""
    params, grads = draws({"a": (5, 5), "b": (5, 5), "tall": (6, 3)}, steps=5)
    options = dict(lr=0.1, epsilon=1e-3, precondition_frequency=2, newton_tolerance=1e-2, newton_iterations=8)
    tx = fb.shampoo(root_method="newton", **options)
    compiled = torch.compile(tx.update, fullgraph=True, backend="eager")
    expected = trace(tx.update, tx.init(params), params, grads)
    got = trace(compiled, tx.init(params), params, grads)
    eigh_tx = fb.shampoo(root_method="eigh", **options)
    by_eigh = trace(eigh_tx.update, eigh_tx.init(params), params, grads)
    tolerance = dict(rtol=1e-6, atol=1e-6) if ON_CUDA else dict(rtol=1e-11, atol=1e-13)
    for t, (want, have) in enumerate(zip(expected, got)):
        for k in params:
            torch.testing.assert_close(have[k], want[k], **tolerance, msg=lambda m: f"step {t} {k}: {m}")
    # the methods differ by far more than the tolerances above (about 1e-4 here)
    assert max((expected[-1][k] - by_eigh[-1][k]).abs().max().item() for k in params) > 1e-5


def test_a_compiled_fused_train_step_equals_the_eager_unfused_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    batch = (torch.randn(64, 6, dtype=torch.float64), torch.randn(64, 3, dtype=torch.float64))
    tx = fb.shampoo(
        lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99), grafting="rmsprop", precondition_frequency=2, epsilon=1e-6
    )  # full-rank enough: see below
    for t, loss, eager_loss, back, params in compiled_fused_and_eager_steps(model, tx, batch):
        torch.testing.assert_close(loss, eager_loss, rtol=1e-10, atol=0)
        for k in params:
            torch.testing.assert_close(back[k], params[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"step {t} {k}: {m}")


def test_group_under_compile_is_refused_naming_the_way_out():
    tx = fb.scale_by_shampoo(group=object())  # refused before the group is used
    params, grads = draws({"a": (3, 3)}, steps=1)
    state = tx.init(params)
    with pytest.raises(Exception, match="group= shares its inverse roots"):
        torch.compile(tx.update, fullgraph=True, backend="eager")(grads[0], state, params)
