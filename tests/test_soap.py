"""SOAP (fb.soap, fb.scale_by_soap) against pytorch-optimizer's SOAP (the authors' algorithm;
an optional test dependency), step for step in float64 over several eigenbasis refreshes, and
against itself: batched against one tensor at a time, a late first gradient, checkpoints; bad
input."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE, ON_CUDA, seeded

import functional_bagua as fb

try:
    import pytorch_optimizer
except ImportError:  # an optional test dependency (in the test extra)
    pytorch_optimizer = None

needs_reference = pytest.mark.skipif(
    pytorch_optimizer is None,
    reason="pytorch-optimizer (the SOAP reference) is not installed: pip install pytorch-optimizer",
)

STEPS = 12
FREQUENCY = 3  # four eigenbasis refreshes in STEPS
SHAPES = {
    "square": (6, 6),
    "square_twin": (6, 6),  # batched with "square"
    "rectangular": (8, 4),  # a statistic of less than full rank at first: eigenvectors fixed by rounding
    "rectangular_twin": (8, 4),
    "wide": (3, 7),
    "conv": (4, 3, 3, 3),
    "stack": (2, 3, 4),
    "bias": (6,),
    "scalar": (),
}
OPTIONS = {
    "defaults": {},
    "small_blocks": {"max_precondition_dim": 5},
    "vectors_too": {"precondition_1d": True, "max_precondition_dim": 7},
    "normalized_no_bias_correction": {
        "normalize_gradient": True,
        "correct_bias": False,
        "shampoo_beta": 0.9,
        "betas": (0.9, 0.99),
    },
    "no_decay": {"weight_decay": 0.0, "lr": 0.01},
}
# the reference's merge_dims fails on a tensor whose merged view has one dimension (it reshapes to
# [1]): merged runs get tensors of two or more merged dimensions
MERGED_SHAPES = {"square": (6, 6), "conv": (4, 3, 3, 3), "conv_twin": (4, 3, 3, 3), "stack": (2, 3, 4), "tall": (8, 3)}


def draws(shapes: dict, dtype: torch.dtype, steps: int = STEPS, seed: int = 0) -> tuple[dict, list]:
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def reference_run(params: dict, grads: list, **options) -> list:  # noqa: ANN003
    """pytorch-optimizer's SOAP: the parameters after each step."""
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = pytorch_optimizer.SOAP(list(ours.values()), precondition_frequency=FREQUENCY, **options)
    trace = []
    for g in grads:
        for k, p in ours.items():
            p.grad = g[k].clone()
        opt.step()
        trace.append({k: p.detach().clone() for k, p in ours.items()})
    return trace


def our_run(params: dict, grads: list, **options) -> list:  # noqa: ANN003
    tx = fb.soap(precondition_frequency=FREQUENCY, **options)
    state = tx.init(params)
    trace = []
    for g in grads:
        u, state = tx.update(g, state, params)
        params = fb.apply_updates(params, u)
        trace.append(params)
    return trace


def assert_traces_close(actual: list, expected: list, rtol: float, atol: float) -> None:
    for t, (mine, theirs) in enumerate(zip(actual, expected)):
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], rtol=rtol, atol=atol, msg=lambda m: f"step {t} {k}: {m}")


@needs_reference
@pytest.mark.parametrize("case", list(OPTIONS))
def test_soap_equals_the_reference_step_for_step_in_float64(case):
    """Every option, 12 steps, the eigenbases refreshed four times, matrices square and not,
    conv kernels, a vector and a scalar: the same numbers as pytorch-optimizer's SOAP, to float64
    rounding until the first refresh, then to the float32 rounding of the refreshed eigenbases
    (both sides run the QR in float32; ours gets inputs equal to about 1e-16 and rounds a few of
    them the other way)."""
    params, grads = draws(SHAPES, torch.float64)
    expected = reference_run(params, grads, **OPTIONS[case])
    actual = our_run(params, grads, **OPTIONS[case])
    assert_traces_close(actual[:FREQUENCY], expected[:FREQUENCY], rtol=1e-12, atol=1e-13)
    assert_traces_close(actual, expected, rtol=1e-6, atol=1e-7)
    moved = [not torch.equal(expected[-1][k], params[k]) for k in SHAPES]
    assert all(moved)


@needs_reference
def test_merged_dimensions_equal_the_reference():
    params, grads = draws(MERGED_SHAPES, torch.float64)
    options = {"merge_dims": True, "max_precondition_dim": 12}
    assert_traces_close(our_run(params, grads, **options), reference_run(params, grads, **options), 1e-6, 1e-7)


@needs_reference
def test_float32_parameters_agree_with_the_reference_to_float32_rounding():
    params, grads = draws({k: SHAPES[k] for k in ("square", "conv", "bias")}, torch.float32, steps=6)
    assert_traces_close(our_run(params, grads), reference_run(params, grads), rtol=1e-4, atol=1e-5)


def test_float64_eigenbases_on_request_stay_close_to_the_float32_ones():
    params, grads = draws({k: SHAPES[k] for k in ("square", "conv")}, torch.float64, steps=8)
    exact = our_run(params, grads, matrix_dtype=torch.float64)
    default = our_run(params, grads)
    assert_traces_close(exact, default, rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(exact[-1][k], default[-1][k]) for k in exact[-1])


def test_tensors_batched_by_shape_step_as_each_alone():
    """Several tensors of one shape run as one batch; each gets what it gets alone."""
    params, grads = draws(SHAPES, torch.float64, steps=7)
    together = our_run(params, grads)
    for k in SHAPES:
        alone = our_run({k: params[k]}, [{k: g[k]} for g in grads])
        for t in range(len(grads)):
            if ON_CUDA:  # cuBLAS's batched products round with the batch size (float32 eigenbases)
                torch.testing.assert_close(together[t][k], alone[t][k], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(together[t][k], alone[t][k]), (k, t)


def test_a_late_first_gradient_initializes_then_and_steps_as_a_fresh_tensor():
    """A tensor without gradients for 3 steps (None, as torch.optim skips it) keeps its state,
    then initializes its preconditioner at its first gradient, as a fresh transform would."""
    params, grads = draws({"a": (5, 5), "b": (5, 5)}, torch.float64, steps=8)
    late = [{"a": g["a"], "b": None if t < 3 else g["b"]} for t, g in enumerate(grads)]
    trace = our_run(params, late)
    assert all(torch.equal(trace[t]["b"], params["b"]) for t in range(4))  # t=3: its first gradient, no step
    alone = our_run({"b": params["b"]}, [{"b": g["b"]} for g in grads[3:]])
    for t in range(3, len(grads)):
        assert torch.equal(trace[t]["b"], alone[t - 3]["b"]), t


def test_a_checkpointed_state_resumes_bit_for_bit():
    params, grads = draws({k: SHAPES[k] for k in ("square", "rectangular", "bias")}, torch.float64, steps=10)
    tx = fb.soap(precondition_frequency=FREQUENCY)
    state = tx.init(params)
    p = params
    for g in grads[:5]:
        u, state = tx.update(g, state, p)
        p = fb.apply_updates(p, u)
    resumed = fb.load_state_dict(tx.init(params), fb.state_dict(state))
    p_a, s_a, p_b, s_b = p, state, p, resumed
    for g in grads[5:]:
        u_a, s_a = tx.update(g, s_a, p_a)
        u_b, s_b = tx.update(g, s_b, p_b)
        p_a, p_b = fb.apply_updates(p_a, u_a), fb.apply_updates(p_b, u_b)
    for k in p_a:
        assert torch.equal(p_a[k], p_b[k]), k


def test_a_state_made_with_other_blocks_is_refused_naming_the_options():
    params, grads = draws({"w": (8, 4)}, torch.float64, steps=1)
    state = fb.soap(max_precondition_dim=5).init(params)
    with pytest.raises(ValueError, match=r"state of 'w' was made for another parameter or other options"):
        fb.soap().update(grads[0], state, params)
    other = fb.soap().init({"w": torch.zeros(4, 8, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"moments have shape \(4, 8\)"):
        fb.soap().update(grads[0], other, params)


def test_the_first_gradient_only_initializes_and_the_direction_is_the_formula_after():
    """The transform on its own: zero at the first gradient, then for a vector (no
    preconditioner) Adam's bias-corrected direction written out."""
    tx = fb.scale_by_soap(b1=0.9, b2=0.99, eps=1e-8)
    g1, g2 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 3.0, -0.5], dtype=torch.float64)
    state = tx.init({"v": torch.zeros(3, dtype=torch.float64)})
    u, state = tx.update({"v": g1}, state)
    assert torch.equal(u["v"], torch.zeros(3, dtype=torch.float64))
    u, state = tx.update({"v": g2}, state)
    m, v = 0.1 * g2, 0.01 * g2**2
    expected = m / (v.sqrt() + 1e-8) * ((1 - 0.99) ** 0.5 / (1 - 0.9))
    torch.testing.assert_close(u["v"], expected, rtol=1e-14, atol=0)


def test_eigenbases_hold_eigenvectors_by_decreasing_eigenvalue():
    params, grads = draws({"w": (5, 5)}, torch.float64, steps=1)
    tx = fb.scale_by_soap()
    _, state = tx.update(grads[0], tx.init(params))
    for statistic, basis in zip(state.statistics["w"], state.eigenbases["w"]):
        rotated = basis.T @ statistic @ basis
        torch.testing.assert_close(rotated, torch.diag(rotated.diagonal()), rtol=0, atol=1e-12)
        assert torch.all(rotated.diagonal()[:-1] >= rotated.diagonal()[1:])


def test_merge_small_dims_follows_the_authors_rule():
    from functional_bagua.transforms.soap import merge_small_dims

    assert merge_small_dims((64, 3, 3, 3), 100) == (64, 27)
    assert merge_small_dims((1, 2, 512, 1, 2048, 1, 3, 4), 1024) == (1024, 2048, 12)
    assert merge_small_dims((3, 4), 10000) == (12,)
    assert merge_small_dims((5000, 7), 100) == (5000, 7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"precondition_frequency": 0}, "precondition_frequency must be an int >= 1, got 0"),
        ({"max_precondition_dim": 0}, "max_precondition_dim must be an int >= 1, got 0"),
        ({"max_precondition_dim": 2.5}, "max_precondition_dim must be an int >= 1, got 2.5"),
        ({"b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
        ({"shampoo_beta": -0.1}, r"shampoo_beta must be in \[0, 1\), got -0.1"),
        ({"eps": -1.0}, "eps must be >= 0, got -1.0"),
        ({"matrix_dtype": torch.int32}, "matrix_dtype must be None, torch.float32 or torch.float64"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fb.scale_by_soap(**kwargs)


def test_complex_parameters_and_a_wrong_state_are_refused():
    with pytest.raises(TypeError, match="complex"):
        fb.soap().init({"z": torch.zeros(2, 2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="expected ScaleBySoapState"):
        fb.scale_by_soap().update({"w": torch.zeros(2)}, fb.adam().init({"w": torch.zeros(2)}))


def test_fb_optimizer_under_a_torch_scheduler_equals_the_functional_update_with_a_schedule():
    """A torch.optim loop (fb.Optimizer, StepLR halving the lr each step) and the functional
    update with the same lr as a schedule of the step count: the same parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(16, 6, dtype=torch.float64)
    opt = fb.Optimizer(model.parameters(), fb.soap(lr=3e-3, precondition_frequency=2))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    tx = fb.soap(lr=lambda t: 3e-3 * 0.5**t, precondition_frequency=2)
    params = dict(start)
    state = tx.init(params)
    for _ in range(5):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        scheduler.step()
        grads = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square().mean())(params)
        u, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, u)
    assert opt.param_groups[0]["lr"] == 3e-3 * 0.5**5
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[k], rtol=1e-12, atol=1e-14)
        assert not torch.equal(params[k], start[k])


def test_an_eager_train_step_trains():  # compiled steps: tests/test_soap_compiled.py
    with torch.device("cpu"):  # the same model and batch on every test device
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        batch = (torch.randn(16, 8), torch.randn(16, 2))
    model.to(DEVICE)
    batch = tuple(b.to(DEVICE) for b in batch)
    tx = fb.soap(lr=1e-2, precondition_frequency=2)
    params = fb.params_of(model)
    eager = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, compile=False)
    state, losses = tx.init(params), []
    for _ in range(10):
        params, state, loss = eager(params, state, batch)
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[1]


# ---- in chains and wrappers: each against the same work written by hand -----------------------


def run(tx, params: dict, grads: list) -> list:  # noqa: ANN001
    state, trace = tx.init(params), []
    for g in grads:
        u, state = tx.update(g, state, params)
        params = fb.apply_updates(params, u)
        trace.append(params)
    return trace


def test_clipped_gradients_equal_soap_on_gradients_clipped_by_hand():
    params, grads = draws({"w": (5, 4), "b": (4,)}, torch.float64, steps=6)
    clipped = []
    for g in grads:
        norm = torch.sqrt(sum(t.square().sum() for t in g.values()))
        clipped.append({k: t * (0.5 / (norm + 1e-6)).clamp(max=1.0) for k, t in g.items()})  # clip_grad_norm_
    soap = fb.soap(precondition_frequency=2)
    chained = run(fb.chain(fb.clip_by_global_norm(0.5), soap), params, grads)
    by_hand = run(soap, params, clipped)
    for a, b in zip(chained, by_hand):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14)


def test_partition_sends_vectors_to_adamw_and_matrices_to_soap():
    params, grads = draws({"w": (5, 4), "v": (5, 4), "b": (4,)}, torch.float64, steps=5)
    labels = {"w": "soap", "v": "soap", "b": "adamw"}
    tx = fb.partition({"soap": fb.soap(precondition_frequency=2), "adamw": fb.adamw(1e-3)}, labels)
    together = run(tx, params, grads)
    matrices = run(
        fb.soap(precondition_frequency=2), {k: params[k] for k in "wv"}, [{k: g[k] for k in "wv"} for g in grads]
    )
    vectors = run(fb.adamw(1e-3), {"b": params["b"]}, [{"b": g["b"]} for g in grads])
    for t in range(len(grads)):
        for k in "wv":
            assert torch.equal(together[t][k], matrices[t][k]), (t, k)
        assert torch.equal(together[t]["b"], vectors[t]["b"]), t


def test_accumulated_micro_batches_equal_soap_on_their_mean():
    params, grads = draws({"w": (4, 4)}, torch.float64, steps=8)
    accumulated = run(fb.multi_steps(fb.soap(precondition_frequency=2), 2), params, grads)
    means = [{"w": (grads[t]["w"] + grads[t + 1]["w"]) / 2} for t in range(0, len(grads), 2)]
    stepped = run(fb.soap(precondition_frequency=2), params, means)
    for t in range(len(means)):
        torch.testing.assert_close(accumulated[2 * t + 1]["w"], stepped[t]["w"], rtol=1e-12, atol=1e-14)


def test_a_non_finite_gradient_is_skipped_with_the_state_kept():
    params, grads = draws({"w": (4, 3)}, torch.float64, steps=5)
    poisoned = list(grads)
    poisoned.insert(2, {"w": torch.full((4, 3), float("nan"), dtype=torch.float64)})
    guarded = run(fb.apply_if_finite(fb.soap(precondition_frequency=2), max_consecutive_errors=3), params, poisoned)
    clean = run(fb.soap(precondition_frequency=2), params, grads)
    assert torch.equal(guarded[2]["w"], guarded[1]["w"])
    for t_clean, t_guarded in ((0, 0), (1, 1), (2, 3), (3, 4), (4, 5)):
        assert torch.equal(guarded[t_guarded]["w"], clean[t_clean]["w"]), t_clean


def test_injected_hyperparameters_are_tensors_a_value_written_takes_effect():
    params, grads = draws({"w": (4, 4)}, torch.float64, steps=4)
    tx = fb.inject_hyperparams(fb.soap)(lr=3e-3, precondition_frequency=2)
    state = tx.init(params)
    p = params
    for g in grads[:3]:
        u, state = tx.update(g, state, p)
        p = fb.apply_updates(p, u)
    state.hyperparams["lr"].fill_(0.0)  # the decay is lr * weight_decay: nothing moves
    u, _ = tx.update(grads[3], state, p)
    assert torch.equal(u["w"], torch.zeros_like(u["w"]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: fb.soap(precondition_frequency=2),
        lambda: fb.shampoo(grafting="adam", precondition_frequency=2),
        lambda: fb.psgd_kron(),
    ],
    ids=["soap", "shampoo", "psgd_kron"],
)
def test_second_order_optimizers_resume_from_torch_state_dicts(make):
    """fb.Optimizer's state_dict (torch's format) of each second-order transform loads into a
    new optimizer, which then steps as the original (the same probes for PSGD-Kron)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    opt = fb.Optimizer(model.parameters(), make())

    def step(m, o):  # noqa: ANN001
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    for _ in range(3):
        step(model, opt)
    resumed_model = copy.deepcopy(model)
    resumed = fb.Optimizer(resumed_model.parameters(), make())
    resumed.load_state_dict(opt.state_dict())
    for t in range(3):
        torch.manual_seed(t)
        step(model, opt)
        torch.manual_seed(t)
        step(resumed_model, resumed)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
