"""Schedule-free AdamW and SGD against the authors' ``schedulefree`` package, step for step in
float64: the training weights ``y``, the evaluation weights ``x`` (the package's ``eval()``), and
``fb.Optimizer``'s ``train()`` / ``eval()`` swap; then the paths that must agree with the pure
update (fused, compiled, resumed from a checkpoint) and the refusals."""

from __future__ import annotations

import pytest
import torch
from devices import seeded
from helpers import assert_trees_close, run_resumed, run_updates

import functional_bagua as fb

schedulefree = pytest.importorskip(
    "schedulefree", reason="the authors' schedulefree package is the reference (an optional test dependency)"
)

SHAPES = {"scalar": (), "bias": (5,), "matrix": (5, 4)}
STEPS = 8
CASES = {  # name: (our alias, the reference's class, keyword arguments both take)
    "adamw": (
        fb.schedule_free_adamw,
        "AdamWScheduleFree",
        dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, warmup_steps=3, r=0.5, weight_lr_power=1.5),
    ),
    "sgd": (
        fb.schedule_free_sgd,
        "SGDScheduleFree",
        dict(lr=0.1, momentum=0.7, weight_decay=0.05, warmup_steps=2, r=1.0, weight_lr_power=2.0),
    ),
}


def problem(seed=0):
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def reference_run(case, params, grads, lr_at=None, foreach=True):
    """The package's optimizer over copies of ``params``: its ``y`` after the steps, then its
    ``x`` (after ``eval()``)."""
    _, cls_name, kwargs = CASES[case]
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = getattr(schedulefree, cls_name)(list(tensors.values()), foreach=foreach, **kwargs)
    opt.train()
    for t, g in enumerate(grads):
        if lr_at is not None:
            opt.param_groups[0]["lr"] = lr_at(t)
        for k, p in tensors.items():
            p.grad = g[k].clone()
        opt.step()
    y = {k: p.detach().clone() for k, p in tensors.items()}
    opt.eval()
    return y, {k: p.detach().clone() for k, p in tensors.items()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_aliases_step_and_evaluate_as_the_schedulefree_package(case, foreach):
    make, _, kwargs = CASES[case]
    params, grads = problem()
    want_y, want_x = reference_run(case, params, grads, foreach=foreach)
    y, state = run_updates(make(**kwargs), params, grads)
    assert_trees_close(y, want_y)
    x = fb.schedule_free_eval_params(state, y)
    assert_trees_close(x, want_x)
    assert_trees_close(fb.schedule_free_train_params(state, x), y)


@pytest.mark.cpu_only("fb.Optimizer steps y and z in place with Python numbers on the CPU only")
@pytest.mark.parametrize("case", list(CASES))
def test_beside_a_0_dim_parameter_fb_optimizer_steps_the_others_in_place_as_alone(case):
    """A 0-dim parameter (a learned scale) in the group: it takes the pure step, its update
    added, and the vector beside it is stepped in place (``y.lerp_(z, c)``, ...) bit for bit
    as in a group of its own (float32: the whole group's pure update would round otherwise);
    both as the package's optimizer to float32 rounding."""
    make, cls_name, kwargs = CASES[case]
    gen = seeded(7)
    scale, vector = torch.randn((), generator=gen), torch.randn(300, generator=gen)
    grads = [(torch.randn((), generator=gen), torch.randn(300, generator=gen)) for _ in range(STEPS)]
    both, theirs = ([torch.nn.Parameter(scale.clone()), torch.nn.Parameter(vector.clone())] for _ in range(2))
    alone = torch.nn.Parameter(vector.clone())
    reference = getattr(schedulefree, cls_name)(theirs, **kwargs)
    reference.train()
    optimizers = [fb.Optimizer(both, make(**kwargs)), fb.Optimizer([alone], make(**kwargs)), reference]
    for g_scale, g_vector in grads:
        for p, g in zip((*both, *theirs, alone), (g_scale, g_vector, g_scale, g_vector, g_vector)):
            p.grad = g.clone()
        for opt in optimizers:
            opt.step()
        assert torch.equal(both[1].detach(), alone.detach())
    for ours, want in zip(both, theirs):
        torch.testing.assert_close(ours.detach(), want.detach(), rtol=1e-5, atol=1e-6)


def test_a_learning_rate_schedule_is_the_reference_with_its_lr_set_before_each_step():
    """The averaging weights follow the largest scheduled rate so far (lr_max), as the reference
    reads its group's lr at each step."""
    schedule = fb.schedules.linear(0.05, 0.005, STEPS)
    params, grads = problem(1)
    want_y, want_x = reference_run("adamw", params, grads, lr_at=lambda t: schedule(t).item())
    kwargs = {**CASES["adamw"][2], "lr": schedule}
    y, state = run_updates(fb.schedule_free_adamw(**kwargs), params, grads)
    assert_trees_close(y, want_y)
    assert_trees_close(fb.schedule_free_eval_params(state, y), want_x)


def test_a_missing_gradient_keeps_its_tensor_while_the_count_advances_as_the_reference():
    """Schedule-free SGD with one tensor's gradient missing (None) at some steps: that tensor
    keeps its z and parameter, and the averaging weights follow the count of every step, as the
    reference's param group counts them."""
    params, grads = problem(4)
    missing = next(iter(params))
    grads = [{**g, missing: None} if t % 2 else g for t, g in enumerate(grads)]
    kwargs = CASES["sgd"][2]
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    reference = schedulefree.SGDScheduleFree(list(tensors.values()), **kwargs)
    reference.train()
    for g in grads:
        for k, p in tensors.items():
            p.grad = None if g[k] is None else g[k].clone()
        reference.step()
    got, _ = run_updates(fb.schedule_free_sgd(**kwargs), params, grads)
    assert_trees_close(got, {k: p.detach() for k, p in tensors.items()})


def test_the_wrapper_around_a_chosen_direction_is_the_alias():
    """fb.schedule_free over the building blocks the alias is made of, written out by hand."""
    params, grads = problem(2)
    direction = fb.chain(fb.scale_by_bias_corrected_rms(0.99, 1e-6), fb.add_decayed_weights(0.1))
    kwargs = CASES["adamw"][2]
    built = fb.schedule_free(direction, 0.02, 0.8, warmup_steps=3, r=0.5, weight_lr_power=1.5)
    got, _ = run_updates(built, params, grads)
    want, _ = run_updates(fb.schedule_free_adamw(**kwargs), params, grads)
    assert_trees_close(got, want, tol=0)


def models():
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    return make(), make()


def test_fb_optimizer_swaps_weights_for_evaluation_and_resumes_from_an_eval_mode_checkpoint():
    """fb.Optimizer's train()/eval() move the model's weights as the package's do; a state dict
    saved in evaluation mode (as the package asks) loads into a new optimizer and model, and the
    run goes on as the reference's uninterrupted one."""
    ref_model, model = models()
    kwargs = CASES["adamw"][2]
    reference = schedulefree.AdamWScheduleFree(ref_model.parameters(), **kwargs)
    reference.train()
    opt = fb.Optimizer(model.parameters(), fb.schedule_free_adamw, **kwargs)
    gen = seeded(3)
    batches = [
        (torch.randn(16, 4, generator=gen).double(), torch.randn(16, 1, generator=gen).double()) for _ in range(6)
    ]

    def step(m, o, batch):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(batch[0]), batch[1]).backward()
        o.step()

    for batch in batches[:3]:
        step(ref_model, reference, batch)
        step(model, opt, batch)
    reference.eval()
    opt.eval()
    for (name, want), got in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13, msg=lambda m: f"eval {name}: {m}")
    saved_model, saved_opt = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()
    assert saved_opt["param_groups"][0]["train_mode"] is False

    _, resumed_model = models()
    resumed_model.load_state_dict(saved_model)
    resumed = fb.Optimizer(resumed_model.parameters(), fb.schedule_free_adamw, **kwargs)
    resumed.load_state_dict(saved_opt)
    with pytest.raises(RuntimeError, match=r"evaluation mode.*call optimizer.train\(\)"):
        step(resumed_model, resumed, batches[3])
    reference.train()
    resumed.train()
    for batch in batches[3:]:
        step(ref_model, reference, batch)
        step(resumed_model, resumed, batch)
    for (name, want), got in zip(ref_model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13, msg=lambda m: f"train {name}: {m}")


def test_fb_optimizer_train_and_eval_leave_other_transforms_alone():
    _, model = models()
    opt = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-2)
    torch.nn.functional.mse_loss(model(torch.ones(2, 4).double()), torch.zeros(2, 1).double()).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.eval()
    opt.step()  # nothing to refuse: no schedule-free group
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "train_mode" not in opt.param_groups[0]


def test_evaluation_weights_of_a_partition_are_each_groups_own():
    """Two schedule-free groups (decay and no decay) in one partition: each parameter's x from
    its own group's state, as two separate transforms give it."""
    params, grads = problem(6)
    labels = {"scalar": "no_decay", "bias": "no_decay", "matrix": "decay"}
    groups = {"decay": fb.schedule_free_adamw(0.02, weight_decay=0.1), "no_decay": fb.schedule_free_adamw(0.02)}
    y, state = run_updates(fb.partition(groups, labels), params, grads)
    x = fb.schedule_free_eval_params(state, y)
    for label, tx in groups.items():
        mine = [k for k, v in labels.items() if v == label]
        want_y, want_state = run_updates(tx, {k: params[k] for k in mine}, [{k: g[k] for k in mine} for g in grads])
        assert_trees_close({k: y[k] for k in mine}, want_y, tol=0)
        assert_trees_close({k: x[k] for k in mine}, fb.schedule_free_eval_params(want_state, want_y), tol=0)


def test_low_precision_evaluation_weights_round_once_as_the_reference():
    """bfloat16 parameters: x = lerp(y, z, 1 - 1/b1) with the weight as a Python number, as the
    reference's optimizer.eval() computes it (not rounded to bfloat16 first)."""
    y = torch.randn(1000, generator=seeded(7)).bfloat16()
    z = torch.randn(1000, generator=seeded(8)).bfloat16()
    tx = fb.schedule_free_sgd(momentum=0.9)
    state = tx.init({"w": z})
    x = fb.schedule_free_eval_params(state, {"w": y})["w"]
    assert torch.equal(x, y.clone().lerp_(z, 1 - 1 / 0.9))


def test_fused_over_flat_buffers_equals_the_tree():
    """fb.fuse runs the averaging once per flat buffer; the evaluation weights of the fused state
    over the buffers are those of the tree."""
    params, grads = problem(4)
    tx = fb.schedule_free_adamw(**CASES["adamw"][2])
    want_y, want_state = run_updates(tx, params, grads)
    layout = fb.FlatLayout.of(params)
    fused = fb.fuse(tx, layout)
    flat = layout.flatten(params)
    state = fused.init(flat)
    for g in grads:
        updates, state = fused.update(layout.flatten(g), state, flat)
        flat = fb.apply_updates(flat, updates)
    assert_trees_close(layout.unflatten(flat), want_y)
    x = layout.unflatten(fb.schedule_free_eval_params(state, flat))
    assert_trees_close(x, fb.schedule_free_eval_params(want_state, want_y))


def test_a_checkpoint_mid_run_resumes_bit_for_bit():
    params, grads = problem(5)
    tx = fb.schedule_free_sgd(**CASES["sgd"][2])
    want, _ = run_updates(tx, params, grads)
    got, _ = run_resumed(tx, params, grads, at=3)
    assert_trees_close(got, want, tol=0)


def test_a_compiled_train_step_over_flat_buffers_equals_the_eager_tree_step():
    def run(compile, flat):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
        tx = fb.schedule_free_adamw(lr=0.01, warmup_steps=2, weight_decay=0.01)
        params = fb.params_of(model)
        layout = fb.FlatLayout.of(params) if flat else None
        params = layout.flatten(params) if flat else params
        state = (fb.fuse(tx, layout) if flat else tx).init(params)
        step = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, compile=compile, layout=layout)
        gen = seeded(6)
        for _ in range(4):
            params, state, _ = step(
                params, state, (torch.randn(8, 3, generator=gen).double(), torch.randn(8, 1, generator=gen).double())
            )
        return layout.unflatten(params) if flat else params

    assert_trees_close(run({"backend": "aot_eager"}, True), run(False, False), tol=1e-12)


def test_bad_input_is_refused_with_the_way_out():
    params, grads = problem()
    with pytest.raises(ValueError, match="no schedule-free state"):
        fb.schedule_free_eval_params(fb.adamw().init(params), params)
    with pytest.raises(ValueError, match="takes a step of its own"):
        fb.schedule_free(fb.adamw(1e-3))
    with pytest.raises(ValueError, match="takes a step of its own"):
        fb.schedule_free(fb.chain(fb.scale_by_adam(), fb.scale_by_learning_rate(1e-3)))
    with pytest.raises(ValueError, match=r"b1 must lie in \(0, 1\)"):
        fb.schedule_free(fb.identity(), b1=0.0)
    with pytest.raises(ValueError, match=r"momentum must lie in \(0, 1\)"):
        fb.schedule_free_sgd(momentum=1.0)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fb.schedule_free_adamw(lr=-1.0)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        fb.schedule_free_adamw(warmup_steps=-1)
    with pytest.raises(ValueError, match="z.*params|params.*z"):
        fb.schedule_free_eval_params(fb.schedule_free_sgd().init(params), params["matrix"])
    with pytest.raises(ValueError, match="takes a step of its own .scale_by_laprop"):
        fb.schedule_free(fb.scale_by_laprop(1e-3))
    with pytest.raises(ValueError, match="needs the parameters"):
        tx = fb.schedule_free_sgd()
        tx.update(grads[0], tx.init(params))
