"""SOAP compiled and fused, each against a second code path: inside fb.fuse (flat buffers, state
stacked per shape) against the unfused update; compiled (torch.compile, make_train_step)
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

FREQUENCY = 2  # refreshes at the 3rd, 5th, ... gradient


# shapes of one size apart (a gather), back to back (a view), merged, a vector, a scalar, an empty one
FUSED_SHAPES = {
    "a": (6, 4),
    "square": (5, 5),
    "b": (6, 4),
    "c": (6, 4),
    "conv": (4, 3, 2, 2),
    "bias": (7,),
    "scalar": (),
    "empty": (0, 3),
}


@pytest.mark.parametrize(
    "options",
    [{}, {"merge_dims": True, "max_precondition_dim": 12}, {"precondition_1d": True, "normalize_gradient": True}],
    ids=["defaults", "merged", "vectors_normalized"],
)
def test_fused_soap_equals_unfused_soap(options):
    params, grads = draws(FUSED_SHAPES, steps=7)
    tx = fb.soap(lr=1e-2, weight_decay=0.1, precondition_frequency=FREQUENCY, **options)
    expected = trace(tx.update, tx.init(params), params, grads)
    got = fused_trace(tx, params, grads)
    for t, (want, back) in enumerate(zip(expected, got)):
        for k in params:
            torch.testing.assert_close(back[k], want[k], rtol=1e-13, atol=1e-15, msg=lambda m: f"step {t} {k}: {m}")


def test_a_fused_state_is_stacked_per_shape_and_resumes_from_a_checkpoint_bit_for_bit():
    params, grads = draws(FUSED_SHAPES, steps=6)
    layout = fb.FlatLayout.of(params)
    tx = fb.fuse(fb.soap(lr=1e-2, precondition_frequency=FREQUENCY), layout)
    flat = layout.flatten(params)
    state = tx.init(flat)
    (key,) = layout.keys
    direction = state[0]
    counts: dict = {}  # per shape, in the order shapes first occur in the buffer: how many tensors
    for seg in layout.segments(key):
        if seg.numel:
            counts[seg.shape] = counts.get(seg.shape, 0) + 1
    stacked = [(n, *shape) if shape else (n, 1) for shape, n in counts.items()]
    assert [tuple(m.shape) for m in direction.mu[key]] == stacked
    assert (3, 6, 4) in stacked  # "a", "b" and "c" in one batch, though "bias" lies between them
    p, p_loaded = resumed_and_uninterrupted(tx, layout, params, grads)
    assert torch.equal(p[key], p_loaded[key])


def test_a_fused_state_for_another_layout_is_refused():
    params, grads = draws({"a": (6, 4), "b": (5, 5)}, steps=1)
    other = {"a": torch.zeros(6, 4, dtype=torch.float64), "b": torch.zeros(4, 6, dtype=torch.float64)}
    tx = fb.scale_by_soap()
    layout, other_layout = fb.FlatLayout.of(params), fb.FlatLayout.of(other)
    state = fb.fuse(tx, other_layout).init(other_layout.flatten(other))
    with pytest.raises(
        ValueError, match=f"state of the flat buffer '{re.escape(at('float64'))}' was made for another layout"
    ):
        fb.fuse(tx, layout).update(layout.flatten(grads[0]), state, layout.flatten(params))


def test_soap_inside_shard_is_refused_with_the_reason():
    params, grads = draws({"a": (6, 4)}, steps=1)
    layout = fb.FlatLayout.of(params)

    from functional_bagua import layout_context

    with pytest.raises(NotImplementedError, match="scale_by_soap cannot run inside shard"):
        layout_context.run_on_flat_buffers(ShardLike(), fb.scale_by_soap().init, layout.flatten(params))


# ---- compiled: one compile of the update, one of a fused train step (compiles cost seconds) -------

# full-rank statistics only: where a statistic is rank-deficient, its null-space eigenvectors are
# rounding's choice, and the compiled step (batched) rounds otherwise than the eager one (module
# docstring of functional_bagua.transforms.soap)
COMPILED_SHAPES = {"a": (5, 5), "b": (5, 5), "stack": (2, 3, 4), "bias": (4,), "scalar": ()}


def test_a_compiled_update_equals_the_eager_one_also_with_a_late_first_gradient():
    params, grads = draws(COMPILED_SHAPES, steps=7)
    # "b" gets its first gradient at step 2: in the compiled step it shares a batch with "a", each
    # row at its own count (its initialization, bias correction and refreshes its own)
    grads = [dict(g, b=None) if t < 2 else g for t, g in enumerate(grads)]
    tx = fb.soap(lr=1e-2, weight_decay=0.1, precondition_frequency=FREQUENCY)
    # dynamo's graphs (two: "b" absent, then present) run as traced, without AOT autograd or
    # inductor (a third of the time on 2 cores); inductor compiles SOAP in the fused train step and padded-stride tests
    compiled = torch.compile(tx.update, fullgraph=True, backend="eager")
    expected = trace(tx.update, tx.init(params), params, grads)
    got = trace(compiled, tx.init(params), params, grads)
    # on CUDA inductor's products and cuBLAS's differ in the last bits, and the eigenbases move by
    # that rounding over the eigenvalues' gaps (7e-9 measured on an H200)
    tolerance = dict(rtol=1e-6, atol=1e-7) if ON_CUDA else dict(rtol=1e-12, atol=1e-14)
    for t, (want, have) in enumerate(zip(expected, got)):
        for k in params:
            torch.testing.assert_close(have[k], want[k], **tolerance, msg=lambda m: f"step {t} {k}: {m}")


def test_a_compiled_fused_train_step_equals_the_eager_unfused_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6)).double()
    batch = (torch.randn(64, 6, dtype=torch.float64), torch.randn(64, 6, dtype=torch.float64))
    tx = fb.soap(lr=1e-2, weight_decay=0.01, precondition_frequency=FREQUENCY)
    for t, loss, eager_loss, back, params in compiled_fused_and_eager_steps(model, tx, batch):
        torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
        # inductor rounds its products otherwise than eager; eigenvectors of close eigenvalues move
        # by rounding over the gap, and Adam in the eigenbasis amplifies what little they move
        # (on CUDA, cuBLAS's and inductor's products differ by more: 2e-7 at step 5)
        tolerance = dict(rtol=1e-5, atol=1e-6) if ON_CUDA else dict(rtol=1e-6, atol=1e-8)
        for k in params:
            torch.testing.assert_close(back[k], params[k], **tolerance, msg=lambda m: f"step {t} {k}: {m}")


def test_group_under_compile_is_refused_naming_the_way_out():
    tx = fb.scale_by_soap(group=object())  # refused before the group is used
    params, grads = draws({"a": (3, 3)}, steps=1)
    state = tx.init(params)
    with pytest.raises(Exception, match="group= shares its decompositions"):
        torch.compile(tx.update, fullgraph=True, backend="eager")(grads[0], state, params)
