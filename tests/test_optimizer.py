"""fb.Optimizer: a torch.optim.Optimizer over a chain, against the torch.optim classes (with lr
schedulers, param groups and GradScaler), the functional loop it wraps, and its own resumed run."""

from __future__ import annotations

import copy
import io

import optree
import pytest
import torch
from devices import DEVICE, ON_CUDA, seeded
from helpers import run_steps
from models import batches, default_dtype, eager_and_compiled_runs, loss_fn, make_model

import functional_bagua as fb
from functional_bagua.optimizer import _scalars_on_host
from functional_bagua.parameter_state import GroupLayout, Position, positions

DTYPE = torch.float64
STEPS = 8
TOL = dict(rtol=1e-12, atol=1e-14)  # the injected hyperparameters are float64 tensors, torch's Python floats

CLASSES = {
    "adamw": (torch.optim.AdamW, fb.adamw, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (torch.optim.Adam, fb.adam, dict(lr=1e-2, betas=(0.8, 0.99), amsgrad=True)),
    "sgd": (torch.optim.SGD, fb.sgd, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "rmsprop": (torch.optim.RMSprop, fb.rmsprop, dict(lr=1e-2, momentum=0.5)),
    "rprop": (torch.optim.Rprop, fb.rprop, dict(lr=1e-2)),  # step_sizes=(1e-6, 50): an int among floats
}
WITH_KERNEL = ("adamw", "adam", "sgd")  # torch has a fused kernel for these


def train(make_optimizer, steps=STEPS, scheduler=True, model=None, optimizer=None, start=0):
    """``steps`` steps of the usual loop (zero_grad, backward, step, scheduler step) on the test
    model; the model and optimizer at the end."""
    model = model or make_model("shapes", DTYPE)
    optimizer = optimizer or make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5) if scheduler else None
    for x, y in batches(start + steps, DTYPE)[start:]:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if sched is not None:
            sched.step()
    return model, optimizer


def assert_models_equal(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: largest difference {(p - q).abs().max().item()}"


def assert_resumes_bit_for_bit(make):
    """Half the steps, state_dict (holding every parameter's tensors), a fresh model and
    optimizer loaded from it, the other half: the uninterrupted run's weights."""
    whole, _ = train(make, scheduler=False)
    first, opt = train(make, steps=STEPS // 2, scheduler=False)
    saved = copy.deepcopy(opt.state_dict())
    assert sorted(saved["state"]) == list(range(len(list(first.parameters()))))
    resumed = make_model("shapes", DTYPE, seed=3)  # other weights: all come from the checkpoint
    resumed.load_state_dict(first.state_dict())
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    train(None, steps=STEPS // 2, scheduler=False, model=resumed, optimizer=opt2, start=STEPS // 2)
    assert_models_equal(whole, resumed)


def assert_models_close(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, **(tol or TOL), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", CLASSES)
def test_equals_the_torch_class_with_a_scheduler(name):
    """The pure update (fused=False) against the torch class's default (for-loop) step."""
    torch_cls, factory, hyper = CLASSES[name]
    with default_dtype(DTYPE):
        expected, _ = train(lambda m: torch_cls(m.parameters(), **hyper))
        actual, opt = train(lambda m: fb.Optimizer(m.parameters(), factory, fused=False, **hyper))
    assert_models_close(expected, actual)
    assert opt.param_groups[0]["lr"] == pytest.approx(hyper["lr"] * 0.5 ** (STEPS // 3))


@pytest.mark.parametrize("name", WITH_KERNEL)
def test_runs_torchs_fused_kernel_bit_for_bit(name):
    """By default an alias with a kernel runs it: the torch class with fused=True, bit for bit,
    the scheduler's lr included (read from the group at every step)."""
    torch_cls, factory, hyper = CLASSES[name]
    with default_dtype(DTYPE):
        expected, _ = train(lambda m: torch_cls(m.parameters(), fused=True, **hyper))
        actual, _ = train(lambda m: fb.Optimizer(m.parameters(), factory, **hyper))
        from_transform, _ = train(lambda m: fb.Optimizer(m.parameters(), factory(**hyper)), scheduler=False)
        expected_fixed_lr, _ = train(lambda m: torch_cls(m.parameters(), fused=True, **hyper), scheduler=False)
    assert_models_equal(expected, actual)
    assert_models_equal(expected_fixed_lr, from_transform)


@pytest.mark.parametrize(
    "cls, says",
    [
        (torch.optim.AdamW, r"fb.Optimizer\(params, fb.adamw, lr=...\)"),
        (torch.optim.SparseAdam, r"fb.Optimizer\(params, fb.sparse_adam"),
    ],
)
def test_a_torch_optimizer_class_as_tx_names_the_alias(cls, says):
    with pytest.raises(TypeError, match=f"tx is the optimizer class {cls.__name__}; pass its alias's factory, {says}"):
        fb.Optimizer(make_model("shapes", DTYPE).parameters(), cls, lr=1e-3)


def test_param_groups_override_hyperparameters_as_torchs_do():
    def groups(m):
        return [{"params": [m.conv.weight, m.conv.bias], "lr": 0.05}, {"params": [m.fc.weight, m.fc.bias, m.scale]}]

    with default_dtype(DTYPE):
        expected, _ = train(lambda m: torch.optim.SGD(groups(m), lr=0.1, momentum=0.9))
        actual, opt = train(lambda m: fb.Optimizer(groups(m), fb.sgd, lr=0.1, momentum=0.9))
    assert_models_close(expected, actual)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05 * 0.5**2, 0.1 * 0.5**2])


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_transform_runs_as_the_functional_loop_bit_for_bit(nested):
    """fb.Optimizer(params, chain) steps exactly as the functional loop by hand: the chain's
    links before its learning rate (``tx.update``), then their updates added with the rate as
    ``alpha``, ``p.add_(u, alpha=-lr)`` as torch.optim adds them; also where the chain ending in
    the rate sits inside another (``fb.chain(clip, fb.chain(..., rate))``)."""

    def make_tx():
        adamw = (fb.scale_by_adam(), fb.add_decayed_weights(0.01), fb.scale_by_learning_rate(1e-2))
        clip = fb.clip_by_global_norm(0.5)
        return fb.chain(clip, fb.chain(*adamw)) if nested else fb.chain(clip, *adamw)

    model, _ = train(lambda m: fb.Optimizer(m.parameters(), make_tx()), scheduler=False)
    reference = make_model("shapes", DTYPE)
    names = [name for name, _ in reference.named_parameters()]
    params = {Position(i): p for i, p in enumerate(fb.params_of(reference).values())}  # as the optimizer's
    before_the_rate = fb.chain(fb.clip_by_global_norm(0.5), fb.scale_by_adam(), fb.add_decayed_weights(0.01))
    state = on_host_as_the_optimizer_holds_it(before_the_rate.init(params), params)
    for x, y in batches(STEPS, DTYPE):

        def loss_of(ps, x=x, y=y):
            return loss_fn(torch.func.functional_call(reference, dict(zip(names, ps.values())), (x,)), y)

        updates, state = before_the_rate.update(torch.func.grad(loss_of)(params), state, params)
        params = {k: torch.add(p, updates[k], alpha=-1e-2) for k, p in params.items()}
    for i, p in enumerate(model.parameters()):
        assert torch.equal(p.detach(), params[i]), names[i]


def decay_labels(params):
    """AdamW's usual groups: no weight decay on biases and 0-dim scales."""
    return {name: "decay" if p.dim() > 1 else "no_decay" for name, p in params.items()}


def make_partition():
    return fb.partition(
        {"decay": fb.adamw(1e-2, weight_decay=0.1), "no_decay": fb.adamw(1e-2, weight_decay=0.0)}, decay_labels
    )


def test_a_partition_makes_one_group_per_label():
    """Over named_parameters(), a partition's labels name the groups: torch.optim.AdamW(fused=True)
    with the same two groups, bit for bit; and, pure, the partition's own functional loop."""

    def torch_groups(m):
        decay = [p for p in m.parameters() if p.dim() > 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in m.parameters() if p.dim() <= 1]}]

    with default_dtype(DTYPE):
        expected, _ = train(
            lambda m: torch.optim.AdamW(torch_groups(m), lr=1e-2, weight_decay=0.0, fused=True), scheduler=False
        )
        actual, opt = train(lambda m: fb.Optimizer(m.named_parameters(), make_partition()), scheduler=False)
        pure, _ = train(lambda m: fb.Optimizer(m.named_parameters(), make_partition(), fused=False), scheduler=False)
    assert_models_equal(expected, actual)
    assert [g["label"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert opt.param_groups[0]["param_names"] == ["conv.weight", "fc.weight"]

    with default_dtype(DTYPE):  # the initial weights of the runs above
        reference = make_model("shapes", DTYPE)
    names = [name for name, _ in reference.named_parameters()]
    params = fb.params_of(reference)
    tx = make_partition()
    state = tx.init(params)
    for x, y in batches(STEPS, DTYPE):

        def loss_of(ps, x=x, y=y):
            return loss_fn(torch.func.functional_call(reference, ps, (x,)), y)

        updates, state = tx.update(torch.func.grad(loss_of)(params), state, params)
        params = fb.apply_updates(params, updates)
    for name, p in zip(names, pure.parameters()):  # fb.Optimizer adds -lr u in one pass (alpha): a rounding apart
        torch.testing.assert_close(p.detach(), params[name], rtol=1e-13, atol=1e-15, msg=name)


def test_a_scheduler_drives_a_partitions_injected_hyperparameters():
    """Label transforms made by inject_hyperparams show their numbers in their groups, so a torch
    scheduler drives them: torch.optim.AdamW with the same two groups and StepLR."""

    def torch_groups(m):
        decay = [p for p in m.parameters() if p.dim() > 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in m.parameters() if p.dim() <= 1]}]

    adamw = fb.inject_hyperparams(fb.adamw)
    schedule_free = fb.partition(
        {"decay": adamw(lr=1e-2, weight_decay=0.1), "no_decay": adamw(lr=1e-2, weight_decay=0.0)}, decay_labels
    )
    with default_dtype(DTYPE):
        expected, _ = train(lambda m: torch.optim.AdamW(torch_groups(m), lr=1e-2, weight_decay=0.0))
        actual, opt = train(lambda m: fb.Optimizer(m.named_parameters(), schedule_free))
    assert_models_close(expected, actual)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 * 0.5 ** (STEPS // 3)] * 2)
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.1, 0.0])


def test_groups_with_their_own_transforms_and_no_default():
    """Each group runs its "tx": Adam on the convolution, SGD on the rest, as two torch optimizers."""

    def split(m):
        return [p for n, p in m.named_parameters() if n.startswith("conv")], [
            p for n, p in m.named_parameters() if not n.startswith("conv")
        ]

    class Both:  # two torch optimizers stepped as one
        def __init__(self, m):
            conv, rest = split(m)
            self.opts = [
                torch.optim.Adam(conv, lr=1e-2, fused=True),
                torch.optim.SGD(rest, lr=0.1, momentum=0.9, fused=True),
            ]

        def zero_grad(self):
            [o.zero_grad() for o in self.opts]

        def step(self):
            [o.step() for o in self.opts]

    def ours(m):
        conv, rest = split(m)
        return fb.Optimizer([{"params": conv, "tx": fb.adam(1e-2)}, {"params": rest, "tx": fb.sgd(0.1, momentum=0.9)}])

    with default_dtype(DTYPE):
        expected, _ = train(Both, scheduler=False)
        actual, _ = train(ours, scheduler=False)
    assert_models_equal(expected, actual)


def test_named_parameters_and_keys_of_their_own_in_groups():
    """torch's groups may carry names and keys no optimizer reads; the factory gets neither."""
    with default_dtype(DTYPE):
        expected, _ = train(lambda m: torch.optim.AdamW([{"params": m.parameters(), "name": "all"}], lr=1e-2))
        actual, opt = train(
            lambda m: fb.Optimizer([{"params": m.named_parameters(), "name": "all"}], fb.adamw, lr=1e-2, fused=False)
        )
    assert_models_close(expected, actual)
    assert opt.param_groups[0]["name"] == "all" and opt.param_groups[0]["param_names"][0] == "scale"


@pytest.mark.parametrize("name", WITH_KERNEL)
def test_a_group_of_mixed_dtypes_runs_the_kernel_per_dtype(name):
    """float32, float64 and bfloat16 parameters in one group: the torch class with fused=True."""
    torch_cls, factory, hyper = CLASSES[name]
    gen = seeded(0)
    shapes_and_dtypes = [
        ((3, 4), torch.float32),
        ((5,), torch.float64),
        ((2, 2), torch.bfloat16),
        ((6,), torch.float32),
    ]
    start = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in shapes_and_dtypes]
    grads = [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in start] for _ in range(3)]
    runs = []
    for make in (lambda ps: torch_cls(ps, fused=True, **hyper), lambda ps: fb.Optimizer(ps, factory, **hyper)):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = make(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append(params)
    for expected, actual in zip(*runs):
        assert torch.equal(expected, actual), expected.dtype


def test_grad_scaler_steps_as_with_the_torch_class():
    """torch.amp.GradScaler on the test device (under float16 autocast on CUDA): unscale_, the
    skipped step on an inf, the scale update, with clip_grad_norm_ and an lr scheduler in the loop."""

    def run(make_optimizer):
        torch.manual_seed(0)
        model = make_model("shapes", torch.float32)
        opt = make_optimizer(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**8, growth_interval=2)
        for i, (x, y) in enumerate(batches(STEPS, torch.float32)):
            opt.zero_grad()
            with torch.autocast(DEVICE.type, dtype=torch.float16, enabled=ON_CUDA):
                loss = loss_fn(model(x), y) * (float("inf") if i == 3 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
        return model, scaler.get_scale()

    expected, expected_scale = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    actual, scale = run(lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2, fused=False))
    assert scale == expected_scale
    assert_models_close(expected, actual, rtol=1e-6, atol=1e-7 if DEVICE.type == "cpu" else 1e-6)
    expected_fused, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True))
    actual_fused, _ = run(lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2))
    assert_models_equal(expected_fused, actual_fused)


@pytest.mark.parametrize(
    "make_torch, make_ours",
    [
        (
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
            lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2),
        ),
        (
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True),
            lambda m: fb.Optimizer(m.parameters(), fb.sgd, lr=0.1, momentum=0.9),
        ),
    ],
    ids=["adamw", "sgd-momentum"],
)
def test_grad_scaler_hands_the_scale_to_the_kernel_as_to_torchs_fused_class(make_torch, make_ours):
    """Without unscale_: the optimizer takes the scale and the inf flag in its step
    (_step_supports_amp_scaling, as torch's fused classes), so GradScaler does not unscale the
    gradients in a pass of its own; an inf step changes nothing and does not count. Bit for bit
    torch's fused class, the scale too."""

    def run(make_optimizer):
        torch.manual_seed(0)
        model = make_model("shapes", torch.float32)
        opt = make_optimizer(model)
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**8, growth_interval=2)
        unscaled = []  # the factors the scaler multiplied the gradients by (1.0: its inf check only)
        original = scaler._unscale_grads_
        scaler._unscale_grads_ = lambda opt, inv_scale, *a: (
            unscaled.append(float(inv_scale)) or original(opt, inv_scale, *a)
        )
        for i, (x, y) in enumerate(batches(STEPS, torch.float32)):
            opt.zero_grad()
            with torch.autocast(DEVICE.type, dtype=torch.float16, enabled=ON_CUDA):
                loss = loss_fn(model(x), y) * (float("inf") if i == 3 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return model, scaler.get_scale(), unscaled, opt

    expected, expected_scale, _, _ = run(make_torch)
    actual, scale, unscaled, opt = run(make_ours)
    assert opt._step_supports_amp_scaling and unscaled and set(unscaled) == {1.0}
    assert scale == expected_scale
    assert_models_equal(expected, actual)


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit():
    make = lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2, weight_decay=0.1)  # noqa: E731
    whole, _ = train(make, steps=STEPS, scheduler=False)
    first, opt = train(make, steps=STEPS // 2, scheduler=False)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = make_model("shapes", DTYPE, seed=3)  # other weights: all come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = make(resumed)
    opt2.load_state_dict(saved["opt"])
    train(make, steps=STEPS // 2, scheduler=False, model=resumed, optimizer=opt2, start=STEPS // 2)
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_a_checkpoint_loads_into_a_model_of_another_dtype_as_torchs_does():
    """Saved in float32, loaded after model.double(): torch casts the moments to float64, so do we."""

    def steps(model, opt, dtype, start, count):
        for x, y in batches(start + count, dtype)[start:]:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), lambda ps: fb.Optimizer(ps, fb.adamw, lr=1e-2)):
        model = make_model("shapes", torch.float32)
        opt = make(model.parameters())
        steps(model, opt, torch.float32, 0, 2)
        saved = copy.deepcopy(opt.state_dict())
        model.double()
        resumed = make(model.parameters())
        resumed.load_state_dict(saved)
        steps(model, resumed, torch.float64, 2, 2)
        runs.append(model)
    assert_models_equal(*runs)


ALIASES = ["adamw", "adam", "sgd", "rmsprop", "lion", "lamb", "adagrad", "adadelta", "adamax", "nadam", "radam"]
ALIASES += ["lars", "adafactor", "asgd", "rprop"]


@pytest.mark.parametrize("name", ALIASES)
def test_every_alias_resumes_bit_for_bit(name):
    """From a factory, each alias's state_dict holds every parameter's tensors and resumes exactly."""
    make = lambda m: fb.Optimizer(m.parameters(), getattr(fb, name), lr=1e-2)  # noqa: E731
    assert_resumes_bit_for_bit(make)


def test_state_dict_is_in_torchs_format():
    _, opt = train(lambda m: fb.Optimizer(m.parameters(), fb.adam, lr=1e-2), steps=2, scheduler=False)
    sd = opt.state_dict()
    n = len(opt.param_groups[0]["params"])
    assert sorted(sd["state"]) == list(range(n)) and sd["param_groups"][0]["params"] == list(range(n))
    assert {"mu", "nu", "count"} <= {key.split("/")[-1] for key in sd["state"][0]}
    assert sd["param_groups"][0]["betas"] == (0.9, 0.999)


def test_state_holds_each_parameters_tensors_as_torchs_does():
    """opt.state[p]: torch's fused AdamW's exp_avg and exp_avg_sq under the chain's names; an
    entry assigned there (what trainers do to move the state to a device) is the one the next
    step reads, and the run goes on as if nothing happened."""
    with default_dtype(DTYPE):
        expected, torch_opt = train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), steps=3)
        actual, opt = train(lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2), steps=3)
    assert len(opt.state) == len(list(actual.parameters()))
    for p, q in zip(expected.parameters(), actual.parameters()):
        mine = opt.state[q]
        mu, nu = (mine[name] for name in sorted(mine) if name.endswith(("/mu", "/nu")))
        assert torch.equal(mu, torch_opt.state[p]["exp_avg"]) and torch.equal(nu, torch_opt.state[p]["exp_avg_sq"])

    moved = {}
    for p, entries in opt.state.items():  # Lightning's _optimizer_to_device, to the same device
        for name, value in entries.items():
            entries[name] = moved[(p, name)] = value.clone()
    with default_dtype(DTYPE):
        train(None, steps=2, model=expected, optimizer=torch_opt, start=3)
        train(None, steps=2, model=actual, optimizer=opt, start=3)
    assert_models_equal(expected, actual)
    assert all(opt.state[p][name] is value for (p, name), value in moved.items())  # stepped in place

    p = next(actual.parameters())
    name = next(iter(opt.state[p]))
    with pytest.raises(ValueError, match=f"state entry '{name}' must stay a tensor of shape"):
        opt.state[p][name] = torch.zeros(1, 2, 3)
    with pytest.raises(KeyError, match="has no 'exp_avg'"):
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
    with pytest.raises(TypeError, match="cannot be deleted"):
        del opt.state[p]
    with pytest.raises(TypeError, match="cannot be removed"):
        opt.state[p].pop(name)
    replacement = torch.full_like(opt.state[p][name], 7.0)
    opt.state[p].update({name: replacement})
    assert opt.state[p][name] is replacement


def test_a_deep_copy_is_an_independent_optimizer():
    model = make_model("shapes", DTYPE)
    twin = copy.deepcopy(model)
    opt = fb.Optimizer(model.parameters(), fb.adam, lr=1e-2)
    train(None, steps=2, scheduler=False, model=model, optimizer=opt)
    twin.load_state_dict(model.state_dict())
    twin_opt = copy.deepcopy(opt)  # of the chain's state too, not only torch's "state" and "param_groups"
    twin_opt.param_groups[0]["params"] = list(twin.parameters())
    train(None, steps=3, scheduler=False, model=model, optimizer=opt, start=2)
    train(None, steps=3, scheduler=False, model=twin, optimizer=twin_opt, start=2)
    assert_models_equal(model, twin)


def test_torchs_distributed_state_dict_api_saves_and_resumes_it():
    """torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict (parameters by
    their names, as DCP saves them) resume the run bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    make = lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2, weight_decay=0.1)  # noqa: E731
    whole, _ = train(make, scheduler=False)
    first, opt = train(make, steps=STEPS // 2, scheduler=False)
    saved = copy.deepcopy(get_optimizer_state_dict(first, opt))
    assert "conv.weight" in saved["state"]
    resumed = make_model("shapes", DTYPE, seed=3)
    resumed.load_state_dict(first.state_dict())
    opt2 = make(resumed)
    set_optimizer_state_dict(resumed, opt2, saved)
    train(None, steps=STEPS // 2, scheduler=False, model=resumed, optimizer=opt2, start=STEPS // 2)
    assert_models_equal(whole, resumed)


def test_a_scheduler_moves_hyperparameters_given_as_ints_and_lists():
    """lr=1 (an int) and betas as a list (as config files give them) are numbers a scheduler
    changes, as in torch: the factory receives them as its defaults' types."""

    def lambda_lr(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 2 else 1.0)

    def run(make):
        with default_dtype(DTYPE):
            model = make_model("shapes", DTYPE)
            opt = make(model)
            sched = lambda_lr(opt)
            for x, y in batches(5, DTYPE):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                sched.step()
        return model

    expected = run(lambda m: torch.optim.RMSprop(m.parameters(), lr=1))
    actual = run(lambda m: fb.Optimizer(m.parameters(), fb.rmsprop, lr=1))
    assert_models_close(expected, actual)
    expected = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, betas=[0.5, 0.9]))
    actual = run(lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2, betas=[0.5, 0.9], fused=False))
    assert_models_close(expected, actual)


def test_hyperparameters_are_written_when_they_change_and_after_any_other_write():
    """The group's lr goes into the state's tensor only when it differs from what that tensor
    holds (no write, so no kernel launch, per step otherwise); a value written by hand, or loaded,
    is replaced by the group's number at the next step, as torch reads its group's lr each step.
    Reference: torch.optim.AdamW with the same lr changes."""

    def run(make, hand_write):
        with default_dtype(DTYPE):
            model = make_model("shapes", DTYPE)
            opt = make(model)
            versions = []
            for t, (x, y) in enumerate(batches(5, DTYPE)):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                if hand_write is not None:
                    lr = opt._groups[0].state.hyperparams["lr"]
                    versions.append(lr._version)
                    if t == 2:
                        lr.fill_(123.0)  # what a hand write would do; the group's lr wins at the next step
                if t == 1:
                    opt.param_groups[0]["lr"] = 3e-3
        return model, versions

    expected, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), None)
    actual, versions = run(lambda m: fb.Optimizer(m.parameters(), fb.adamw, lr=1e-2, fused=False), True)
    assert_models_close(expected, actual)
    # written at the first step, again after the change and after the hand write, not in between
    assert versions[1] == versions[0] and versions[2] > versions[1] and versions[4] == versions[3] > versions[2] + 1


def test_state_is_made_at_the_first_step_for_the_parameters_that_train():
    """As torch.optim's: no state for a frozen parameter; a model cast after the optimizer was
    built (and its state read) steps in its new dtype; a parameter unfrozen later gets its state
    at its first step. torch.optim.AdamW(fused=True), bit for bit."""
    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), lambda ps: fb.Optimizer(ps, fb.adamw, lr=1e-2)):
        model = make_model("shapes", torch.float32)
        model.conv.weight.requires_grad_(False)
        opt = make(model.parameters())
        assert not opt.state and not opt.state_dict()["state"]  # reading makes nothing
        model.double()  # after the optimizer: its state is made in float64
        train(None, steps=3, scheduler=False, model=model, optimizer=opt)
        frozen_then = (model.conv.weight in opt.state, len(opt.state))
        model.conv.weight.requires_grad_(True)
        train(None, steps=2, scheduler=False, model=model, optimizer=opt, start=3)
        runs.append((model, opt, frozen_then))
    (expected, _, expected_then), (actual, opt, then) = runs
    assert_models_equal(expected, actual)
    assert then == expected_then == (False, len(list(actual.parameters())) - 1)
    assert all(t.dtype == torch.float64 for entries in opt.state.values() for t in entries.values() if t.dim())


def test_a_checkpoint_without_a_parameters_state_loads_as_torchs_does():
    """Saved while the bias was frozen, loaded with it trainable: its state starts at its first step."""
    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), lambda ps: fb.Optimizer(ps, fb.adamw, lr=1e-2)):
        model = make_model("shapes", DTYPE)
        model.fc.bias.requires_grad_(False)
        opt = make(model.parameters())
        train(None, steps=2, scheduler=False, model=model, optimizer=opt)
        saved = copy.deepcopy(opt.state_dict())
        model.fc.bias.requires_grad_(True)
        resumed = make(model.parameters())
        resumed.load_state_dict(saved)
        train(None, steps=2, scheduler=False, model=model, optimizer=resumed, start=2)
        runs.append(model)
    assert_models_equal(*runs)


def test_a_deep_copy_with_a_scheduler_steps_only_the_copy():
    model = make_model("shapes", DTYPE)
    opt = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-2)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step
    train(None, steps=1, scheduler=False, model=model, optimizer=opt)
    twin, twin_opt = copy.deepcopy((model, opt))
    before = [p.clone() for p in model.parameters()]
    train(None, steps=1, scheduler=False, model=twin, optimizer=twin_opt, start=1)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not all(torch.equal(p, b) for p, b in zip(twin.parameters(), before))
    twin_opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=DTYPE))]})  # the factory still builds


def test_a_partition_with_int_labels_inside_a_chain_keeps_every_parameters_state():
    """The parameter's key is the last int key on a state tensor's path (a label comes first)."""
    make = lambda m: fb.Optimizer(  # noqa: E731
        m.parameters(),
        fb.chain(
            fb.clip_by_global_norm(10.0),
            fb.partition({0: fb.adam(1e-2), 1: fb.sgd(0.1, momentum=0.9)}, lambda p: {k: k % 2 for k in p}),
        ),
    )
    assert_resumes_bit_for_bit(make)


def test_a_label_transforms_shared_state_under_int_labels_is_shared_state():
    """An injected label transform's count and numbers belong to no parameter, whatever the
    label; with a parameter frozen, the optimizer loads its own checkpoint."""
    for labels in ((0, 1), (7, 8)):
        tx = fb.chain(
            fb.clip_by_global_norm(1.0),
            fb.partition(
                {labels[0]: fb.inject_hyperparams(fb.sgd)(lr=0.1, momentum=0.9), labels[1]: fb.adamw(1e-2)},
                {0: labels[0], 1: labels[1], 2: labels[0]},
            ),
        )
        params = [torch.nn.Parameter(torch.ones(4) * k) for k in range(3)]
        params[0].requires_grad_(False)
        opt = fb.Optimizer(params, tx)
        for p in params[1:]:
            p.grad = torch.ones(4)
        opt.step()
        saved = opt.state_dict()
        assert sorted(saved["state"]) == [1, 2] and len(opt.state) == 2
        assert f"1/inner_states/{labels[0]}/count" in saved["param_groups"][0]["shared_state"]
        fb.Optimizer(params, tx).load_state_dict(copy.deepcopy(saved))


def test_dcp_steps_no_group_whose_numbers_are_fixed():
    """Before the first step, DCP steps an optimizer that reads as fresh (lr 0, zero gradients):
    a group of building blocks with fixed weight decay (no lr to set to 0) beside one with an lr
    must not move."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)).double()
    before = [p.clone() for p in model.parameters()]
    fixed = fb.chain(fb.scale_by_adam(), fb.add_decayed_weights(0.1), fb.scale(-1e-2))
    opt = fb.Optimizer(
        [
            {"params": model[0].parameters(), "tx": fb.inject_hyperparams(fb.adamw)(lr=1e-2)},
            {"params": model[1].parameters(), "tx": fixed},
        ]
    )
    assert "lr" not in opt.param_groups[1]
    get_optimizer_state_dict(model, opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_groups_numbers_do_not_leak_into_another_groups():
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    opt = fb.Optimizer(
        [
            {"params": [a], "tx": fb.inject_hyperparams(fb.adamw)(lr=1e-2)},
            {"params": [b], "tx": fb.adamw(3e-3)},
            {"params": [c], "tx": fb.chain(fb.scale_by_adam(), fb.scale(-1e-3))},  # building blocks: no numbers
        ]
    )
    assert [g.get("lr") for g in opt.param_groups] == [1e-2, 3e-3, None]
    assert "betas" not in opt.param_groups[2]


def test_one_cycle_drives_a_partition_of_injected_transforms():
    """OneCycleLR cycles lr and betas[0] of injected label transforms, as it does torch.optim.AdamW's groups."""

    def torch_groups(m):
        decay = [p for p in m.parameters() if p.dim() > 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in m.parameters() if p.dim() <= 1]}]

    def run(make):
        with default_dtype(DTYPE):
            model = make_model("shapes", DTYPE)
            opt = make(model)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
            for x, y in batches(STEPS, DTYPE):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                sched.step()
        return model

    adamw = fb.inject_hyperparams(fb.adamw)
    expected = run(lambda m: torch.optim.AdamW(torch_groups(m), lr=1e-2, weight_decay=0.0))
    actual = run(
        lambda m: fb.Optimizer(
            m.named_parameters(),
            fb.partition(
                {  # betas given, so that they are held as numbers to cycle
                    "decay": adamw(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1),
                    "no_decay": adamw(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0),
                },
                decay_labels,
            ),
        )
    )
    assert_models_close(expected, actual)


def test_dcp_reads_a_stateless_chain_without_stepping_it():
    """torch.distributed.checkpoint steps an optimizer whose state looks empty (to make it), with
    lr 0 where a group holds one: a built fb.sgd with weight decay (whose lr its group shows, as
    torch.optim.SGD's) and a chain of building blocks (no lr: made, not stepped) must not move."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    for tx in (fb.sgd(0.1, weight_decay=0.1), fb.chain(fb.add_decayed_weights(0.1), fb.scale(-0.1))):
        model = make_model("shapes", DTYPE)
        opt = fb.Optimizer(model.parameters(), tx)
        before = [p.clone() for p in model.parameters()]
        get_optimizer_state_dict(model, opt)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert opt.param_groups[0].get("lr", 0.1) == 0.1  # DCP put the lr back


def test_state_dict_hooks_run_as_torchs_do():
    model = make_model("shapes", DTYPE)
    opt = fb.Optimizer(model.parameters(), fb.adam, lr=1e-2)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    saved = opt.state_dict()
    assert saved["extra"] == 1
    opt.load_state_dict(saved)
    assert calls == ["pre", "loaded"]


def test_closure_and_a_group_without_gradients():
    model = make_model("shapes", DTYPE)
    frozen = torch.nn.Linear(2, 2).double()
    opt = fb.Optimizer([{"params": model.parameters()}, {"params": frozen.parameters()}], fb.sgd, lr=0.1)
    before = [p.clone() for p in frozen.parameters()]
    x, y = batches(1, DTYPE)[0]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and loss.requires_grad
    assert all(torch.equal(p, b) for p, b in zip(frozen.parameters(), before))


def test_bad_input_is_named():
    params = list(make_model("shapes", DTYPE).parameters())
    with pytest.raises(TypeError, match="evaluates the loss at other parameters.*functional loop"):
        fb.Optimizer(params, fb.lbfgs())
    with pytest.raises(ValueError, match="empty parameter list"):  # torch's own check
        fb.Optimizer([], fb.adamw, lr=1e-3)
    with pytest.raises(TypeError, match="given without a factory"):
        fb.Optimizer(params, fb.adamw(1e-3), lr=1e-3)
    with pytest.raises(ValueError, match="param group 1 has no 'tx'.*give every group its own"):
        fb.Optimizer([{"params": params[:1], "tx": fb.sgd(0.1)}, {"params": params[1:]}])
    with pytest.raises(TypeError, match="param group 0's 'tx' must be a GradientTransformation"):
        fb.Optimizer([{"params": params, "tx": fb.sgd}])
    with pytest.raises(ValueError, match="fused=True, but torch has no fused kernel for param group 0"):
        fb.Optimizer(params, fb.rmsprop, lr=1e-2, fused=True)
    with pytest.raises(ValueError, match="labels without a transform: \\['head'\\]"):
        fb.Optimizer(params, fb.partition({"body": fb.sgd(0.1)}, ["body"] * (len(params) - 1) + ["head"]))
    with pytest.raises(TypeError, match="takes no \\['learning_rate'\\]"):
        fb.Optimizer(params, fb.adamw, learning_rate=1e-3)
    with pytest.raises(ValueError, match="built from a transform"):
        fb.Optimizer([{"params": params, "tx": fb.sgd(0.1)}], fb.sgd, lr=0.1)
    with pytest.raises(TypeError, match="GradientTransformation or a factory"):
        fb.Optimizer(params, 0.1)
    torch_opt = torch.optim.AdamW(params, lr=1e-3)
    opt = fb.Optimizer(params, fb.adamw, lr=1e-3)
    with pytest.raises(ValueError, match="not saved by fb.Optimizer"):
        opt.load_state_dict(torch_opt.state_dict())
    other = fb.Optimizer(params[:2], fb.adamw, lr=1e-3)
    with pytest.raises(ValueError, match="groups of"):
        opt.load_state_dict(other.state_dict())
    split = fb.Optimizer(params[:2], fb.partition({"w": fb.adamw(1e-3), "b": fb.sgd(0.1)}, ["w", "b"]))
    with pytest.raises(ValueError, match="more than one parameter group"):
        split.add_param_group({"params": [params[2], params[1]]})  # the second label's group fails
    assert [len(g["params"]) for g in split.param_groups] == [1, 1]  # the first label's is gone too
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    sparse_sgd = fb.Optimizer(embedding.parameters(), fb.sgd, lr=0.1)
    embedding(torch.tensor([1, 3])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradients are not supported.*fb.sparse_adam"):
        sparse_sgd.step()  # torch's fused kernel would fail with an internal error
    kept = fb.Optimizer([{"params": params[:2], "tx": fb.adamw(1e-3)}], fused=True)
    with pytest.raises(ValueError, match="fused=True, but torch has no fused kernel for param group 1"):
        kept.add_param_group({"params": params[2:], "tx": fb.rmsprop(1e-2)})
    assert len(kept.param_groups) == 1 and len(kept.state_dict()["param_groups"]) == 1  # left as it was
    sgd = fb.Optimizer(params, fb.sgd, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.zeros_like(p)
    sgd.step()  # its state is made
    with pytest.raises(ValueError, match="another chain"):
        opt.load_state_dict(sgd.state_dict())


@pytest.mark.parametrize("fused", [False, None], ids=["pure", "kernel"])
def test_compiled_step_follows_the_scheduler_without_recompiling(fused):
    """torch.compile(opt.step): the lr a scheduler writes reaches the graph as data (no number
    baked in, no new graph after the first step), and the run is the eager one: bit for bit
    where torch's fused kernel runs (eagerly inside the compiled step); to a rounding for the
    pure update, whose eager step reads the held numbers as Python numbers (fused factors,
    ``p.add_(u, alpha=-lr)``) where the graph keeps them as tensors."""
    eager, compiled, graphs_after_first_step, graphs_at_the_end = eager_and_compiled_runs(
        lambda model: fb.Optimizer(model.parameters(), fb.adamw, lr=1e-2, fused=fused), STEPS, DTYPE, graphs_after=0
    )
    assert graphs_at_the_end == graphs_after_first_step
    if fused is False:  # the pure update was compiled (the kernel's step is eager: no graph of its own)
        assert graphs_after_first_step > 0
        assert_models_close(eager, compiled, rtol=1e-13, atol=1e-15)
    else:
        assert_models_equal(eager, compiled)


@pytest.mark.slow
@pytest.mark.cpu_only("spawned gloo ranks on the CPU (CUDA ranks: test_cuda_distributed.py)")
def test_under_torch_ddp_it_steps_as_the_torch_class():
    """2 gloo ranks, torch's DDP averaging the gradients: fb.Optimizer(fb.adamw) with a scheduler
    gives torch.optim.AdamW's parameters on every rank."""
    from dist_harness import ScenarioError, run_ranks

    for result in run_ranks(2, ["optimizer_under_ddp"]):
        got = result["optimizer_under_ddp"]
        assert not isinstance(got, ScenarioError), f"scenario raised {got}"
        for name, expected in got["torch"].items():
            torch.testing.assert_close(got["fb"][name], expected, **TOL, msg=lambda m: f"{name}: {m}")


def test_a_tensor_lr_changed_in_place_by_a_scheduler_reaches_the_update():
    """torch's schedulers change a tensor lr with fill_ (the same object): every step writes the
    group's value (reference: torch.optim.SGD with the same tensor lr and StepLR)."""
    runs = []
    for make in (
        lambda m: torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1)),
        lambda m: fb.Optimizer(m.parameters(), fb.sgd, lr=torch.tensor(0.1)),
    ):
        with default_dtype(DTYPE):
            model = make_model("shapes", DTYPE)
            opt = make(model)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            for x, y in batches(4, DTYPE):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                sched.step()
        runs.append(model)
    assert_models_close(runs[0], runs[1])


def test_a_factory_is_built_again_only_when_its_groups_numbers_change():
    """The kernel path asks the factory which kernel computes a group's transform: once, and
    again only when the group's numbers change (here at the two lr changes of a StepLR), not at
    every step; the run is still torch's fused AdamW's, bit for bit."""
    calls = []

    def counting_adamw(lr=1e-3, weight_decay=1e-2):
        calls.append(lr)
        return fb.adamw(lr=lr, weight_decay=weight_decay)

    runs = []
    for make in (
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
        lambda m: fb.Optimizer(m.parameters(), counting_adamw, lr=1e-2),
    ):
        with default_dtype(DTYPE):
            model = make_model("shapes", DTYPE)
            opt = make(model)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            for t, (x, y) in enumerate(batches(6, DTYPE)):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                sched.step()
                if t == 0:
                    del calls[:]
        runs.append(model)
    assert calls == [5e-3, 2.5e-3]
    assert_models_equal(runs[0], runs[1])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_weight_decay_held_as_a_tensor_steps_as_the_number_and_as_torch(weight_decay):
    """``fb.Optimizer``'s factory form holds ``weight_decay`` as a 0-dim tensor: the step is that
    of the alias built with the number (bit for bit on the CPU, where the held values are read as
    numbers; to a rounding on a device), and as torch.optim's SGD (``grad.add(param, alpha=wd)``,
    nothing added at 0: a parameter at infinity stays there instead of turning NaN through
    ``0 * inf``); the gradients are left as they were."""
    at_infinity = float("inf") if weight_decay == 0 else 3.0  # with decay, torch's step is NaN there too
    values = torch.tensor([1.0, -2.0, at_infinity, 0.5], device=DEVICE)
    grad = torch.tensor([0.5, 0.25, 1.0, -1.0], device=DEVICE)
    factory, alias, ref = (torch.nn.Parameter(values.clone()) for _ in range(3))
    optimizers = [
        fb.Optimizer([factory], fb.sgd, lr=0.1, momentum=0.9, weight_decay=weight_decay, fused=False),
        fb.Optimizer([alias], fb.sgd(0.1, momentum=0.9, weight_decay=weight_decay), fused=False),
        torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=weight_decay, foreach=False),
    ]
    for _ in range(3):
        for p, opt in zip((factory, alias, ref), optimizers):
            p.grad = grad.clone()
            opt.step()
            assert torch.equal(p.grad, grad)
    if torch.device(DEVICE).type == "cpu":
        assert torch.equal(factory.detach(), alias.detach())
    else:  # held on the device, never read back: the factory's chain scales, then adds (a rounding apart)
        torch.testing.assert_close(factory.detach(), alias.detach(), rtol=3e-7, atol=0)
    torch.testing.assert_close(factory.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert not bool(factory.detach().isnan().any()) and factory.detach()[2] == ref.detach()[2]


@pytest.mark.parametrize(
    "alias, options",
    [
        (fb.sgd, {}),
        (fb.adam, {}),
        (fb.adopt, {}),
        (fb.adopt, {"decouple": True}),
        (fb.laprop, {}),
        (fb.soap, {}),
        (fb.psgd_kron, {}),
    ],
    ids=["sgd", "adam", "adopt", "adopt-decoupled", "laprop", "soap", "psgd_kron"],
)
@pytest.mark.cpu_only(
    "a held tensor is read as a number on the CPU only: on a GPU reading it would wait for the device"
)
def test_a_held_zero_weight_decay_adds_no_term(alias, options):
    """The factory form holds ``weight_decay`` as a tensor even at 0; its steps are the alias's
    built with the number 0, which adds no decay term at all: bit for bit, also at a parameter at
    infinity (``0 * inf`` would make it NaN)."""
    values = torch.tensor([[1.0, -2.0], [float("inf"), 0.5]], device=DEVICE)
    grad = torch.tensor([[0.5, 0.25], [1.0, -1.0]], device=DEVICE)
    factory, number = (torch.nn.Parameter(values.clone()) for _ in range(2))
    optimizers = [
        fb.Optimizer([factory], alias, lr=0.01, weight_decay=0.0, fused=False, **options),
        fb.Optimizer([number], alias(0.01, weight_decay=0.0, **options), fused=False),
    ]
    for step in range(3):
        for p, opt in zip((factory, number), optimizers):
            p.grad = grad.clone()
            torch.manual_seed(step)  # the same draws for both (PSGD-Kron's probes)
            opt.step()
    assert torch.equal(factory.detach(), number.detach()) and factory.detach()[1, 0] == float("inf")


FACTORY_FORMS = [fb.soap, fb.shampoo, fb.psgd_kron, fb.schedule_free_adamw, fb.schedule_free_sgd, fb.prodigy]
FACTORY_FORMS += [fb.dadapt_adam, fb.adopt, fb.ademamix, fb.laprop, fb.lion, fb.lamb, fb.adafactor, fb.nadam]


@pytest.mark.parametrize("alias", FACTORY_FORMS, ids=[a.__name__ for a in FACTORY_FORMS])
def test_the_factory_form_steps_float32_parameters_as_the_alias_does(alias):
    """``fb.Optimizer(params, alias, lr=...)`` holds its hyperparameters as float64 tensors; on
    float32 parameters whose hyperparameters are held on the CPU its steps are the alias's built
    with the numbers, bit for bit (each step builds the alias with the values it holds read as
    Python numbers; SOAP's factory form raised: a float64 bias correction made its projection
    float64). Beside a GPU, a transform whose state keeps its scalars there (Shampoo, PSGD-Kron)
    gets them as 0-dim tensors on the device, not read (a read would wait for the GPU): the same
    formulas, within a few roundings of float32."""
    gen = seeded(3)
    values = [torch.randn(6, 5, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(4)]
    factory, number = ([torch.nn.Parameter(v.clone()) for v in values] for _ in range(2))
    optimizers = [fb.Optimizer(factory, alias, lr=0.01), fb.Optimizer(number, alias(0.01))]
    for step, g in enumerate(grads):
        for params, opt in zip((factory, number), optimizers):
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            torch.manual_seed(step)  # the same draws for both (PSGD-Kron's probes)
            opt.step()
    held = optree.tree_leaves(optimizers[0]._groups[0].state.hyperparams)
    read_as_numbers = all(t.device.type == "cpu" for t in held)
    assert read_as_numbers or ON_CUDA  # on the CPU, always
    for a, b in zip(factory, number):
        assert a.dtype == torch.float32
        if read_as_numbers:
            assert torch.equal(a.detach(), b.detach()), (a - b).abs().max()
        else:
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


SECOND_ORDER_FACTORIES = [fb.soap, fb.shampoo, fb.psgd_kron]


@pytest.mark.parametrize("alias", SECOND_ORDER_FACTORIES, ids=[a.__name__ for a in SECOND_ORDER_FACTORIES])
def test_a_compiled_step_of_the_factory_form_equals_its_eager_step(alias):
    """``torch.compile(opt.step)`` from the first step (the state is made inside the compiled
    call), with a scheduler moving the learning rate. Shampoo's factory form raised there:
    its factory, built again inside the step, made an ``lru_cache`` and branched on its held
    betas, and dynamo mistraced the trees after those breaks. Dynamo runs the step as traced
    (batched counts, the refresh operators) without inductor: the same arithmetic as eagerly
    up to the order of float64 sums."""
    gen = seeded(11)
    values = [torch.randn(4, 4, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(v.shape, generator=gen, dtype=torch.float64) for v in values] for _ in range(6)]
    runs = []
    for compiled in (False, True):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        opt = fb.Optimizer(params, alias, lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for t, g in enumerate(grads):
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            torch.manual_seed(t)  # the same draws for both (PSGD-Kron's probes)
            step()
            scheduler.step()
        runs.append([p.detach() for p in params])
    for eager, compiled in zip(*runs):
        torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: fb.Optimizer(ps, fb.adopt, lr=0.01),  # its clip_lambda, a function, in the group
        lambda ps: fb.Optimizer(ps, fb.adamw, lr=fb.schedules.cosine_decay(0.1, 10)),  # a schedule as lr
    ],
    ids=["adopt-clip_lambda", "scheduled-lr"],
)
def test_a_group_holding_a_function_saves_a_file_torch_load_reads_and_resumes(make):
    """A function in a param group is code, not state: torch.save could not pickle a schedule
    (a closure), and torch.load's default (weights_only) refused ADOPT's clip_lambda; the saved
    group leaves them out, the loading optimizer keeps its own, and the run resumes bit for bit."""
    gen = seeded(5)
    values = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(6)]

    straight = [torch.nn.Parameter(v.clone()) for v in values]
    run_steps(straight, make(straight), grads)
    first = [torch.nn.Parameter(v.clone()) for v in values]
    opt = make(first)
    run_steps(first, opt, grads[:3])
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in first]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # tensors and plain values only (torch's default)
    resumed = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt = make(resumed)
    opt.load_state_dict(saved["opt"])
    assert callable(opt.param_groups[0]["clip_lambda" if "clip_lambda" in opt.param_groups[0] else "lr"])
    run_steps(resumed, opt, grads[3:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_a_chain_ending_in_its_learning_rate_adds_the_direction_with_alpha_in_one_pass():
    """A chain whose last link multiplies by a number (the learning rate; a scheduler's new
    value too, read when the step runs): the parameters move as torch.optim's
    ``p.add_(u, alpha=-lr)``, ``u`` the chain's direction, the product not rounded apart (in
    float32, on enough elements, adding ``u * -lr`` differs by a rounding in some). A chain
    ending in a schedule runs whole: ``p + u * -lr(t)``."""
    gen = seeded(3)
    start = torch.randn(4096, generator=gen, dtype=torch.float32).to(DEVICE)
    grads = [torch.randn(4096, generator=gen, dtype=torch.float32).to(DEVICE) for _ in range(4)]

    def moved(tx, rates):
        p = torch.nn.Parameter(start.clone())
        opt = fb.Optimizer([p], tx)
        for g, rate in zip(grads, rates):
            opt.param_groups[0]["lr"] = rate
            p.grad = g.clone()
            opt.step()
        return p.detach()

    direction, rates = fb.scale_by_adam(), [1e-2, 1e-2, 5e-3, 5e-3]
    expected = start.clone()
    state = on_host_as_the_optimizer_holds_it(direction.init({Position(0): start}), {Position(0): start})
    for g, rate in zip(grads, rates):
        u, state = direction.update({Position(0): g}, state, {Position(0): expected})
        # a scheduler's new rate is a number in the group: the step runs the chain built with it
        # (on any device), its direction added with the rate as alpha
        expected.add_(u[Position(0)], alpha=-rate)
    torch.testing.assert_close(
        moved(fb.chain(fb.scale_by_adam(), fb.scale_by_learning_rate(1e-2)), rates), expected, rtol=0, atol=0
    )

    schedule = fb.schedules.exponential_decay(1e-2, transition_steps=1, decay_rate=0.5)
    expected, count = start.clone(), 0
    state = on_host_as_the_optimizer_holds_it(direction.init({Position(0): start}), {Position(0): start})
    for g in grads:
        u, state = direction.update({Position(0): g}, state, {Position(0): expected})
        expected.add_(u[Position(0)] * -schedule(torch.tensor(count, dtype=torch.float64)))
        count += 1
    p = torch.nn.Parameter(start.clone())
    opt = fb.Optimizer([p], fb.chain(fb.scale_by_adam(), fb.scale_by_learning_rate(schedule)))
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0)


def test_schedule_free_steps_y_and_z_in_place_as_the_reference_writes_them():
    """fb.Optimizer over schedule_free_sgd (no warmup, r = 0, weight_lr_power = 2) steps y (the
    parameters) and z in place as the schedulefree package writes its step:
    ``y.lerp_(z, c); y.add_(g, alpha=lr (b1 (1 - c) - 1)); z.add_(g, alpha=-lr)`` with
    ``c = w_t / sum w`` (``w = lr^2``): those three operations' bits (float32, enough elements
    that the pure update, which forms ``u = c (z - y) + ...`` and adds it, would differ)."""
    lr, b1 = 0.5, 0.9
    gen = seeded(5)
    start = torch.randn(4096, generator=gen, dtype=torch.float32).to(DEVICE)
    grads = [torch.randn(4096, generator=gen, dtype=torch.float32).to(DEVICE) for _ in range(4)]
    p = torch.nn.Parameter(start.clone())
    opt = fb.Optimizer([p], fb.schedule_free_sgd(lr, momentum=b1))
    for g in grads:
        p.grad = g.clone()
        opt.step()
    if torch.device(DEVICE).type != "cpu":
        return  # on a device the factors stay tensors there (never read back): the pure update runs
    y, z, weight_sum = start.clone(), start.clone(), 0.0
    for t, g in enumerate(grads, 1):
        weight = (float(t) ** 0.0) * lr**2.0
        weight_sum += weight
        c = weight / weight_sum
        y.lerp_(z, c)
        y.add_(g, alpha=lr * (b1 * (1 - c) - 1))
        z.add_(g, alpha=-lr)
    assert torch.equal(p.detach(), y)
    opt.eval()  # x = lerp(y, z, 1 - 1/b1): z was stepped as written above
    torch.testing.assert_close(p.detach(), torch.lerp(y, z, 1 - 1 / b1), rtol=1e-6, atol=1e-6)


def test_schedule_free_steps_the_pure_update_where_its_tensors_cannot_step_in_place():
    """A group holding a 0-dim parameter (and one without a gradient at a step, beside the
    others): the 0-dim one takes the pure step, bit for bit (the averaging steps tensors of at
    least one dimension in place), the others are stepped in place, to a rounding of the pure
    update; the parameter without a gradient stays where it is that step."""
    gen = seeded(6)
    shapes = [(), (7,), (3, 4)]
    start = [torch.randn(s, generator=gen, dtype=torch.float32).to(DEVICE) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float32).to(DEVICE) for s in shapes] for _ in range(3)]
    grads[1][1] = None
    tensors = [torch.nn.Parameter(v.clone()) for v in start]
    opt = fb.Optimizer(tensors, fb.schedule_free_adamw(1e-2, warmup_steps=1))
    tx, params = fb.schedule_free_adamw(1e-2, warmup_steps=1), {i: v.clone() for i, v in enumerate(start)}
    state = tx.init(params)
    for step in grads:
        before = tensors[1].detach().clone()
        for p, g in zip(tensors, step):
            p.grad = None if g is None else g.clone()
        opt.step()
        updates, state = tx.update(dict(enumerate(step)), state, params)
        params = fb.apply_updates(params, updates)
        assert torch.equal(tensors[0].detach(), params[0])
        assert step[1] is not None or torch.equal(tensors[1].detach(), before)
    for i, p in enumerate(tensors):
        torch.testing.assert_close(p.detach(), params[i], rtol=1e-6, atol=1e-7)


def test_a_link_written_to_the_four_argument_apply_in_place_still_steps():
    """A user's link offering ``update.apply_in_place(updates, state, params, alpha)`` (written
    before ``scaled_by`` existed), before the learning rate: ``fb.Optimizer`` calls it with those
    four (``alpha = -lr``), and the parameters are those of the pure chain, to a rounding."""
    alphas = []

    def init(params):
        return fb.EmptyState()

    def update(updates, state, params=None):
        return updates, state

    def apply_in_place(updates, state, params, alpha):
        alphas.append(alpha)
        for p, u in zip(params.values(), updates.values()):
            p.add_(u, alpha=alpha)
        return state

    update.apply_in_place = apply_in_place
    link = fb.GradientTransformation(init, update)
    gen = seeded(31)
    start = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in start.items()} for _ in range(3)]
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    opt = fb.Optimizer(list(tensors.values()), fb.chain(fb.scale_by_adam(), link, fb.scale_by_learning_rate(0.1)))
    tx = fb.chain(fb.scale_by_adam(), fb.scale_by_learning_rate(0.1))
    params, state = dict(start), tx.init(start)
    for g in grads:
        for k, p in tensors.items():
            p.grad = g[k].clone()
        opt.step()
        updates, state = tx.update(g, state, params)
        params = fb.apply_updates(params, updates)
    assert alphas == [-0.1] * len(grads)
    for k, p in tensors.items():
        torch.testing.assert_close(p.detach(), params[k], rtol=1e-6, atol=1e-7)


def on_host_as_the_optimizer_holds_it(state, params):
    """``state`` with its scalars where ``fb.Optimizer`` holds them (on the CPU beside a GPU's
    tensors, as torch.optim's ``step``): the functional loop then computes the same factors."""
    return _scalars_on_host(state, list(params.values()))


EVERY = (0, 1, 2)  # the positions of the parameters below; 1 is a 0-dim float64 one


@pytest.mark.parametrize(
    "make_tx, hosted",
    [
        (lambda: fb.adamw(1e-2), {("1/count", at) for at in EVERY}),  # the rule's per-tensor counts
        (  # a 0-dim float64 parameter's float64 scalar could be its moment: left with it
            lambda: fb.chain(fb.clip_by_global_norm(1.0), fb.nadam(1e-2)),
            {("1/2/count", at) for at in EVERY} | {("1/2/mu_product", 0), ("1/2/mu_product", 2)},
        ),
        (
            lambda: fb.schedule_free_adamw(1e-2),
            {("0/0/count", at) for at in EVERY} | {(f"1/{k}", None) for k in ("count", "lr_max", "weight_sum", "b1")},
        ),
        (
            lambda: fb.inject_hyperparams(fb.adam)(lr=1e-2),
            {("count", None), ("hyperparams/lr", None)} | {("inner_state/2/count", at) for at in EVERY},
        ),
        (lambda: fb.shampoo(1e-2), set()),  # its counts are stacked with its blocks' tensors: left there
        (lambda: fb.inject_hyperparams(fb.psgd_kron)(lr=1e-2), set()),  # numbers injected into such a state
    ],
    ids=["adamw", "chain-nadam", "schedule-free", "injected", "shampoo", "injected-psgd-kron"],
)
def test_the_scalars_the_optimizer_holds_on_the_cpu_are_those_of_the_transforms_that_take_them(make_tx, hosted):
    """Beside a GPU's tensors fb.Optimizer holds on the CPU the 0-dim step counts and float64
    numbers of the states whose transforms declare they take them there (the rules written per
    tensor, schedule-free's averaging, injected hyperparameters where what they are injected
    into takes them too), and nothing else: no moment, no float64 scalar of a 0-dim float64
    parameter, no other transform's counts. (Run on the
    CPU, the scalars go to the meta device instead: the same choice, seen by where each went.)"""
    ps = [torch.zeros(3, 2, dtype=torch.float64), torch.zeros((), dtype=torch.float64), torch.zeros(4)]
    state = make_tx().init(dict(zip(positions(3), ps)))
    moved = _scalars_on_host(state, ps, host=torch.device("meta"))
    layout = GroupLayout.of(moved)
    went = {(n, at) for n, at, leaf in zip(layout.names, layout.positions, fb.tree.flatten(moved)[0]) if leaf.is_meta}
    assert went == hosted
    assert fb.tree.flatten(state)[1] == fb.tree.flatten(moved)[1]  # the same structure


def test_torch_kernels_take_step_counts_that_a_trainer_moved_in_part():
    """The counts of a group stepped by torch's fused kernel, some moved to another device by a
    trainer, are read together on the first one's device. (The meta device stands in for a GPU.)"""
    counts = [torch.tensor(2, device="meta"), torch.tensor(3)]
    stacked = fb.kernels._stacked(counts)
    assert stacked.is_meta and stacked.shape == (2,)
    assert fb.kernels._stacked([torch.tensor(2), torch.tensor(0)]).tolist() == [2, 0]
