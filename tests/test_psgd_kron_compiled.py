"""PSGD-Kron compiled and fused, each against a second code path: inside fb.fuse (flat buffers,
state stacked per shape) against the unfused update, both drawing their probes from one stream;
compiled (torch.compile, make_train_step) against the eager update, the probes drawn by torch's
own randn in both (the transform's standard_normal operator) from the same seed; a fused state
through a checkpoint; what it refuses."""

from __future__ import annotations

import re

import optree
import pytest
import torch
from devices import at, seeded
from second_order_helpers import ShardLike, draws, fused_trace, resumed_and_uninterrupted, trace

import functional_bagua as fb
from functional_bagua.transforms import psgd_kron

# shapes one size apart (a gather), back to back (a view), merged, a vector, a scalar, an empty one
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
OPTIONS = [
    {},
    {"memory_save_mode": "one_diag", "min_ndim_triangular": 1},
    # the preconditioner updates every step until step 2, then less often; balanced every 2nd update
    {"momentum_into_precond_update": False, "flat_start": 2, "decay": 0.5, "balance_every": 2},
]


class ProbeStream:
    """Probes from one deterministic stream, each draw taking the next numbers: the same values
    whether drawn tensor by tensor or for a flat buffer of the tensors at once."""

    def __init__(self) -> None:
        self.drawn = 0

    def __call__(self, shape, dtype, device) -> torch.Tensor:  # noqa: ANN001
        numel = torch.Size(shape).numel()
        values = torch.sin(0.7 * torch.arange(self.drawn, self.drawn + numel, dtype=dtype, device=device))
        self.drawn += numel
        return values.reshape(shape)


@pytest.mark.parametrize("options", OPTIONS, ids=["defaults", "one_diag", "annealed_balanced_gradient_fit"])
def test_fused_psgd_kron_equals_unfused_psgd_kron(options, monkeypatch):
    params, grads = draws(FUSED_SHAPES, steps=8)
    tx = fb.psgd_kron(lr=1e-2, precond_dtype=torch.float64, **options)
    monkeypatch.setattr(psgd_kron, "draw_probe", ProbeStream())
    expected = trace(tx.update, tx.init(params), params, grads)
    monkeypatch.setattr(psgd_kron, "draw_probe", ProbeStream())
    got = fused_trace(tx, params, grads)
    for t, (want, back) in enumerate(zip(expected, got)):
        for k in params:
            torch.testing.assert_close(back[k], want[k], rtol=1e-13, atol=1e-15, msg=lambda m: f"step {t} {k}: {m}")


def test_a_fused_state_is_stacked_per_shape_and_resumes_from_a_checkpoint_bit_for_bit():
    params, grads = draws(FUSED_SHAPES, steps=6)
    layout = fb.FlatLayout.of(params)
    tx = fb.fuse(fb.psgd_kron(lr=1e-2, **OPTIONS[2]), layout)
    flat = layout.flatten(params)
    state = tx.init(flat)
    (key,) = layout.keys
    direction = state[0]
    groups = {shape: rows.number for shape, rows in layout.shape_groups(key)}
    assert groups[(6, 4)] == 3  # "a", "b" and "c" in one batch, though "square" lies between them
    j = list(groups).index((6, 4))
    assert tuple(direction.mu[key][j].shape) == (3, 6, 4)
    assert [tuple(q.shape) for q in direction.factors[key][j]] == [(3, 6, 6), (3, 4, 4)]
    torch.manual_seed(1)
    p, p_loaded = resumed_and_uninterrupted(tx, layout, params, grads, seed=lambda t: torch.manual_seed(10 + t))
    assert torch.equal(p[key], p_loaded[key])


def test_a_fused_state_for_another_layout_is_refused():
    params, grads = draws({"a": (6, 4), "b": (5, 5)}, steps=1)
    other = {"a": torch.zeros(6, 4, dtype=torch.float64), "b": torch.zeros(4, 6, dtype=torch.float64)}
    tx = fb.scale_by_psgd_kron()
    layout, other_layout = fb.FlatLayout.of(params), fb.FlatLayout.of(other)
    state = fb.fuse(tx, other_layout).init(other_layout.flatten(other))
    with pytest.raises(
        ValueError, match=f"state of the flat buffer '{re.escape(at('float64'))}' was made for another layout"
    ):
        fb.fuse(tx, layout).update(layout.flatten(grads[0]), state, layout.flatten(params))


def test_inside_shard_and_with_weight_decay_inside_fuse_it_is_refused_with_the_reason():
    params, _ = draws({"a": (6, 4)}, steps=1)
    layout = fb.FlatLayout.of(params)

    from functional_bagua import layout_context

    with pytest.raises(NotImplementedError, match="scale_by_psgd_kron cannot run inside shard"):
        layout_context.run_on_flat_buffers(ShardLike(), fb.scale_by_psgd_kron().init, layout.flatten(params))
    # the alias decays only tensors of two or more dimensions: a mask a flat buffer cannot carry
    with pytest.raises(NotImplementedError, match="masked cannot run inside fuse"):
        fb.fuse(fb.psgd_kron(weight_decay=0.1), layout).init(layout.flatten(params))


# ---- compiled: one compile of the update, one of a fused train step (compiles cost seconds) -------

COMPILED_SHAPES = {"a": (5, 5), "b": (5, 5), "tall": (6, 3), "bias": (4,), "scalar": ()}


def test_a_compiled_update_equals_the_eager_one_also_with_a_late_first_gradient():
    params, grads = draws(COMPILED_SHAPES, steps=7)
    # "b" gets its first gradient at step 2: in the compiled step it shares a batch with "a", each
    # row at its own count (its momentum's bias correction its own)
    grads = [dict(g, b=None) if t < 2 else g for t, g in enumerate(grads)]
    tx = fb.psgd_kron(lr=1e-2, weight_decay=0.1, precond_dtype=torch.float64, **OPTIONS[2])
    # dynamo's graphs (two: "b" absent, then present) run as traced, without AOT autograd or
    # inductor (a third of the time on 2 cores); inductor compiles this update in the dynamic-shapes and symbolic-float
    # tests of test_second_order_edges.py and in the fused train step below
    compiled = torch.compile(tx.update, fullgraph=True, backend="eager")
    eager_state, state = tx.init(params), tx.init(params)
    eager_params = params
    for t, g in enumerate(grads):
        torch.manual_seed(t)
        u, eager_state = tx.update(g, eager_state, eager_params)
        eager_params = fb.apply_updates(eager_params, u)
        torch.manual_seed(t)
        u, state = compiled(g, state, params)
        params = fb.apply_updates(params, u)
        for k in params:
            torch.testing.assert_close(
                params[k], eager_params[k], rtol=1e-12, atol=1e-14, msg=lambda m: f"{t} {k}: {m}"
            )
        # the factors too: balancing them leaves the preconditioner, and so the parameters, as they are
        for have, want in zip(optree.tree_leaves(state[0].factors), optree.tree_leaves(eager_state[0].factors)):
            torch.testing.assert_close(have, want, rtol=1e-12, atol=1e-14)


# a GPT-2's shapes, scaled down (hidden 8, 2 layers, vocabulary 128, 32 positions), float32 as
# trained: vectors of one shape lying apart in the buffer, gathered inside the fit's torch.cond
GPT2_LIKE = [(128, 8), (32, 8)] + [
    (8,),
    (8,),
    (8, 24),
    (24,),
    (8, 8),
    (8,),
    (8,),
    (8,),
    (8, 32),
    (32,),
    (32, 8),
    (8,),
] * 2


def test_a_compiled_fused_update_equals_the_eager_fused_one_on_a_gpt2s_shapes():
    gen = seeded(0)
    params = {f"p{i:02d}": torch.randn(shape, generator=gen) / 10 for i, shape in enumerate(GPT2_LIKE)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(4)]
    layout = fb.FlatLayout.of(params)
    tx = fb.fuse(fb.psgd_kron(lr=1e-2), layout)

    def step(p: dict, s: object, g: dict) -> tuple:
        u, s = tx.update(g, s, p)
        return fb.apply_updates(p, u), s

    compiled = torch.compile(step, fullgraph=True)
    flat = layout.flatten(params)
    state, eager_flat, eager_state = tx.init(flat), flat, tx.init(flat)
    for t, g in enumerate(grads):
        torch.manual_seed(t)
        flat, state = compiled(flat, state, layout.flatten(g))
        torch.manual_seed(t)
        eager_flat, eager_state = step(eager_flat, eager_state, layout.flatten(g))
        for k in flat:  # inductor rounds its float32 kernels otherwise than eager torch
            torch.testing.assert_close(flat[k], eager_flat[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{t}: {m}")
