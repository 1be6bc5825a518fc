"""master_weights: bfloat16 and float16 parameters stepped through a float32 master copy (against
the same transform on float32 parameters, and torch.optim on a float32 copy), or through
stochastic rounding (each step one of the two neighbours of the float32 sum, unbiased over many
draws, deterministic for a seed); checkpoints, compiled steps, fb.Optimizer, bad input."""

from __future__ import annotations

import optree
import pytest
import torch
from devices import DEVICE, seeded
from helpers import assert_trees_equal, run_resumed, run_updates

import functional_bagua as fb
from functional_bagua.transforms.schedule_free import schedule_free_states

STEPS = 12


def problem(seed, dtypes=(torch.bfloat16, torch.float16, torch.float32)):
    """Parameters of each dtype in ``dtypes`` (two shapes each) and STEPS gradient trees in them."""
    gen = seeded(seed)
    shapes = {"w": (16, 8), "b": (8,)}
    params = {f"{k}_{str(d)[6:]}": torch.randn(s, generator=gen).to(d) for d in dtypes for k, s in shapes.items()}
    grads = [{k: torch.randn(p.shape, generator=gen).to(p.dtype) for k, p in params.items()} for _ in range(STEPS)]
    return params, grads


def adamw():
    return fb.adamw(1e-2, weight_decay=0.1)


def test_float32_mode_is_the_transform_on_float32_parameters_rounded():
    """Each low-precision parameter is the rounding of its master copy, and the master copy is,
    bit for bit, the parameter the same transform gives a float32 run fed the same gradients;
    float32 parameters are the transform's own."""
    params, grads = problem(0)
    got, state = run_updates(fb.master_weights(adamw()), params, grads)
    as_float32 = {k: v.float() for k, v in params.items()}
    want, _ = run_updates(adamw(), as_float32, [{k: v.float() for k, v in g.items()} for g in grads])
    for k, p in params.items():
        assert got[k].dtype == p.dtype
        if p.dtype == torch.float32:
            assert torch.equal(got[k], want[k]) and state.master[k] is None
        else:
            assert torch.equal(state.master[k], want[k]), k
            assert torch.equal(got[k], want[k].to(p.dtype)), k


def test_float32_mode_follows_torch_adamw_on_a_float32_copy():
    """torch.optim.AdamW stepping float32 copies of bfloat16 parameters on the bfloat16 gradients:
    the same trajectory (to float32 rounding: torch decays before its step, ours within it)."""
    params, grads = problem(1, dtypes=(torch.bfloat16,))
    got, state = run_updates(fb.master_weights(adamw()), params, grads)
    copies = {k: torch.nn.Parameter(v.float()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(copies.values()), lr=1e-2, weight_decay=0.1)
    for g in grads:
        for k, p in copies.items():
            p.grad = g[k].float()
        opt.step()
    for k, p in copies.items():
        torch.testing.assert_close(state.master[k], p.detach(), rtol=1e-5, atol=1e-6)


def test_plain_bfloat16_steps_lose_what_the_master_copy_keeps():
    """The case it exists for: updates below half a bfloat16 step leave a bfloat16 parameter
    where it is, and move it through the master copy."""
    params = {"w": torch.ones(256, dtype=torch.bfloat16)}
    grads = [{"w": torch.full((256,), 1.0, dtype=torch.bfloat16)}] * 40
    plain, _ = run_updates(fb.sgd(1e-4), params, grads)
    kept, state = run_updates(fb.master_weights(fb.sgd(1e-4)), params, grads)
    assert torch.equal(plain["w"], params["w"])  # 1 - 1e-4 rounds back to 1 every step
    assert torch.allclose(state.master["w"], torch.full((256,), 1 - 40e-4), atol=1e-6)
    assert torch.equal(kept["w"], state.master["w"].to(torch.bfloat16)) and bool((kept["w"] < 1).all())


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values below and above each float32 ``x`` (equal where ``x`` is one)."""
    down = x.to(torch.bfloat16)  # to nearest, then the one on the other side where needed
    below = torch.where(down.float() > x, torch.nextafter(down, torch.tensor(-float("inf"), dtype=down.dtype)), down)
    above = torch.where(down.float() < x, torch.nextafter(down, torch.tensor(float("inf"), dtype=down.dtype)), down)
    return below, above


def test_stochastic_rounding_lands_on_a_neighbour_of_the_float32_step_and_is_deterministic():
    params, grads = problem(2, dtypes=(torch.bfloat16, torch.float32))
    tx = fb.master_weights(adamw(), "stochastic_rounding", seed=3)
    state = tx.init(params)
    for g in grads[:4]:
        updates, new_state = tx.update(g, state, params)
        inner_updates, _ = adamw().update(
            {k: v.float() for k, v in g.items()}, state.inner, {k: v.float() for k, v in params.items()}
        )
        new_params = fb.apply_updates(params, updates)
        for k, p in params.items():
            exact = p.float() + inner_updates[k]
            if p.dtype == torch.float32:
                assert torch.equal(new_params[k], exact)
                continue
            below, above = neighbours(exact)
            assert bool(((new_params[k] == below) | (new_params[k] == above)).all()), k
        params, state = new_params, new_state
    again, _ = run_updates(tx, problem(2, dtypes=(torch.bfloat16, torch.float32))[0], grads[:4])
    assert_trees_equal(again, params)
    other, _ = run_updates(
        fb.master_weights(adamw(), "stochastic_rounding", seed=4),
        problem(2, (torch.bfloat16, torch.float32))[0],
        grads[:4],
    )
    assert not torch.equal(other["w_bfloat16"], params["w_bfloat16"])


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_stalls():
    """4096 bfloat16 ones stepped by -1e-4 fifty times: to nearest they never move (half a step
    below 1 is 2^-9); stochastically their mean follows 1 - 50e-4 within five standard errors of a
    sum of independent roundings (each step rounds down with probability 1e-4 / 2^-8), and the
    share never moved is that of independent draws."""
    n, steps, step = 4096, 50, 1e-4
    params = {"w": torch.ones(n, dtype=torch.bfloat16)}
    grads = [{"w": torch.ones(n, dtype=torch.bfloat16)}] * steps
    got, _ = run_updates(fb.master_weights(fb.sgd(step), "stochastic_rounding"), params, grads)
    ulp = 2.0**-8
    p = step / ulp
    per_element_std = ulp * (steps * p * (1 - p)) ** 0.5
    mean = got["w"].double().mean().item()
    assert abs(mean - (1 - steps * step)) < 5 * per_element_std / n**0.5
    # a fresh draw each step: an element stays at 1 only if every one of the 50 roundings went up
    # ((1 - p)^50 of them, binomially); draws repeated across steps would leave 1 - p of them
    stayed = (got["w"] == 1).double().mean().item()
    never = (1 - p) ** steps
    assert abs(stayed - never) < 5 * (never * (1 - never) / n) ** 0.5


@pytest.mark.parametrize("mode", ["float32", "stochastic_rounding"])
def test_a_checkpoint_resumes_bit_for_bit(mode):
    params, grads = problem(5, dtypes=(torch.bfloat16, torch.float32))
    tx = lambda: fb.master_weights(adamw(), mode, seed=11)  # noqa: E731
    want, _ = run_updates(tx(), params, grads)
    got, saved = run_resumed(tx(), params, grads, at=STEPS // 2)
    assert_trees_equal(got, want)
    assert any("master" in k for k in saved) == (mode == "float32")


def test_inside_fb_optimizer_on_a_bfloat16_model_as_the_pure_update():
    params, grads = problem(6, dtypes=(torch.bfloat16,))
    want, _ = run_updates(fb.master_weights(adamw()), params, grads)
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = fb.Optimizer(tensors.values(), fb.master_weights(adamw()))
    for g in grads:
        for k, p in tensors.items():
            p.grad = g[k].clone()
        opt.step()
    assert_trees_equal({k: p.detach() for k, p in tensors.items()}, want)


def test_with_the_state_stored_in_bfloat16_it_is_that_transform_on_float32_parameters():
    """Composes with low_precision_state: the master copy is the float32 run of
    low_precision_state(adamw) itself, bit for bit."""
    params, grads = problem(7, dtypes=(torch.bfloat16,))
    inner = lambda: fb.low_precision_state(adamw(), "bf16", seed=2)  # noqa: E731
    _, state = run_updates(fb.master_weights(inner()), params, grads)
    want, _ = run_updates(
        inner(), {k: v.float() for k, v in params.items()}, [{k: v.float() for k, v in g.items()} for g in grads]
    )
    for k in params:
        assert torch.equal(state.master[k], want[k])


@pytest.mark.parametrize(
    "mode, dtype",
    [("float32", torch.bfloat16), ("float32", torch.float16), ("stochastic_rounding", torch.bfloat16)],
    ids=["float32-bfloat16", "float32-float16", "stochastic_rounding"],
)
def test_the_update_compiled_by_inductor_is_the_eager_one(mode, dtype):
    """Bit for bit, updates and state, with an inner transform whose compiled update is exact
    (SGD with momentum; Adam's divisions compile to other roundings): inductor folds a plain
    ``x.to(dtype).to(float32)`` away, which would return the unrounded step. On CUDA, Triton
    contracts a product and a sum into one fused multiply-add (one rounding where eager rounds
    twice) unless inductor emulates eager's precision casts, which turns that off (and keeps
    plain casts too: there the fold is the CPU run's to catch)."""
    params, grads = problem(8, dtypes=(dtype, torch.float32))
    tx = fb.master_weights(fb.sgd(0.3, momentum=0.9), mode)
    options = {"emulate_precision_casts": True} if DEVICE.type == "cuda" else None
    compiled = torch.compile(tx.update, fullgraph=True, options=options)
    state_c = state_e = tx.init(params)
    for g in grads[:3]:
        got, state_c = compiled(g, state_c, params)
        want, state_e = tx.update(g, state_e, params)
        assert_trees_equal(got, want)
        params = fb.apply_updates(params, want)
    assert_trees_equal(state_c, state_e)


def test_bad_input_is_refused_with_the_way_out():
    params = {"w": torch.zeros(3, dtype=torch.float16)}
    with pytest.raises(ValueError, match="mode must be one of"):
        fb.master_weights(adamw(), "fp32")
    with pytest.raises(ValueError, match="seed must be an int"):
        fb.master_weights(adamw(), "stochastic_rounding", seed=-1)
    with pytest.raises(TypeError, match="'w' is float16.*mode='float32'"):
        fb.master_weights(adamw(), "stochastic_rounding").init(params)
    tx = fb.master_weights(adamw())
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update({"w": torch.zeros(3, dtype=torch.float16)}, state)
    with pytest.raises(ValueError, match="expected MasterWeightsState"):
        tx.update({"w": torch.zeros(3, dtype=torch.float16)}, state.inner, params)


@pytest.mark.parametrize(
    "wrap",
    [lambda tx: fb.master_weights(tx), lambda tx: fb.low_precision_state(tx, "bf16+8bit")],
    ids=["master_weights", "low_precision_state"],
)
def test_fb_optimizer_shows_the_inner_alias_lr_for_schedulers(wrap):
    """Around an alias, the wrappers let fb.Optimizer show its lr: a scheduler that halves it
    halves the next SGD step (float32 parameters pass through both)."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = fb.Optimizer([p], wrap(fb.sgd(0.1)))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    moved = []
    for _ in range(2):
        before = p.detach().clone()
        p.grad = torch.ones(4)
        opt.step()
        scheduler.step()
        moved.append((before - p.detach())[0].item())
    assert opt.param_groups[0]["lr"] == 0.025
    assert moved[0] == pytest.approx(0.1) and moved[1] == pytest.approx(0.05)


def test_a_state_made_for_other_dtypes_is_refused():
    tx = fb.master_weights(adamw())
    state = tx.init({"w": torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="'w' is torch.float32, but the state was made for a bfloat16 or float16"):
        tx.update({"w": torch.zeros(3)}, state, {"w": torch.zeros(3)})


def test_schedule_free_inside_evaluates_at_the_float32_rule_and_resumes_its_trajectory():
    """``opt.eval()`` on a bfloat16 model under ``master_weights(schedule_free_adamw)``: each
    parameter at ``x = (y - (1 - b1) z) / b1`` computed in float32 from ``y`` (the parameter)
    and the float32 ``z``, rounded (within one bfloat16 step of the formula); after ``train()``
    the next step lands where a run that never left training lands, bit for bit (the master copy
    is the trajectory)."""
    params, grads = problem(9, dtypes=(torch.bfloat16,))
    b1 = 0.9

    def optimizer():
        tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
        tx = fb.master_weights(fb.schedule_free_adamw(1e-2, betas=(b1, 0.999), warmup_steps=2))
        return tensors, fb.Optimizer(tensors.values(), tx)

    cycled, opt = optimizer()
    straight, reference = optimizer()
    for step, g in enumerate(grads[:6]):
        for tensors, o in ((cycled, opt), (straight, reference)):
            for k, p in tensors.items():
                p.grad = g[k].clone()
            o.step()
        assert_trees_equal({k: p.detach() for k, p in cycled.items()}, {k: p.detach() for k, p in straight.items()})
        if step % 2:
            continue
        y = {k: p.detach().float() for k, p in cycled.items()}
        (found,) = schedule_free_states(opt._state(0))
        z = optree.tree_leaves(found.z)
        opt.eval()
        for i, (k, p) in enumerate(cycled.items()):
            want = (y[k] - (1 - b1) * z[i]) / b1
            assert p.dtype == torch.bfloat16
            assert bool(((p.detach().float() - want).abs() <= want.abs() * 2**-8 + 1e-30).all()), k
        opt.train()


def test_float16_loss_scaling_unscaled_inside_in_float32_is_the_unscaled_run():
    """The docstring's recipe for float16 (GradScaler refuses float16 gradients): gradients of a
    loss scaled by ``S = 2^10`` through ``chain(scale(1 / S), adamw)`` give the run on the
    unscaled gradients, bit for bit (a power of two scales exactly in float32)."""
    params, grads = problem(10, dtypes=(torch.float16,))
    want, _ = run_updates(fb.master_weights(adamw()), params, grads)
    scaled = [{k: (v.float() * 2**10).to(torch.float16) for k, v in g.items()} for g in grads]
    got, _ = run_updates(fb.master_weights(fb.chain(fb.scale(2.0**-10), adamw())), params, scaled)
    assert_trees_equal(got, want)
