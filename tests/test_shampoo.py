"""Shampoo (fb.shampoo, fb.scale_by_shampoo) against pytorch-optimizer's Shampoo where the two
coincide (the paper's algorithm: summed statistics, roots every step, no momentum, no grafting),
and against the module docstring's rule written out below, one block at a time, for blocking,
the filtered gradient, decayed statistics, a refresh period, a late start and each grafting
method; checkpoints and bad input."""

from __future__ import annotations

import itertools

import pytest
import torch
from devices import seeded

import functional_bagua as fb

try:
    import pytorch_optimizer
except ImportError:  # an optional test dependency (in the test extra)
    pytorch_optimizer = None

SHAPES = {"tall": (6, 4), "tall_twin": (6, 4), "square": (5, 5), "vector": (5,), "stack": (2, 3, 4)}


def draws(shapes: dict, steps: int, seed: int = 0) -> tuple[dict, list]:
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def run(tx, params: dict, grads: list) -> list:  # noqa: ANN001
    state, trace = tx.init(params), []
    for g in grads:
        u, state = tx.update(g, state, params)
        params = fb.apply_updates(params, u)
        trace.append(params)
    return trace


@pytest.mark.skipif(
    pytorch_optimizer is None, reason="pytorch-optimizer is not installed: pip install pytorch-optimizer"
)
def test_shampoo_equals_pytorch_optimizers_where_the_two_coincide():
    """Summed statistics from ``epsilon I``, inverse 2k-th roots every step, no momentum, no
    grafting: matrices, a vector and a 3-D tensor, 6 steps, to float64 rounding (its roots come
    from an SVD, ours from eigh)."""
    params, grads = draws(SHAPES, steps=6)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = pytorch_optimizer.Shampoo(
        list(ref.values()), lr=0.01, momentum=0.0, preconditioning_compute_steps=1, matrix_eps=1e-6
    )
    expected = []
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
        expected.append({k: p.detach().clone() for k, p in ref.items()})
    actual = run(fb.shampoo(lr=0.01, betas=(0.0, 1.0), epsilon=1e-6), params, grads)
    for t, (mine, theirs) in enumerate(zip(actual, expected)):
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-12, atol=1e-13, msg=lambda m: f"step {t} {k}: {m}")


def written_out(
    params: dict,
    grads: list,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    block: int,
    frequency: int,
    start: int,
    grafting,
    grafting_beta2: float = 0.999,
    grafting_eps: float = 1e-10,
) -> list:  # noqa: ANN001
    """The module docstring's rule, one tensor and one block at a time, in plain loops."""
    trace, params = [], dict(params)
    state = {}
    for t, g_all in enumerate(grads, start=1):
        new = {}
        for k, g in g_all.items():
            s = state.setdefault(k, {"m": torch.zeros_like(g), "v": torch.zeros_like(g), "L": {}, "R": {}})
            s["m"] = b1 * s["m"] + (1 - b1) * g
            m_hat = s["m"] / (1 - b1**t) if b1 > 0 else g
            if grafting == "adagrad":
                s["v"] = s["v"] + g * g
            elif grafting in ("rmsprop", "adam"):
                s["v"] = grafting_beta2 * s["v"] + (1 - grafting_beta2) * g * g
            graft = {
                None: m_hat,
                "sgd": m_hat,
                "adagrad": m_hat / (s["v"].sqrt() + grafting_eps),
                "rmsprop": m_hat / (s["v"].sqrt() + grafting_eps),
                "adam": m_hat / ((s["v"] / (1 - grafting_beta2**t)).sqrt() + grafting_eps),
            }[grafting]
            direction = torch.zeros_like(g)
            ranges = [[(a, min(a + block, n)) for a in range(0, n, block)] for n in g.shape]
            for corner in itertools.product(*ranges):
                index = tuple(slice(a, b) for a, b in corner)
                gb, mb = g[index], m_hat[index]
                order = gb.dim()
                pb = mb
                for d in range(order):
                    key = (corner, d)
                    unfolded = gb.movedim(d, 0).reshape(gb.shape[d], -1)
                    outer = unfolded @ unfolded.T
                    old = s["L"].get(key, torch.zeros_like(outer))
                    s["L"][key] = old + outer if b2 == 1 else b2 * old + (1 - b2) * outer
                    if t % frequency == 0:
                        corrected = s["L"][key] / (1 - b2**t) if b2 < 1 else s["L"][key]
                        values, vectors = torch.linalg.eigh(corrected)
                        s["R"][key] = vectors @ torch.diag((values + eps) ** (-1 / (2 * order))) @ vectors.T
                    pb = torch.tensordot(pb, s["R"][key], dims=([0], [0])) if t >= start else pb
                if t >= start:
                    if grafting is not None:
                        pb = pb * graft[index].norm() / (pb.norm() + 1e-16)
                    direction[index] = pb
                else:
                    direction[index] = graft[index]
            new[k] = params[k] - lr * direction
        params = new
        trace.append(params)
    return trace


CASES = {
    "blocks_filtered_decayed": dict(b1=0.9, b2=0.99, block=4, frequency=1, start=1, grafting=None),
    "refresh_every_2_from_3_adam": dict(b1=0.9, b2=1.0, block=3, frequency=2, start=4, grafting="adam"),
    "adagrad": dict(b1=0.0, b2=1.0, block=16, frequency=1, start=1, grafting="adagrad"),
    "rmsprop_blocks": dict(b1=0.5, b2=0.999, block=2, frequency=3, start=3, grafting="rmsprop"),
    "sgd": dict(b1=0.9, b2=1.0, block=5, frequency=1, start=2, grafting="sgd"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shampoo_equals_its_rule_written_out(case):
    c = CASES[case]
    params, grads = draws(SHAPES, steps=7)
    expected = written_out(
        params, grads, 0.01, c["b1"], c["b2"], 1e-8, c["block"], c["frequency"], c["start"], c["grafting"]
    )
    tx = fb.shampoo(
        lr=0.01,
        betas=(c["b1"], c["b2"]),
        epsilon=1e-8,
        max_preconditioner_dim=c["block"],
        precondition_frequency=c["frequency"],
        start_preconditioning_step=c["start"],
        grafting=c["grafting"],
    )
    for t, (mine, theirs) in enumerate(zip(run(tx, params, grads), expected)):
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"step {t} {k}: {m}")


def test_blocks_batched_across_tensors_step_as_each_alone():
    params, grads = draws(SHAPES, steps=5)
    tx = fb.shampoo(max_preconditioner_dim=3, grafting="adam", precondition_frequency=2)
    together = run(tx, params, grads)
    for k in SHAPES:
        alone = run(tx, {k: params[k]}, [{k: g[k]} for g in grads])
        for t in range(len(grads)):
            torch.testing.assert_close(together[t][k], alone[t][k], rtol=1e-13, atol=1e-15)


def test_merged_dims_precondition_the_merged_view():
    """A (2, 3, 4) tensor with merge_dims and blocks of 6 is the (6, 4) matrix of its values."""
    params, grads = draws({"t": (2, 3, 4)}, steps=4)
    merged = run(fb.shampoo(merge_dims=True, max_preconditioner_dim=6), params, grads)
    as_matrix = run(
        fb.shampoo(max_preconditioner_dim=6),
        {"t": params["t"].reshape(6, 4)},
        [{"t": g["t"].reshape(6, 4)} for g in grads],
    )
    for a, b in zip(merged, as_matrix):
        torch.testing.assert_close(a["t"].reshape(6, 4), b["t"], rtol=1e-13, atol=1e-15)


def test_a_checkpointed_state_resumes_bit_for_bit_and_a_state_for_other_blocks_is_refused():
    params, grads = draws({"w": (6, 4), "b": (4,)}, steps=8)
    tx = fb.shampoo(grafting="adam", max_preconditioner_dim=4, precondition_frequency=2)
    state, p = tx.init(params), params
    for g in grads[:4]:
        u, state = tx.update(g, state, p)
        p = fb.apply_updates(p, u)
    resumed = fb.load_state_dict(tx.init(params), fb.state_dict(state))
    p_a, s_a, p_b, s_b = p, state, p, resumed
    for g in grads[4:]:
        u_a, s_a = tx.update(g, s_a, p_a)
        u_b, s_b = tx.update(g, s_b, p_b)
        p_a, p_b = fb.apply_updates(p_a, u_a), fb.apply_updates(p_b, u_b)
    for k in p_a:
        assert torch.equal(p_a[k], p_b[k]), k
    with pytest.raises(ValueError, match=r"state of 'b' \(statistics .*\) was made for another parameter"):
        fb.shampoo(max_preconditioner_dim=3).update(grads[0], state, params)
    with pytest.raises(ValueError, match=r"state's 'graft' of 'b' does not fit these options"):
        fb.shampoo(max_preconditioner_dim=4, precondition_frequency=2).update(grads[0], state, params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_preconditioner_dim": 0}, "max_preconditioner_dim must be an int >= 1, got 0"),
        ({"precondition_frequency": 0}, "precondition_frequency must be an int >= 1, got 0"),
        ({"precondition_frequency": 4, "start_preconditioning_step": 2}, "start_preconditioning_step=2 comes before"),
        ({"b2": 0.0}, r"b2 must be in \(0, 1\], got 0.0"),
        ({"epsilon": 0.0}, "epsilon must be > 0"),
        ({"grafting": "lion"}, "grafting must be one of"),
        ({"root_method": "svd"}, r"root_method must be one of \('eigh', 'newton'\), got 'svd'"),
        ({"newton_iterations": 0}, "newton_iterations must be an int >= 1, got 0"),
        ({"newton_tolerance": 0.0}, "newton_tolerance must be > 0, got 0.0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fb.scale_by_shampoo(**kwargs)


def test_complex_parameters_are_refused_and_scalars_step():
    with pytest.raises(TypeError, match="complex"):
        fb.shampoo().init({"z": torch.zeros(2, dtype=torch.complex64)})
    params, grads = draws({"s": ()}, steps=3)
    trace = run(fb.shampoo(lr=0.1, betas=(0.0, 1.0), epsilon=1e-12), params, grads)
    # a scalar: its statistic is g^2 summed, its root (sum g^2)^(-1/2): AdaGrad's step
    total = torch.zeros((), dtype=torch.float64)
    expected = params["s"]
    for t, g in enumerate(grads):
        total = total + g["s"] ** 2
        expected = expected - 0.1 * g["s"] * (total + 1e-12) ** -0.5
        torch.testing.assert_close(trace[t]["s"], expected, rtol=1e-12, atol=1e-14)


def test_float32_statistics_of_less_than_full_rank_give_finite_steps():
    """One gradient of a 16 x 8 float32 matrix: its 16 x 16 statistic has rank 8, and rounding
    leaves some eigenvalues below 0 (beyond epsilon); the roots stay finite."""
    gen = seeded(0)
    params = {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(16, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(3)]
    trace = run(fb.shampoo(lr=3e-3, betas=(0.9, 0.999), grafting="adam"), params, grads)
    assert all(torch.isfinite(p).all() for step in trace for p in step.values())


# ---- the coupled Newton iteration for the inverse roots ------------------------------------------


def spd_batch(eigenvalues: list, seed: int) -> tuple:
    """Symmetric matrices ``Q diag(lambda) Q^T`` with the given eigenvalues (one list per matrix)."""
    gen = seeded(seed)
    n = len(eigenvalues[0])
    q = torch.linalg.qr(torch.randn(len(eigenvalues), n, n, generator=gen, dtype=torch.float64)).Q
    values = torch.tensor(eigenvalues, dtype=torch.float64)
    return q, values, (q * values.unsqueeze(-2)) @ q.mT


@pytest.mark.parametrize("root", [2, 4, 6])
def test_newton_inverse_roots_equal_the_roots_written_out(root, monkeypatch):
    from functional_bagua.transforms import shampoo
    from functional_bagua.transforms.shampoo import inverse_root_newton

    def no_fallback(*args):
        raise AssertionError("Newton's iteration left a matrix to eigh")

    monkeypatch.setattr(shampoo, "inverse_root", no_fallback)  # the iteration's own result
    q, values, a = spd_batch([[0.3, 1.0, 2.0, 7.0, 40.0], [1e-3, 0.1, 0.5, 0.9, 3.0]], seed=root)
    got = inverse_root_newton(a, 1e-9, root, torch.float64, iterations=60, tolerance=1e-13)
    expected = (q * (values + 1e-9).pow(-1.0 / root).unsqueeze(-2)) @ q.mT
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_newton_leaves_to_eigh_the_matrices_it_does_not_converge_on():
    """A statistic of rank 1 with epsilon far below its scale needs many more steps than given:
    that matrix takes eigh's root (bit for bit), the well-conditioned one keeps Newton's."""
    from functional_bagua.transforms.shampoo import inverse_root, inverse_root_newton

    _, _, a = spd_batch([[4.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], seed=0)
    got = inverse_root_newton(a, 1e-12, 4, torch.float64, iterations=10, tolerance=1e-10)
    eigh_roots = inverse_root(a, 1e-12, 4, torch.float64)
    assert torch.equal(got[0], inverse_root(a[:1], 1e-12, 4, torch.float64)[0])
    assert not torch.equal(got[1], eigh_roots[1])
    torch.testing.assert_close(got[1], eigh_roots[1], rtol=1e-9, atol=1e-12)


def test_shampoo_with_newton_roots_steps_as_with_eigh_roots():
    params, grads = draws({"w": (6, 4), "twin": (6, 4), "v": (5,)}, steps=8)
    options = dict(lr=1e-2, epsilon=1e-6, grafting="adam", precondition_frequency=2)
    eigh = run(fb.shampoo(**options), params, grads)
    newton = run(
        fb.shampoo(**options, root_method="newton", newton_tolerance=1e-12, newton_iterations=60), params, grads
    )
    for t, (want, got) in enumerate(zip(eigh, newton)):
        for k in params:
            torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=lambda m: f"step {t} {k}: {m}")
    assert any(not torch.equal(newton[-1][k], eigh[-1][k]) for k in params)  # the other method indeed
