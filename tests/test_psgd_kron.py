"""PSGD-Kron (fb.psgd_kron, fb.scale_by_psgd_kron) against the kron-torch package (an optional
test dependency: it requires triton, so it is not in the test extra), step for step in float64
with the same probe draws, run eagerly; the factors' balancing, the update schedule and bad input
against rules written out here."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
from devices import seeded

import functional_bagua as fb
from functional_bagua.transforms.psgd_kron import balanced, merged_shape, precondition, update_probability

try:
    import kron_torch
except ImportError:
    kron_torch = None

# names in sorted order: a dict's leaves are taken in key order, and the probes are drawn per
# tensor in that order, as the reference draws them in its parameter list's order
SHAPES = {"a_tall": (6, 4), "b_square": (5, 5), "c_vector": (5,), "d_stack": (2, 3, 4), "e_tall": (6, 4)}
OPTIONS = {
    "defaults": {},
    "one_diag": {"memory_save_mode": "one_diag"},
    "all_diag_gradient_fit": {"memory_save_mode": "all_diag", "momentum_into_precond_update": False},
    "vectors_triangular_small_max": {"min_ndim_triangular": 1, "max_size_triangular": 5, "precond_init_scale": 2.0},
}


def draws(steps: int, seed: int = 0) -> tuple[dict, list]:
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


@pytest.mark.skipif(
    kron_torch is None, reason="kron-torch (the PSGD-Kron reference) is not installed: pip install kron-torch"
)
@pytest.mark.parametrize("case", list(OPTIONS))
def test_psgd_kron_equals_kron_torch_step_for_step(case):
    """12 steps (the reference balances its factors first at step 20 with its seed), weight
    decay on the matrices, a merged 3-D tensor, a vector and two matrices of one shape (one
    batch here), each option: the same numbers to the float32 rounding of the reference's
    triangular solves. (Its scalars fail: it permutes a 0-dim probe.)"""
    params, grads = draws(steps=12)
    options = OPTIONS[case]
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = kron_torch.Kron(list(ref.values()), lr=1e-3, weight_decay=0.1, precond_dtype=torch.float64, **options)
    tx = fb.psgd_kron(lr=1e-3, weight_decay=0.1, precond_dtype=torch.float64, **options)
    state, p = tx.init(params), params
    with torch.compiler.set_stance("force_eager"):
        for t, g in enumerate(grads):
            for k, q in ref.items():
                q.grad = g[k].clone()
            torch.manual_seed(100 + t)
            with contextlib.redirect_stdout(io.StringIO()):  # it prints its memory use
                opt.step()
            torch.manual_seed(100 + t)
            u, state = tx.update(g, state, p)
            p = fb.apply_updates(p, u)
            for k in SHAPES:
                torch.testing.assert_close(
                    p[k], ref[k].detach(), rtol=1e-6, atol=1e-8, msg=lambda m: f"step {t} {k}: {m}"
                )
    assert all(not torch.equal(p[k], params[k]) for k in SHAPES)


def kron(qs: list) -> torch.Tensor:
    out = torch.ones(1, 1, dtype=qs[0].dtype)
    for q in qs:
        out = torch.kron(out, q.T @ q)
    return out


def test_balancing_keeps_the_preconditioner():
    gen = seeded(1)
    qs = [
        torch.triu(torch.randn(3, 3, generator=gen, dtype=torch.float64)) * 5,
        torch.triu(torch.randn(4, 4, generator=gen, dtype=torch.float64)),
    ]
    rebalanced = [q[0] for q in balanced([q.unsqueeze(0) for q in qs])]  # a batch of one
    torch.testing.assert_close(kron(rebalanced), kron(qs), rtol=1e-12, atol=1e-12)
    norms = [q.abs().max().item() for q in rebalanced]
    assert math.isclose(norms[0], norms[1], rel_tol=1e-12)


def test_preconditioning_is_the_kronecker_product_written_out():
    gen = seeded(2)
    qs = [
        torch.triu(torch.randn(3, 3, generator=gen, dtype=torch.float64)),
        torch.triu(torch.randn(4, 4, generator=gen, dtype=torch.float64)),
    ]
    g = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    expected = (kron(qs) @ g.reshape(-1)).reshape(3, 4)
    batched = precondition(g.unsqueeze(0), [q.unsqueeze(0) for q in qs])[0]  # a batch of one
    torch.testing.assert_close(batched, expected, rtol=1e-12, atol=1e-12)


def test_the_update_schedule_and_the_merged_views_follow_the_reference_rules():
    assert update_probability(0) == 1.0 and update_probability(499) == 1.0
    assert math.isclose(update_probability(1500), math.exp(-1.0))
    assert update_probability(10**6) == 0.03
    # the reference compares the signed differences of the two sides: (12, 2) (-10) beats (4, 6) (2)
    assert merged_shape((2, 3, 4)) == (6, 4) and merged_shape((4, 3, 2)) == (12, 2) and merged_shape((5, 7)) == (5, 7)
    # past the flat start at probability 1/4: the preconditioner updates every 4th step
    tx = fb.scale_by_psgd_kron(max_prob=0.25, min_prob=0.25, flat_start=0)
    params = {"w": torch.zeros(3, 3, dtype=torch.float64)}
    state, seen = tx.init(params), []
    for _ in range(12):
        _, state = tx.update({"w": torch.randn(3, 3, dtype=torch.float64)}, state, params)
        seen.append(int(state.preconditioner_updates))
    assert seen == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"memory_save_mode": "some_diag"}, "memory_save_mode must be one of"),
        ({"b1": 1.0}, r"b1 must be in \[0, 1\)"),
        ({"precond_lr": 0.0}, "precond_lr must be > 0"),
        ({"max_size_triangular": 0}, "max_size_triangular must be an int >= 1"),
        ({"min_prob": 0.5, "max_prob": 0.25}, "need 0 < min_prob <= max_prob <= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fb.scale_by_psgd_kron(**kwargs)


def test_a_state_for_other_shapes_and_complex_parameters_are_refused():
    params, grads = draws(steps=1)
    state = fb.psgd_kron().init({k: v.T.contiguous() if v.dim() == 2 else v for k, v in params.items()})
    with pytest.raises(ValueError, match=r"state of 'a_tall' was made for another parameter"):
        fb.psgd_kron().update(grads[0], state, params)
    with pytest.raises(TypeError, match="complex"):
        fb.psgd_kron().init({"z": torch.zeros(2, 2, dtype=torch.complex64)})


def test_a_scalar_steps_as_a_one_element_vector():
    gen = seeded(3)
    grads = [torch.randn((), generator=gen, dtype=torch.float64) for _ in range(6)]
    runs = []
    for shape in ((), (1,)):
        tx = fb.psgd_kron(lr=1e-2, precond_dtype=torch.float64)
        params = {"s": torch.ones(shape, dtype=torch.float64)}
        state, trace = tx.init(params), []
        for t, g in enumerate(grads):
            torch.manual_seed(t)
            u, state = tx.update({"s": g.reshape(shape)}, state, params)
            params = fb.apply_updates(params, u)
            trace.append(params["s"].reshape(()))
        runs.append(trace)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(runs[0][-1], torch.ones((), dtype=torch.float64))
