"""fb.Optimizer over a transform built with numbers (``fb.Optimizer(params, fb.adamw(lr=1e-3))``):
its numbers in the param groups, driven by torch's lr schedulers as torch.optim's groups are
(reference: the torch.optim class with the same scheduler, and the factory form)."""

from __future__ import annotations

import copy

import pytest
import torch
from models import batches, default_dtype, eager_and_compiled_runs, loss_fn, make_model

import functional_bagua as fb
from functional_bagua.adjustable import Adjustable

DTYPE = torch.float64
STEPS = 8
TOL = dict(rtol=1e-12, atol=1e-14)

CLASSES = {
    "adamw": (torch.optim.AdamW, fb.adamw, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (torch.optim.Adam, fb.adam, dict(lr=1e-2, betas=(0.8, 0.99), amsgrad=True)),
    "sgd": (torch.optim.SGD, fb.sgd, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "rmsprop": (torch.optim.RMSprop, fb.rmsprop, dict(lr=1e-2, momentum=0.5)),
    "rprop": (torch.optim.Rprop, fb.rprop, dict(lr=1e-2)),
}


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)


def train(make_optimizer, make_scheduler=step_lr, steps=STEPS, model=None, optimizer=None, scheduler=None, start=0):
    with default_dtype(DTYPE):
        model = model or make_model("shapes", DTYPE)
        optimizer = optimizer or make_optimizer(model)
        scheduler = scheduler or make_scheduler(optimizer)
        for x, y in batches(start + steps, DTYPE)[start:]:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            scheduler.step()
    return model, optimizer, scheduler


def uninterrupted_and_resumed(make, make_fresh):
    """The model after STEPS steps with StepLR, and after half of them, a checkpoint (optimizer
    and scheduler), a fresh model and optimizer (``make_fresh``) loaded from it, and the rest."""
    whole, *_ = train(make)
    first, opt, sched = train(make, steps=STEPS // 2)
    saved, saved_sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    resumed = make_model("shapes", DTYPE, seed=3)
    resumed.load_state_dict(first.state_dict())
    opt2 = make_fresh(resumed)
    sched2 = step_lr(opt2)
    opt2.load_state_dict(saved)
    sched2.load_state_dict(saved_sched)
    train(None, model=resumed, optimizer=opt2, scheduler=sched2, steps=STEPS // 2, start=STEPS // 2)
    return whole, resumed


def assert_models_equal(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: largest difference {(p - q).abs().max().item()}"


def assert_models_close(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", CLASSES)
def test_a_scheduler_drives_a_built_alias_as_the_torch_class(name):
    """The group shows the alias's numbers; StepLR's lr reaches the update: the torch class's run."""
    torch_cls, factory, hyper = CLASSES[name]
    expected, *_ = train(lambda m: torch_cls(m.parameters(), **hyper))
    actual, opt, _ = train(lambda m: fb.Optimizer(m.parameters(), factory(**hyper), fused=False))
    assert_models_close(expected, actual)
    assert opt.param_groups[0]["lr"] == pytest.approx(hyper["lr"] * 0.5 ** (STEPS // 3))
    assert opt.param_groups[0]["initial_lr"] == hyper["lr"]


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_a_built_alias_with_a_kernel_runs_it_with_the_schedulers_lr(name):
    """torch's fused kernel, bit for bit, the scheduler's lr included."""
    torch_cls, factory, hyper = CLASSES[name]
    expected, *_ = train(lambda m: torch_cls(m.parameters(), fused=True, **hyper))
    actual, *_ = train(lambda m: fb.Optimizer(m.parameters(), factory(**hyper)))
    assert_models_equal(expected, actual)


def test_one_cycle_drives_lr_and_betas_of_an_alias_inside_a_chain():
    """A chain's alias shows its numbers: OneCycleLR cycles lr and betas[0] as it does
    torch.optim.AdamW's (the clipping bound is never reached, so the chain is AdamW)."""
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    expected, *_ = train(lambda m: torch.optim.AdamW(m.parameters(), **hyper), one_cycle)
    actual, opt, _ = train(
        lambda m: fb.Optimizer(m.parameters(), fb.chain(fb.clip_by_global_norm(1e6), fb.adamw(**hyper))), one_cycle
    )
    assert_models_close(expected, actual)
    assert opt.defaults["betas"] == (0.9, 0.99)  # where OneCycleLR looks for them


def test_an_inner_alias_shows_its_numbers_beside_its_wrappers():
    """lookahead(adamw) shows adamw's lr and its own alpha; with alpha 1 synced every step it is
    adamw, so StepLR gives torch.optim.AdamW's run."""
    expected, *_ = train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    actual, opt, _ = train(
        lambda m: fb.Optimizer(m.parameters(), fb.lookahead(fb.adamw(1e-2), sync_period=1, alpha=1.0), fused=False)
    )
    assert_models_close(expected, actual)
    assert {"lr", "betas", "alpha"} <= set(opt.param_groups[0])
    assert "sync_period" not in opt.param_groups[0]  # an int: structure, not a number a scheduler moves


def test_a_number_given_in_a_group_replaces_the_built_one():
    """As torch's groups override the defaults: the reference is torch.optim.SGD with the same groups."""

    def groups(m):
        return [{"params": [m.conv.weight, m.conv.bias], "lr": 0.05}, {"params": [m.fc.weight, m.fc.bias, m.scale]}]

    expected, *_ = train(lambda m: torch.optim.SGD(groups(m), lr=0.1, momentum=0.9))
    actual, opt, _ = train(lambda m: fb.Optimizer(groups(m), fb.sgd(0.1, momentum=0.9), fused=False))
    assert_models_close(expected, actual)
    assert [g["initial_lr"] for g in opt.param_groups] == [0.05, 0.1]


def test_groups_of_different_built_transforms_each_show_their_own():
    model = make_model("shapes", DTYPE)
    opt = fb.Optimizer(
        [
            {"params": model.conv.parameters(), "tx": fb.adamw(3e-3)},
            {"params": model.fc.parameters(), "tx": fb.chain(fb.scale_by_adam(), fb.scale(-1e-3))},
            {"params": [model.scale], "tx": fb.sgd(0.2)},
        ]
    )
    shown = [{k: v for k, v in g.items() if k in ("lr", "betas", "momentum")} for g in opt.param_groups]
    assert shown == [{"lr": 3e-3, "betas": (0.9, 0.999)}, {}, {"lr": 0.2, "momentum": 0.0}]


def test_a_scheduler_on_a_group_without_lr_names_the_forms_that_show_one():
    """Building blocks show no lr: torch's scheduler reads group["lr"], and the KeyError says
    what the group shows and how to build one that shows an lr."""
    model = make_model("shapes", DTYPE)
    opt = fb.Optimizer(model.parameters(), fb.chain(fb.scale_by_adam(b1=0.8), fb.scale(-1e-3)))
    with pytest.raises(
        KeyError,
        match=r"holds no 'lr'; its transform shows no numbers.*"
        r"fb.scale_by_learning_rate\(1e-3\).*fb.Optimizer\(params, fb.adamw, lr=1e-3\)",
    ):
        torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    assert "lr" not in opt.param_groups[0] and opt.param_groups[0].get("lr") is None


def test_a_compiled_step_over_groups_without_numbers_is_the_eager_one():
    """torch.compile(opt.step) traces the groups (which name what they miss) as the eager step runs
    them, to a rounding: eagerly the chain's last factor is added with ``alpha`` in one pass, the
    traced step scales the updates, then adds them."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make_model("shapes", DTYPE)
        opt = fb.Optimizer(model.parameters(), fb.chain(fb.scale_by_adam(), fb.scale(-1e-2)))
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for x, y in batches(3, DTYPE):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            step()
        runs.append(model)
    assert_models_close(*runs)


def test_a_compiled_step_compiles_once_more_at_the_first_change_then_reads_the_tensor():
    """The first lr change builds the transform again with a tensor lr (one new graph); the
    later ones are written into it (no new graph), and the run is the eager one (to a rounding:
    eagerly the learning rate is added with ``alpha``, the traced step scales, then adds)."""
    with default_dtype(DTYPE):  # after step 2: the step after the first change
        eager, compiled, graphs, graphs_at_the_end = eager_and_compiled_runs(
            lambda model: fb.Optimizer(model.parameters(), fb.adamw(1e-2), fused=False), STEPS, DTYPE, graphs_after=2
        )
    assert graphs_at_the_end == graphs
    assert_models_close(eager, compiled)


def test_a_checkpoint_resumes_the_scheduled_run_bit_for_bit():
    def make(m):
        return fb.Optimizer(m.parameters(), fb.adamw(1e-2), fused=False)

    whole, resumed = uninterrupted_and_resumed(make, make)
    assert_models_equal(whole, resumed)


def test_a_change_that_needs_another_state_is_refused_by_name():
    """fb.sgd(momentum=0) keeps no buffer: momentum set after its state is made raises, naming
    it; set before the first step, the state is made with the buffer (torch.optim.SGD's run)."""
    model = make_model("shapes", DTYPE)
    opt = fb.Optimizer(model.parameters(), fb.sgd(0.1))
    train(None, model=model, optimizer=opt, scheduler=step_lr(opt), steps=1)
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"\['momentum'\] changed to \[0.9\].*fb.Optimizer\(params, fb.sgd"):
        train(None, model=model, optimizer=opt, scheduler=step_lr(opt), steps=1, start=1)

    def set_momentum(opt):
        opt.param_groups[0]["momentum"] = 0.9
        return step_lr(opt)

    expected, *_ = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), set_momentum)
    actual, *_ = train(lambda m: fb.Optimizer(m.parameters(), fb.sgd(0.1), fused=False), set_momentum)
    assert_models_close(expected, actual)


def test_an_optax_style_chain_takes_a_scheduler_through_scale_by_learning_rate():
    """chain(scale_by_adam(), scale_by_learning_rate(lr)) shows lr, and StepLR gives
    torch.optim.Adam's run."""
    expected, *_ = train(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    tx = fb.chain(fb.scale_by_adam(), fb.scale_by_learning_rate(1e-2))
    actual, opt, _ = train(lambda m: fb.Optimizer(m.parameters(), tx))
    assert_models_close(expected, actual)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** (STEPS // 3))


def test_a_tensor_learning_rate_changed_in_place_reaches_scale_by_learning_rate():
    lr = torch.tensor(0.5, dtype=DTYPE)
    tx = fb.scale_by_learning_rate(lr)
    g = {"w": torch.ones(2, dtype=DTYPE)}
    first, _ = tx.update(g, tx.init(g))
    lr.fill_(0.25)
    second, _ = tx.update(g, tx.init(g))
    assert first["w"].tolist() == [-0.5, -0.5] and second["w"].tolist() == [-0.25, -0.25]


def test_numbers_two_aliases_share_are_not_adjustable():
    """Which alias's lr a scheduler meant is unknown: neither is shown (each alias's own are)."""
    found = Adjustable.of(fb.chain(fb.adamw(1e-3), fb.sgd(0.1, momentum=0.9)))
    assert found is not None
    assert "lr" not in found.numbers and found.numbers["momentum"] == 0.9 and found.numbers["eps"] == 1e-8
    assert Adjustable.of(fb.chain(fb.scale_by_adam(), fb.scale(-1e-3))) is None


def test_a_tensor_hyperparameter_changed_in_place_reaches_the_next_update():
    """The functional alias reads a tensor lr at every update, as torch.optim.AdamW does."""
    lr = torch.tensor(1e-2, dtype=DTYPE)
    torch_lr = torch.tensor(1e-2, dtype=DTYPE)
    tx = fb.adamw(lr=lr)
    with default_dtype(DTYPE):
        model, reference = make_model("shapes", DTYPE), make_model("shapes", DTYPE)
        opt = torch.optim.AdamW(reference.parameters(), lr=torch_lr)
        state = tx.init(fb.params_of(model))
        for i, (x, y) in enumerate(batches(4, DTYPE)):
            lr.fill_(1e-2 / (i + 1))
            torch_lr.fill_(1e-2 / (i + 1))
            opt.zero_grad()
            loss_fn(reference(x), y).backward()
            opt.step()
            params = fb.params_of(model)
            grads = torch.func.grad(lambda p: loss_fn(torch.func.functional_call(model, p, (x,)), y))(params)
            updates, state = tx.update(grads, state, params)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(fb.apply_updates(params, updates)[name])
    assert_models_close(reference, model)


def test_a_deep_copy_runs_on_its_own_numbers_after_a_change():
    """The copy's transform reads the copy's tensors: setting its lr to 0 freezes it, the
    original moves on with its own (reference: the copy left as it was)."""
    for make in (lambda: fb.sgd(0.1), lambda: fb.sgd(torch.tensor(0.1, dtype=DTYPE))):
        model, opt, sched = train(lambda m: fb.Optimizer(m.parameters(), make(), fused=False), steps=4)
        twin = copy.deepcopy(model)
        opt2 = copy.deepcopy(opt)
        opt2.param_groups[0]["params"] = list(twin.parameters())
        lr = opt2.param_groups[0]["lr"]
        if isinstance(lr, torch.Tensor):
            lr.fill_(0.0)
        else:
            opt2.param_groups[0]["lr"] = 0.0
        frozen = [p.clone() for p in twin.parameters()]
        train(None, model=twin, optimizer=opt2, scheduler=step_lr(opt2), steps=2, start=4)
        assert all(torch.equal(p, q) for p, q in zip(twin.parameters(), frozen))
        before = [p.clone() for p in model.parameters()]
        train(None, model=model, optimizer=opt, scheduler=sched, steps=2, start=4)
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_grad_scaler_with_a_tensor_lr_in_a_built_group_steps_as_torchs():
    """A tensor lr in the group has no fused kernel: the scaler is told so, and unscales."""

    def run(make):
        with default_dtype(torch.float32):
            model = make_model("shapes", torch.float32)
            opt = make(model)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            for x, y in batches(3, torch.float32):
                opt.zero_grad()
                scaler.scale(loss_fn(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
        return model

    def ours(m):
        opt = fb.Optimizer(m.parameters(), fb.sgd(0.1))
        opt.param_groups[0]["lr"] = torch.tensor(0.1)
        return opt

    expected = run(lambda m: torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1)))
    for p, q in zip(run(ours).parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_numbers_set_before_the_first_step_resume_bit_for_bit():
    """fb.sgd(0.1) given momentum 0.9 in its group before its first step keeps a momentum buffer;
    a checkpoint of it loads into a fresh one (built the same way) and resumes exactly."""

    def make(m):
        opt = fb.Optimizer(m.parameters(), fb.sgd(0.1), fused=False)
        opt.param_groups[0]["momentum"] = 0.9
        return opt

    whole, resumed = uninterrupted_and_resumed(make, lambda m: fb.Optimizer(m.parameters(), fb.sgd(0.1), fused=False))
    assert_models_equal(whole, resumed)


def test_a_resumed_run_reads_its_numbers_from_tensors_as_the_saved_one_did():
    """betas changed and set back before the checkpoint: the saved run reads them from tensors,
    so the resumed one must too, though its numbers equal those built (the same bits)."""

    def make(m):
        return fb.Optimizer(m.parameters(), fb.adam(1e-2, betas=(0.9, 0.999)), fused=False)

    def betas_there_and_back(opt):
        opt.param_groups[0]["betas"] = (0.8, 0.99)
        return step_lr(opt)

    model, opt, sched = train(make, betas_there_and_back, steps=1)
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    whole = copy.deepcopy(model)
    whole_opt = copy.deepcopy(opt)
    whole_opt.param_groups[0]["params"] = list(whole.parameters())
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["numbers_as_tensors"] == ["betas"]
    resumed = copy.deepcopy(model)
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    train(None, model=whole, optimizer=whole_opt, scheduler=step_lr(whole_opt), steps=3, start=1)
    train(None, model=resumed, optimizer=opt2, scheduler=step_lr(opt2), steps=3, start=1)
    assert_models_equal(whole, resumed)


def test_numpy_numbers_in_a_group_are_numbers():
    """As torch.optim takes them; a numpy lr keeps torch's fused kernel (bit for bit)."""
    np = pytest.importorskip("numpy", reason="numpy numbers")
    expected, *_ = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), lambda o: _set_lr(o, np.float32(0.05)))
    actual, *_ = train(
        lambda m: fb.Optimizer(m.parameters(), fb.sgd(0.1), fused=False), lambda o: _set_lr(o, np.float32(0.05))
    )
    assert_models_close(expected, actual)
    fused, *_ = train(
        lambda m: torch.optim.Adam(m.parameters(), lr=0.1, fused=True), lambda o: _set_lr(o, np.float32(0.05))
    )
    ours, opt, _ = train(
        lambda m: fb.Optimizer(m.parameters(), fb.adam(0.1), fused=True), lambda o: _set_lr(o, np.float32(0.05))
    )
    assert opt._kernel(0) is not None
    assert_models_equal(fused, ours)


def test_the_step_unscales_where_grad_scaler_left_it_a_kernel_that_is_not_there():
    """GradScaler hands grad_scale / found_inf to an optimizer that said its step takes them; a
    group on the pure path then unscales as the scaler would (times the float32 reciprocal), in
    each gradient's shape and dtype (a 0-dim and a bfloat16 parameter here), and skips on an inf."""
    params = [torch.nn.Parameter(torch.tensor(1.5)), torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]
    grads = [torch.tensor(64.0), torch.full((3,), 32.0, dtype=torch.bfloat16)]
    scale = torch.full((1,), 16.0)
    inverse = scale.double().reciprocal().float().reshape(())  # GradScaler's inv_scale, one number
    expected = [p.detach() - 0.1 * (g * inverse).to(p.dtype) for p, g in zip(params, grads)]
    opt = fb.Optimizer(params, fb.sgd(0.1), fused=False)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.grad_scale, opt.found_inf = scale, torch.zeros(1)
    opt.step()
    for p, e in zip(params, expected):
        assert p.dtype == e.dtype and torch.equal(p.detach(), e)
    opt.found_inf = torch.ones(1)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def _set_lr(opt, value):
    opt.param_groups[0]["lr"] = value
    return step_lr(opt)


@pytest.mark.parametrize(
    "name, value, says",
    [("lr", -1.0, "Invalid learning rate"), ("betas", (0.9, 1.5), "beta"), ("lr", "fast", "a number")],
)
def test_a_bad_value_written_later_is_refused_by_name_and_nothing_changes(name, value, says):
    model, opt, _ = train(lambda m: fb.Optimizer(m.parameters(), fb.adam(1e-2), fused=False), steps=2)
    opt.param_groups[0]["lr"] = 5e-3  # a first change: the lr is a tensor from now on
    train(None, model=model, optimizer=opt, scheduler=step_lr(opt), steps=1, start=2)
    opt.param_groups[0][name] = value
    before = [p.clone() for p in model.parameters()]
    with pytest.raises((ValueError, TypeError), match=says):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
