"""functional_bagua.compat.fuse_optimizer: fuse_step gives the plain step's result, bit for bit,
for every torch.optim optimizer and for optimizers written outside torch; per-tensor optimizers
are detected and stepped unfused; torch 2.x habits (set_to_none, 0-dim step tensors, schedulers,
state_dict round trips, GradScaler, closures) keep working.

Reference: the same optimizer class on an identical copy of the parameters, stepped with plain
``step()`` on the same gradients.
"""

from __future__ import annotations

import copy
import io
import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

from custom_optimizers import BertAdam, SignMomentum
from functional_bagua.compat import fuse_optimizer, fuse_step, fused_steps, is_fused_optimizer
from functional_bagua.compat.fusion_check import SINGLE_OP_WORK, fusion_changes_step, probe

STEPS = 100

# name -> (class, group-0 defaults, group-1 overrides)
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), dict(lr=0.01, momentum=0.5, nesterov=False)),
    "Adam": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True), dict(lr=3e-3, weight_decay=0.1, amsgrad=False)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05), dict(lr=2e-3, betas=(0.8, 0.9))),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9, centered=True), dict(lr=1e-2, alpha=0.9)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2), dict(lr=1e-3, etas=(0.4, 1.3))),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2, t0=10), dict(lr=5e-3, weight_decay=1e-2)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2), dict(lr=2e-3, weight_decay=0.01)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=1.0), dict(lr=0.5, rho=0.8, weight_decay=1e-3)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2), dict(lr=3e-3, decoupled_weight_decay=True, weight_decay=0.01)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2), dict(lr=3e-3, weight_decay=0.01)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-1, initial_accumulator_value=0.1), dict(lr=5e-2, lr_decay=1e-3)),
}
HAS_FUSED_KERNEL = {"SGD", "Adam", "AdamW", "Adagrad"}
CASES = [(name, impl) for name in OPTIMIZERS for impl in ("for-loop", "foreach")]
CASES += [(name, "fused") for name in sorted(HAS_FUSED_KERNEL)]
IMPL_KWARGS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def make_params(seed=0):
    """Two groups. Group 0: float32, with an unused parameter (never a gradient) and a frozen one
    between trainable ones. Group 1: float64 and float32 mixed."""
    gen = torch.Generator().manual_seed(seed)

    def param(shape, dtype=torch.float32, requires_grad=True):
        return torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype), requires_grad=requires_grad)

    group0 = [param((5, 3)), param((3,)), param((4, 4)), param((6,)), param((2, 2), requires_grad=False), param((7,)), param((3, 1))]
    group1 = [param((3, 2), torch.float64), param((2, 2)), param((6,), torch.float64), param((5,)), param((2, 3), torch.float64)]
    return group0, group1


UNUSED = {(0, 3)}  # (group, index) of the parameter that never gets a gradient


def make_optimizer(name, impl, groups):
    cls, defaults, overrides = OPTIMIZERS[name]
    return cls([{"params": groups[0]}, {"params": groups[1], **overrides}], **defaults, **IMPL_KWARGS[impl])


def set_grads(groups, step, seed=1):
    """The gradients of step ``step`` (same for every copy): fresh tensors on even steps (as after
    ``zero_grad(set_to_none=True)``), written into the existing ``.grad`` on odd ones."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    for gi, params in enumerate(groups):
        for i, p in enumerate(params):
            if not p.requires_grad or (gi, i) in UNUSED:
                continue
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            if step % 2 == 1 and p.grad is not None:
                p.grad.copy_(g)
            else:
                p.grad = g


def assert_same(ref_groups, groups, ref_opt, opt):
    """Parameters and every state entry equal bit for bit."""
    for ps, qs in zip(ref_groups, groups):
        for p, q in zip(ps, qs):
            assert torch.equal(p, q), (p - q).abs().max()
            sp, sq = ref_opt.state.get(p, {}), opt.state.get(q, {})
            assert sp.keys() == sq.keys()
            for key in sp:
                if isinstance(sp[key], torch.Tensor):
                    assert sp[key].shape == sq[key].shape and sp[key].dtype == sq[key].dtype, key
                    assert torch.equal(sp[key], sq[key]), key
                else:
                    assert sp[key] == sq[key], key


def trainable_groups(groups):
    return sum(1 for params in groups if sum(p.requires_grad for p in params) > 1)


def alternate(ref_groups, groups, ref_opt, opt, steps=STEPS) -> tuple:
    """``steps`` steps on the same gradients: plain ``step()`` for the reference, ``fuse_step()``
    and ``step()`` in turns for ``opt``. Returns (fuse_step calls, "stays unfused" warnings)."""
    fused_calls = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps):
            set_grads(ref_groups, t)
            set_grads(groups, t)
            ref_opt.step()
            if t % 2 == 0:
                opt.fuse_step()
                fused_calls += 1
            else:
                opt.step()
    return fused_calls, [w for w in caught if "stays unfused" in str(w.message)]


@pytest.mark.parametrize("name,impl", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_alternating_fuse_step_and_step_equals_plain_step(name, impl):
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer(name, impl, ref_groups)
    opt = fuse_optimizer(make_optimizer(name, impl, groups))
    fused_calls, refused = alternate(ref_groups, groups, ref_opt, opt)
    assert_same(ref_groups, groups, ref_opt, opt)
    assert len(refused) == (3 if impl == "fused" else 0)  # once per (group, dtype)
    if impl == "fused":  # torch's fused kernels round by position: refused by the check, never fused
        assert opt._bagua_fused_count == 0
    else:  # every fuse_step fused both groups (Bagua's count: one per fused group and call)
        assert opt._bagua_fused_count == fused_calls * trainable_groups(groups)


@pytest.mark.parametrize("cls,kwargs", [(SignMomentum, dict(lr=1e-2, weight_decay=0.1)), (BertAdam, dict(lr=1e-2, t_total=STEPS, max_grad_norm=0.5))])
def test_custom_optimizers_equal_plain_step(cls, kwargs):
    ref_groups, groups = make_params(), make_params()
    ref_opt = cls([{"params": ref_groups[0]}, {"params": ref_groups[1], "lr": 1e-3}], **kwargs)
    opt = fuse_optimizer(cls([{"params": groups[0]}, {"params": groups[1], "lr": 1e-3}], **kwargs))
    fused_calls, per_tensor = alternate(ref_groups, groups, ref_opt, opt)
    assert_same(ref_groups, groups, ref_opt, opt)
    if cls is BertAdam:  # per-parameter clipping: detected, warned once per (group, dtype), never fused
        assert opt._bagua_fused_count == 0
        assert len(per_tensor) == 3 and all("per-tensor math" in str(w.message) for w in per_tensor)
    else:
        assert opt._bagua_fused_count == fused_calls * 2 and not per_tensor


PER_TENSOR_TORCH_OPTIMIZERS = {
    # relative step size and update clip from each parameter's own RMS, factored second moments
    "Adafactor-for-loop": (torch.optim.Adafactor, dict(lr=1e-2, foreach=False)),
    "Adafactor-foreach": (torch.optim.Adafactor, dict(lr=1e-2, foreach=True)),
    # Newton-Schulz orthogonalization of each 2-D parameter's update; refuses a 1-D flat tensor
    "Muon": (torch.optim.Muon, dict(lr=1e-2)),
}


@pytest.mark.parametrize("name", list(PER_TENSOR_TORCH_OPTIMIZERS))
def test_torch_optimizers_with_per_tensor_math_stay_unfused_and_equal_plain_step(name):
    """torch.optim's Adafactor and Muon (newer than the issue's list) treat each parameter as a
    whole: the probe refuses them (one warning per group and dtype), and fuse_step mixed with
    step gives plain step's bits."""
    cls, kwargs = PER_TENSOR_TORCH_OPTIMIZERS[name]
    ref_groups, groups = make_params(), make_params()
    if cls is torch.optim.Muon:  # Muon takes matrices only
        ref_groups, groups = ([[p for p in ps if p.dim() == 2] for ps in gs] for gs in (ref_groups, groups))
    ref_opt = cls([{"params": ref_groups[0]}, {"params": ref_groups[1], "lr": 1e-3}], **kwargs)
    opt = fuse_optimizer(cls([{"params": groups[0]}, {"params": groups[1], "lr": 1e-3}], **kwargs))
    _, refused = alternate(ref_groups, groups, ref_opt, opt, steps=20)
    assert_same(ref_groups, groups, ref_opt, opt)
    assert opt._bagua_fused_count == 0
    # a warning per group and dtype that has a run to fuse (two trainable parameters or more)
    dtypes = [[p.dtype for p in ps if p.requires_grad] for ps in groups]
    assert len(refused) == sum(sum(ds.count(d) > 1 for d in set(ds)) for ds in dtypes)


def test_per_tensor_optimizer_would_change_if_fused_naively():
    """The check is load-bearing: BertAdam stepped on the concatenation differs from BertAdam
    stepped per tensor (its clip uses each tensor's own norm), while Adam does not."""
    params = [torch.nn.Parameter(torch.randn(4) * s) for s in (0.01, 100.0)]
    for cls, expect_same in ((BertAdam, False), (torch.optim.Adam, True)):
        separate = [torch.nn.Parameter(p.detach().clone()) for p in params]
        flat = torch.nn.Parameter(torch.cat([p.detach() for p in params]))
        a, b = cls(separate, lr=0.1), cls([flat], lr=0.1)
        for _ in range(3):
            for p in separate:
                p.grad = p.detach() * 3
            flat.grad = flat.detach() * 3
            a.step()
            b.step()
        assert torch.equal(torch.cat([p.detach() for p in separate]), flat.detach()) == expect_same
        reason = fusion_changes_step(cls(separate, lr=0.1), {**a.param_groups[0]}, separate)
        assert (reason is None) == expect_same, reason


# ---- API -------------------------------------------------------------------------------------


def test_api_returns_same_object_refuses_twice_and_module_functions():
    params = make_params()[0]
    opt = torch.optim.SGD(params, lr=0.1)
    assert not is_fused_optimizer(opt)
    with pytest.raises(RuntimeError, match="fuse_optimizer"):
        fuse_step(opt)
    assert fuse_optimizer(opt) is opt and is_fused_optimizer(opt)
    with pytest.raises(RuntimeError, match="already fused"):
        fuse_optimizer(opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fuse_optimizer([p for p in params])
    set_grads([params], 0)
    before = [p.detach().clone() for p in params]
    fuse_step(opt)  # the module function is the method
    for p, b in zip(params, before):
        if p.grad is not None:
            assert torch.equal(p.detach(), torch.add(b, p.grad, alpha=-0.1))


def test_do_flatten_puts_params_grads_and_state_in_one_buffer_per_group_and_dtype():
    groups = make_params()
    ids = [[id(p) for p in ps] for ps in groups]
    opt = fuse_optimizer(torch.optim.Adam([{"params": groups[0]}, {"params": groups[1]}], lr=1e-2))
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == ids  # identity kept
    set_grads(groups, 0)
    opt.fuse_step()
    for params in groups:
        for dtype in (torch.float32, torch.float64):
            members = [p for p in params if p.requires_grad and p.dtype == dtype]
            if len(members) < 2:
                continue
            base = members[0].data_ptr()
            grads = [(p, p.grad) for p in members if p.grad is not None]
            states = [(p, opt.state[p]["exp_avg"]) for p in members if p in opt.state]
            for pairs in (grads, states):
                # one storage, laid out like the parameters (an unused parameter leaves a gap)
                assert len({t.untyped_storage().data_ptr() for _, t in pairs}) == 1
                start = pairs[0][1].data_ptr() - (pairs[0][0].data_ptr() - base)
                assert all(t.data_ptr() - start == p.data_ptr() - base for p, t in pairs)
            assert all(a.data_ptr() + a.numel() * a.element_size() == b.data_ptr() for a, b in zip(members, members[1:]))
    # the scalar step stays a separate 0-dim tensor per parameter
    steps = [opt.state[p]["step"] for p in groups[0] if p in opt.state]
    assert all(s.dim() == 0 for s in steps) and len({id(s) for s in steps}) == len(steps)


def test_do_flatten_false_leaves_params_in_place_and_still_matches():
    ref_groups, groups = make_params(), make_params()
    pointers = [p.data_ptr() for p in groups[0]]
    ref_opt = make_optimizer("AdamW", "for-loop", ref_groups)
    opt = fuse_optimizer(make_optimizer("AdamW", "for-loop", groups), do_flatten=False)
    assert [p.data_ptr() for p in groups[0]] == pointers
    for t in range(6):
        set_grads(ref_groups, t)
        set_grads(groups, t)
        ref_opt.step()
        opt.fuse_step()
    assert_same(ref_groups, groups, ref_opt, opt)
    assert [p.data_ptr() for p in groups[0]] == pointers


def test_flattened_group_fuses_into_few_views():
    """A fused step hands the optimizer one view per run: the unused and frozen parameters cut
    group 0 into runs; float64 and float32 make two runs in group 1."""
    groups = make_params()
    opt = fuse_optimizer(make_optimizer("SGD", "for-loop", groups))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append([len(g["params"]) for g in o.param_groups]))
    set_grads(groups, 0)
    opt.fuse_step()
    # group 0: runs [0..2] and [5..6] + the unused and frozen params stepped as they are
    # group 1: a float64 run of 3 and a float32 run of 2
    assert seen == [[2 + 2, 2]]


@pytest.mark.parametrize("check_flatten", [True, False])
def test_replaced_param_data_stays_correct_and_warns_once(check_flatten):
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer("Adam", "for-loop", ref_groups)
    opt = fuse_optimizer(make_optimizer("Adam", "for-loop", groups), check_flatten=check_flatten)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(8):
            if t in (2, 5):  # the user replaces storage behind the optimizer's back
                for ps in (ref_groups[0], groups[0]):
                    ps[1].data = ps[1].data.clone()
                    ps[5].data = ps[5].data * 1.0
            set_grads(ref_groups, t)
            set_grads(groups, t)
            ref_opt.step()
            opt.fuse_step()
    assert_same(ref_groups, groups, ref_opt, opt)
    moved = [w for w in caught if "no longer live in the flat buffers" in str(w.message)]
    assert len(moved) == (1 if check_flatten else 0)
    if check_flatten:  # flattened again: back to one buffer
        assert groups[0][1].data_ptr() + 3 * 4 == groups[0][2].data_ptr()


# ---- torch 2.x habits -------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 16)
        self.unused = torch.nn.Linear(3, 3)
        self.c = torch.nn.Linear(16, 2)
        self.a.weight.requires_grad_(False)  # frozen

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def batches(n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(n)]


def two_copies(make_opt, fuse_kwargs=None):
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    return ref, make_opt(ref), net, fuse_optimizer(make_opt(net), **(fuse_kwargs or {}))


def loss_of(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def assert_models_equal(ref, net):
    for (n, p), q in zip(ref.named_parameters(), net.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_loop_with_backward_and_zero_grad(set_to_none):
    def make(net):
        return torch.optim.AdamW([{"params": [net.b.weight, net.b.bias, net.unused.weight]},
                                  {"params": [net.a.weight, net.a.bias, net.c.weight, net.c.bias, net.unused.bias], "lr": 3e-3}],
                                 lr=1e-2, weight_decay=0.1)
    ref, ref_opt, net, opt = two_copies(make)
    grad_pointer = None
    for t, (x, y) in enumerate(batches(20)):
        for model, o in ((ref, ref_opt), (net, opt)):
            o.zero_grad(set_to_none=set_to_none)
            loss_of(model, x, y).backward()
        if not set_to_none and t > 1:  # backward accumulated into the flat gradient views
            assert net.b.bias.grad.data_ptr() == grad_pointer
        grad_pointer = net.b.bias.grad.data_ptr()
        ref_opt.step()
        backward_made = net.b.bias.grad
        opt.fuse_step()
        if set_to_none and t > 0:  # a fresh gradient is copied, and left where backward put it
            assert net.b.bias.grad is backward_made
    assert_models_equal(ref, net)
    assert net.unused.weight.grad is None and net.a.weight.grad is None


def test_gradients_kept_between_steps_move_into_the_flat_buffer():
    """After steps with fresh gradients, switching to ``zero_grad(set_to_none=False)`` moves the
    surviving gradients into the flat buffer (one step later), so that backward accumulates there."""
    ref, ref_opt, net, opt = two_copies(lambda n: torch.optim.Adam(n.parameters(), lr=1e-2))
    fused = [p for p in net.parameters() if p.requires_grad and p is not net.unused.weight and p is not net.unused.bias]
    for t, (x, y) in enumerate(batches(8)):
        for model, o in ((ref, ref_opt), (net, opt)):
            o.zero_grad(set_to_none=t < 4)
            loss_of(model, x, y).backward()
        ref_opt.step()
        opt.fuse_step()
    assert_models_equal(ref, net)
    buffers = {p.grad.untyped_storage().data_ptr() for p in fused}
    bucket_grads = {b.grads_buffer.untyped_storage().data_ptr() for _, bs in opt._bagua_fusion.layouts.values() for b in bs}
    assert buffers <= bucket_grads


def test_lr_scheduler_attached_to_fused_optimizer():
    def make(net):
        return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref, ref_opt, net, opt = two_copies(make)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.5, total_steps=12)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for x, y in batches(10):
            for model, o in ((ref, ref_opt), (net, opt)):
                o.zero_grad()
                loss_of(model, x, y).backward()
            ref_opt.step()
            opt.fuse_step()
            ref_sched.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert_models_equal(ref, net)


def test_state_dict_round_trips_between_fused_and_plain():
    def make(net):
        return torch.optim.Adam(net.parameters(), lr=1e-2)
    ref, ref_opt, net, opt = two_copies(make)
    data = batches(12)

    def train(pairs, chunk):
        for x, y in chunk:
            for model, o, fused in pairs:
                o.zero_grad()
                loss_of(model, x, y).backward()
                (o.fuse_step if fused else o.step)()

    train([(ref, ref_opt, False), (net, opt, True)], data[:4])
    # fused -> plain: a fresh plain optimizer on a copy of the fused model
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    plain_net = Net()
    plain_net.load_state_dict(saved["model"])
    plain_opt = make(plain_net)
    plain_opt.load_state_dict(saved["opt"])
    train([(ref, ref_opt, False), (net, opt, True), (plain_net, plain_opt, False)], data[4:8])
    assert_models_equal(ref, plain_net)
    # plain -> fused: the fused optimizer loads the plain one's state and goes on
    opt.load_state_dict(plain_opt.state_dict())
    net.load_state_dict(plain_net.state_dict())
    train([(ref, ref_opt, False), (net, opt, True)], data[8:])
    assert_models_equal(ref, net)
    assert_same([list(ref.parameters())], [list(net.parameters())], ref_opt, opt)


def test_grad_scaler_with_fused_steps_skips_inf_and_matches_plain():
    def make(net):
        return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref, ref_opt, net, opt = two_copies(make)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for t, (x, y) in enumerate(batches(8)):
        for model, o, scaler in ((ref, ref_opt, scalers[0]), (net, opt, scalers[1])):
            o.zero_grad()
            scaler.scale(loss_of(model, x, y)).backward()
            if t == 3:  # an overflow: the step must be skipped and the scale halved
                model.b.weight.grad.view(-1)[0] = float("inf")
        scalers[0].step(ref_opt)
        count = opt._bagua_fused_count
        with fused_steps(opt):
            scalers[1].step(opt)
        assert opt._bagua_fused_count == (count if t == 3 else count + 1)
        for scaler in scalers:
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert_models_equal(ref, net)
    assert "step" not in vars(opt)  # fused_steps restored plain step()


def test_closure_is_evaluated_once_and_loss_returned():
    def make(net):
        return torch.optim.RMSprop(net.parameters(), lr=1e-2)
    ref, ref_opt, net, opt = two_copies(make)
    calls = [0]
    for x, y in batches(5):
        def closure(model=net, o=opt):
            calls[0] += 1
            o.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = loss_of(ref, x, y)
            loss.backward()
            return loss
        assert torch.equal(opt.fuse_step(closure), ref_opt.step(ref_closure))
    assert calls[0] == 5
    assert_models_equal(ref, net)


def test_lbfgs_is_refused_by_the_check_and_steps_like_step():
    """LBFGS calls its closure many times and keeps per-group history: the check cannot step it
    without a closure, so the group is left unfused and fuse_step(closure) is step(closure)."""
    def make(net):
        return torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4)
    ref, ref_opt, net, opt = two_copies(make)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(3):
            for model, o in ((ref, ref_opt), (net, opt)):
                def closure(model=model, o=o):
                    o.zero_grad()
                    loss = loss_of(model, x, y)
                    loss.backward()
                    return loss
                (o.fuse_step if o is opt else o.step)(closure)
    assert_models_equal(ref, net)
    assert opt._bagua_fused_count == 0
    assert len([w for w in caught if "stays unfused" in str(w.message)]) == 1


def test_add_param_group_after_fusing():
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.Adamax(ref_groups[0], lr=1e-2)
    opt = fuse_optimizer(torch.optim.Adamax(groups[0], lr=1e-2))
    for t in range(6):
        if t == 2:
            ref_opt.add_param_group({"params": ref_groups[1], "lr": 1e-3})
            opt.add_param_group({"params": groups[1], "lr": 1e-3})
        set_grads(ref_groups if t >= 2 else ref_groups[:1], t)
        set_grads(groups if t >= 2 else groups[:1], t)
        ref_opt.step()
        opt.fuse_step()
    assert_same(ref_groups, groups, ref_opt, opt)


def test_sparse_gradients_fail_like_step():
    p = torch.nn.Parameter(torch.randn(5, 2))
    q = torch.nn.Parameter(torch.randn(3))
    opt = fuse_optimizer(torch.optim.Adam([p, q], lr=1e-2))
    p.grad = torch.randn(5, 2).to_sparse()
    q.grad = torch.randn(3)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.fuse_step()
    assert opt.param_groups[0]["params"] == [p, q]  # the fused views were taken out again


@pytest.mark.parametrize("name", ["Adam", "Rprop", "ASGD", "Adagrad", "SGD"])
def test_runs_cut_into_chunks_mid_parameter_still_match(name, monkeypatch):
    """On the CPU a run is handed to the optimizer in pieces of at most CPU_CHUNK_BYTES; pieces
    cut parameters in two and the optimizer makes state per piece. Tiny pieces here (10
    elements) to exercise that."""
    import functional_bagua.compat.runs as runs

    monkeypatch.setattr(runs, "CPU_CHUNK_BYTES", 40)
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer(name, "foreach", ref_groups)
    opt = fuse_optimizer(make_optimizer(name, "foreach", groups))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(len(o.param_groups[0]["params"])))
    for t in range(12):
        set_grads(ref_groups, t)
        set_grads(groups, t)
        ref_opt.step()
        (opt.fuse_step if t % 3 else opt.step)()
    assert_same(ref_groups, groups, ref_opt, opt)
    # group 0's runs hold 15+3+16 and 7+3 elements: 4 + 1 pieces, plus 2 parameters stepped alone
    assert seen[0] == 4 + 1 + 2


def test_the_check_leaves_the_real_optimizer_and_its_hooks_alone():
    class Counting(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            self.calls += 1
            return super().step(closure)

    ref_params, params = make_params()[1], make_params()[1]
    ref_opt, opt = Counting(ref_params, lr=0.1, momentum=0.9), fuse_optimizer(Counting(params, lr=0.1, momentum=0.9))
    hook_calls = {id(ref_opt): 0, id(opt): 0}

    def hook(o, args, kwargs):
        hook_calls[id(o)] += 1
    for o in (ref_opt, opt):
        o.register_step_post_hook(hook)
    for t in range(3):
        set_grads([ref_params], t)
        set_grads([params], t)
        ref_opt.step()
        opt.fuse_step()
    # the check's probe steps are invisible: same attribute updates, same hook calls as step()
    assert opt.calls == ref_opt.calls == 3
    assert hook_calls[id(opt)] == hook_calls[id(ref_opt)] > 0
    assert opt._bagua_fused_count == 3
    assert_same([ref_params], [params], ref_opt, opt)


def test_large_parameters_on_the_cpu_are_stepped_alone(monkeypatch):
    """Above CPU_FUSE_MAX_NUMEL elements a parameter is not fused (nothing to gain, a gradient
    copy to lose); results stay the same."""
    import functional_bagua.compat.runs as runs

    monkeypatch.setattr(runs, "CPU_FUSE_MAX_NUMEL", 6)
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer("NAdam", "for-loop", ref_groups)
    opt = fuse_optimizer(make_optimizer("NAdam", "for-loop", groups))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append([len(g["params"]) for g in o.param_groups]))
    for t in range(4):
        set_grads(ref_groups, t)
        set_grads(groups, t)
        ref_opt.step()
        opt.fuse_step()
    assert_same(ref_groups, groups, ref_opt, opt)
    # large parameters are not moved into the flat buffers either: they keep their own storage
    for ps in groups:
        for p in ps:
            if p.numel() > 6 or not p.requires_grad:
                assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    # group 0: only (3,) and (3, 1) are small, and they are not neighbours: nothing to fuse there.
    # group 1: float64 (6,) sits between (3, 2) and (2, 3), all <= 6: one run; float32 (2, 2), (5,): one run
    assert seen[0] == [7, 2]


def test_a_fused_optimizer_is_freed_without_the_garbage_collector():
    """No reference cycle through fuse_step: dropping the optimizer frees its flat buffers at once."""
    import gc
    import weakref

    params = make_params()[0]
    opt = fuse_optimizer(torch.optim.Adam(params, lr=1e-3))
    set_grads([params], 0)
    opt.fuse_step()
    gc.disable()
    try:
        ref = weakref.ref(opt)
        del opt
        assert ref() is None
    finally:
        gc.enable()


def test_a_fuse_step_kept_without_its_optimizer_says_so():
    step = fuse_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)).fuse_step
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match="optimizer was freed"):
        step()


@pytest.mark.parametrize("edit", ["replace exp_avg", "reset state", "delete state", "new step tensor", "bump step in place"])
def test_state_edited_between_fused_steps_is_respected(edit):
    """A fused step re-reads ``optimizer.state`` entries a user replaced, reset or changed in
    place between steps, exactly as ``step()`` does."""
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer("Adam", "for-loop", ref_groups)
    opt = fuse_optimizer(make_optimizer("Adam", "for-loop", groups))

    def apply_edit(o, p):
        if edit == "replace exp_avg":
            o.state[p]["exp_avg"] = torch.full_like(p, 0.5)
        elif edit == "reset state":
            o.state[p] = {}
        elif edit == "delete state":
            del o.state[p]
        elif edit == "new step tensor":
            o.state[p]["step"] = torch.tensor(40.0)
        else:
            o.state[p]["step"].add_(7)

    for t in range(6):
        set_grads(ref_groups, t)
        set_grads(groups, t)
        if t == 3:
            apply_edit(ref_opt, ref_groups[0][2])
            apply_edit(opt, groups[0][2])
        ref_opt.step()
        opt.fuse_step()
    assert_same(ref_groups, groups, ref_opt, opt)


@pytest.mark.parametrize("kwargs", [dict(), dict(momentum=0.9)], ids=["no-state", "momentum"])
def test_the_plan_is_kept_between_steps(kwargs, monkeypatch):
    """Planning (finding runs) happens once; later steps only check that nothing moved, also
    for an optimizer that keeps no state at all (SGD without momentum)."""
    import functional_bagua.compat.fuse as fuse

    plans = []
    original = fuse.candidate_runs
    monkeypatch.setattr(fuse, "candidate_runs", lambda *args: plans.append(1) or original(*args))
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.SGD([{"params": ref_groups[0]}, {"params": ref_groups[1]}], lr=0.1, **kwargs)
    opt = fuse_optimizer(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1, **kwargs))
    for t in range(6):
        set_grads(ref_groups, t)
        set_grads(groups, t)
        ref_opt.step()
        opt.fuse_step()
    assert_same(ref_groups, groups, ref_opt, opt)
    # once per group: the state the first step creates is adopted by the runs, not re-planned
    assert len(plans) == 2


def test_a_kept_plan_copies_only_the_gradients_that_moved(monkeypatch):
    """Within one kept plan, every mix of gradients: all in their flat views, all fresh, some
    fresh (every third parameter given a new tensor), and some surviving zero_grad in place
    while others are fresh. Each step equals plain step, the plan is made once per group, and
    a gradient that survived since the last fused step ends up in the flat buffer."""
    import functional_bagua.compat.fuse as fuse

    plans = []
    original = fuse.candidate_runs
    monkeypatch.setattr(fuse, "candidate_runs", lambda *args: plans.append(1) or original(*args))
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.SGD([{"params": ref_groups[0]}, {"params": ref_groups[1]}], lr=0.1, momentum=0.9)
    opt = fuse_optimizer(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1, momentum=0.9))
    patterns = ["fresh", "in place", "every third fresh", "in place", "fresh", "every third fresh", "every third fresh"]
    for t, pattern in enumerate(patterns):
        gen = torch.Generator().manual_seed(t)
        for ps, qs in zip(ref_groups, groups):
            for i, (p, q) in enumerate(zip(ps, qs)):
                if not p.requires_grad:
                    continue
                g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
                fresh = pattern == "fresh" or (pattern == "every third fresh" and i % 3 == 0)
                if fresh or p.grad is None:
                    p.grad, q.grad = g.clone(), g.clone()
                else:
                    p.grad.copy_(g)
                    q.grad.copy_(g)
        ref_opt.step()
        opt.fuse_step()
        assert_same(ref_groups, groups, ref_opt, opt)
    assert len(plans) == 2
    grads_buffers = {b.grads_buffer.untyped_storage().data_ptr() for _, bs in opt._bagua_fusion.layouts.values() for b in bs}
    survivors = [q for i, q in enumerate(groups[0]) if q.requires_grad and i % 3 != 0]
    assert survivors and all(q.grad.untyped_storage().data_ptr() in grads_buffers for q in survivors)


def test_state_index_reads_by_position_and_sees_replaced_dicts():
    """StateIndex (how the plan checks read optimizer.state without hashing tensors) against
    plain dict lookups, through replacement, deletion and insertion of entries."""
    from collections import defaultdict

    from functional_bagua.compat.runs import StateIndex

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(4)]
    state = defaultdict(dict)
    for p in params[:3]:
        state[p]["k"] = 1
    index = StateIndex()

    def read(members):
        index.read(state)
        return list(index.getter(members)(index.values))

    def expected(members):
        return [state.get(p, {}) for p in members]

    members = [params[2], params[0], params[3]]
    got = read(members)
    assert all(a is b for a, b in zip(got[:2], expected(members)[:2])) and got[2] == {}
    generation = index.generation
    state[params[0]] = {"k": 2}  # replaced under the same key: same positions, new dict seen
    assert read(members)[1] is state[params[0]] and index.generation == generation
    del state[params[2]]  # a deletion starts a new generation of positions
    state[params[3]]["k"] = 3  # and so does an insertion
    got = read(members)
    assert index.generation > generation
    assert got[0] == {} and got[1] is state[params[0]] and got[2] is state[params[3]]
    index.release()
    assert index.values == []


# ---- fresh gradients and cheap optimizers ----------------------------------------------------


class OneForeachOp(torch.optim.Optimizer):
    """``p <- p - lr g`` for all parameters in one ``_foreach_add_``: one foreach slot per tensor."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            torch.zeros(())  # a per-step op that does not depend on the number of tensors
            torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])


class OpsPerTensor(torch.optim.Optimizer):
    """``p <- (p - lr g) * 1`` tensor by tensor, ``ops`` single-tensor ops each."""

    def __init__(self, params, lr=0.1, ops=2):
        super().__init__(params, dict(lr=lr, ops=ops))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
                    for _ in range(group["ops"] - 1):
                        p.mul_(1.0)


@pytest.mark.parametrize("make,work", [
    (lambda ps: OneForeachOp(ps), 1),
    (lambda ps: OpsPerTensor(ps, ops=1), SINGLE_OP_WORK),
    (lambda ps: OpsPerTensor(ps, ops=3), 3 * SINGLE_OP_WORK),
], ids=["one-foreach-op", "one-op-per-tensor", "three-ops-per-tensor"])
def test_probe_counts_the_per_tensor_work_of_a_step(make, work):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(4,), (3, 2), (5,)]]
    optimizer = make(params)
    found = probe(optimizer, optimizer.param_groups[0], params)
    assert found.reason is None and found.work_per_param == work


def count_probes(monkeypatch) -> list:
    """A list that gets one entry per probe fuse_step runs."""
    import functional_bagua.compat.fuse as fuse

    probes, original = [], fuse.probe
    monkeypatch.setattr(fuse, "probe", lambda *args: probes.append(1) or original(*args))
    return probes


def bert_adam_pair(**kwargs) -> tuple:
    """``(ref_groups, groups, ref_opt, opt)``: BertAdam on group 0 of two identical parameter
    sets, the second passed through fuse_optimizer."""
    ref_groups, groups = make_params(), make_params()
    ref_opt = BertAdam([{"params": ref_groups[0]}], lr=1e-2, **kwargs)
    return ref_groups, groups, ref_opt, fuse_optimizer(BertAdam([{"params": groups[0]}], lr=1e-2, **kwargs))


def test_a_hyperparameter_that_turns_per_tensor_math_on_asks_for_a_new_probe(monkeypatch):
    """BertAdam without its clip (max_grad_norm=0) is elementwise and fused; set max_grad_norm=1
    mid-training and its clip is per parameter: fuse_step probes again, warns, steps the group
    unfused, and matches plain step bit for bit. A learning rate and a beta that change every
    step (as with a scheduler) probe nothing new."""
    probes = count_probes(monkeypatch)
    ref_groups, groups, ref_opt, opt = bert_adam_pair(max_grad_norm=0.0)
    fused, caught = [], []
    for t in range(8):
        for o in (ref_opt, opt):
            o.param_groups[0]["lr"] = 1e-2 / (t + 1)
            o.param_groups[0]["b1"] = 0.9 - 0.01 * t  # as a momentum schedule would
            o.param_groups[0]["max_grad_norm"] = 1.0 if t >= 4 else 0.0
        for gs in ([ref_groups[0]], [groups[0]]):
            set_grads(gs, t)
            for p in gs[0]:
                if p.grad is not None:
                    p.grad.mul_(50.0)  # norms well above the clip threshold once it is on
        before = opt._bagua_fused_count
        ref_opt.step()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.fuse_step()
        caught += [str(w.message) for w in seen if "stays unfused" in str(w.message)]
        fused.append(opt._bagua_fused_count - before)
        assert_same([ref_groups[0]], [groups[0]], ref_opt, opt)
    assert fused == [1, 1, 1, 1, 0, 0, 0, 0]
    assert len(probes) == 2 and len(caught) == 1


def test_a_clip_threshold_lowered_from_inf_asks_for_a_new_probe():
    """The verdict was kept per sign of each hyperparameter, so BertAdam's per-parameter clip
    lowered from inf (never clips: elementwise, fused) to 0.1 (clips per tensor) stayed fused and
    differed from step() by up to 1.7e-2 with no warning. Now any value other than a scheduled
    lr/momentum/betas/weight_decay probes again."""
    ref_groups, groups, ref_opt, opt = bert_adam_pair(max_grad_norm=float("inf"))
    fused = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in range(6):
            for o in (ref_opt, opt):
                o.param_groups[0]["max_grad_norm"] = 0.1 if t >= 3 else float("inf")
            set_grads([ref_groups[0]], t)
            set_grads([groups[0]], t)
            before = opt._bagua_fused_count
            ref_opt.step()
            opt.fuse_step()
            fused.append(opt._bagua_fused_count - before)
            assert_same([ref_groups[0]], [groups[0]], ref_opt, opt)
    assert fused == [1, 1, 1, 0, 0, 0]
    messages = [str(w.message) for w in seen]
    assert sum("stays unfused" in m for m in messages) == 1
    assert sum("['max_grad_norm'] changed, so fuse_step probes again" in m for m in messages) == 1


def test_a_value_that_changes_every_step_probes_each_time_and_warns_once(monkeypatch):
    """A hyperparameter outside the scheduled names that changes every step costs a probe per
    step (keeping only the last verdict), is said once, and the result stays plain step's."""
    probes = count_probes(monkeypatch)
    ref_groups, groups, ref_opt, opt = bert_adam_pair(max_grad_norm=0.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in range(5):
            for o in (ref_opt, opt):
                o.param_groups[0]["e"] = 1e-6 * (t + 1)
            set_grads([ref_groups[0]], t)
            set_grads([groups[0]], t)
            ref_opt.step()
            opt.fuse_step()
            assert_same([ref_groups[0]], [groups[0]], ref_opt, opt)
    assert len(probes) == 5 and len(opt._bagua_fusion.probes) == 1
    assert sum("['e'] changed" in str(w.message) for w in seen) == 1


def test_channels_last_parameters_keep_their_memory_format():
    """do_flatten made every parameter a contiguous view of the flat buffer, so a channels_last
    convolution kernel lost its memory format; such parameters are now stepped where they are."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
        return model.to(memory_format=torch.channels_last)

    reference, model = make(), make()
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opt = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for _ in range(3):
        for m, o, step in ((reference, ref_opt, ref_opt.step), (model, opt, opt.fuse_step)):
            o.zero_grad()
            m(x).square().sum().backward()
            step()
    for conv in (model[0], model[1]):
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
        assert opt.state[conv.weight]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_sparse_csr_parameters_step_like_step():
    """A CSR gradient passed the sparse check (``is_sparse`` is False for CSR) and fuse_step
    failed inside; CSR tensors are now stepped as step() steps them."""
    def run(fused):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 4, generator=gen).to_sparse_csr()) for _ in range(2)]
        params += [torch.nn.Parameter(torch.randn(3, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
        opt = torch.optim.SGD(params, lr=0.1)
        opt = fuse_optimizer(opt) if fused else opt
        for t in range(3):
            for p in params:
                p.grad = torch.full((4, 4), t + 1.0).to_sparse_csr() if p.layout == torch.sparse_csr else torch.full(p.shape, t + 1.0)
            (opt.fuse_step if fused else opt.step)()
        return [p.detach().to_dense() for p in params]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Sparse CSR tensor support is in beta state"
        assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


@pytest.mark.parametrize("name", ["SGD momentum foreach", "SGD momentum for-loop", "Adagrad"])
def test_gradients_with_a_dtype_of_their_own_are_never_rounded_into_the_flat_buffer(name):
    """torch 2.x lets a parameter keep gradients of another dtype (``p.grad_dtype``, e.g. float64
    gradients for float32 parameters). Such a parameter is stepped on its own, also when it got
    its grad_dtype after fusion had planned it in a float32 run: equal to plain step bit for bit,
    and its float64 gradient is left as it is (before, it was rounded into the float32 buffer, or
    re-pointing it there raised)."""
    make = {
        "SGD momentum foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
        "SGD momentum for-loop": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
        "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    }[name]

    def params():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5, 3), (3,), (4, 4), (6,), (2, 2), (7,)]]

    ref, fused = params(), params()
    ref_opt, opt = make(ref), fuse_optimizer(make(fused))
    for t in range(8):
        if t in (0, 4):  # the second parameter from the start, the third once fused in a run
            for ps in (ref, fused):
                ps[1 if t == 0 else 2].grad = None
                ps[1 if t == 0 else 2].grad_dtype = torch.float64
        gen = torch.Generator().manual_seed(t + 1)
        for p, q in zip(ref, fused):
            g = torch.randn(p.shape, generator=gen).to(p.grad_dtype) * 1.001
            p.grad, q.grad = g.clone(), g.clone()
        before = opt._bagua_fused_count
        ref_opt.step()
        opt.fuse_step()
        assert opt._bagua_fused_count - before == 1  # the float32-gradient parameters still fused
        for p, q in zip(ref, fused):
            assert torch.equal(p, q) and q.grad.dtype == p.grad.dtype and torch.equal(p.grad, q.grad)
            for key, value in ref_opt.state[p].items():
                assert torch.equal(value, opt.state[q][key]), key


HALF_CASES = {
    "SGD momentum for-loop": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "SGD momentum foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "SGD for-loop": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    "Adam foreach": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(HALF_CASES))
def test_half_precision_steps_equal_plain_step(name, dtype):
    """CPU kernels run a vectorized loop and a scalar tail, which in bfloat16/float16 round
    differently (often for SGD's ``add_(b, alpha=a)``, rarely for RMSprop's or Adam's ops), and a
    flat tensor moves elements from one to the other: fuse_step leaves half-precision CPU
    parameters as they are, and every step equals plain step bit for bit."""
    def params():
        gen = torch.Generator().manual_seed(0)
        shapes = [(5, 3), (3,), (4, 4), (6,), (2, 2), (7,), (40,), (9, 9)]
        return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]

    ref, fused = params(), params()
    ref_opt, opt = HALF_CASES[name](ref), fuse_optimizer(HALF_CASES[name](fused))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the expected "stays unfused" of SGD
        for t in range(10):
            gen = torch.Generator().manual_seed(t + 1)
            for p, q in zip(ref, fused):
                g = torch.randn(p.shape, generator=gen).to(dtype)
                p.grad, q.grad = g.clone(), g.clone()
            ref_opt.step()
            opt.fuse_step()
            assert all(torch.equal(p, q) for p, q in zip(ref, fused)), t
    assert opt._bagua_fused_count == 0
    assert len({q.untyped_storage().data_ptr() for q in fused}) == len(fused)  # not moved into a flat buffer


def test_the_probe_sees_position_dependent_rounding():
    """The probe itself, on members too small for one vector of the CPU kernels: it steps at
    least PROBE_MIN_NUMEL elements, so bfloat16 SGD's vector/tail difference shows (before, three
    members of a few elements each were all tail, fused or not)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in [(3,), (2, 2), (6,), (7,), (5, 3)] * 8]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert probe(optimizer, optimizer.param_groups[0], params).reason is not None
    params32 = [torch.nn.Parameter(p.detach().float()) for p in params]
    optimizer = torch.optim.SGD(params32, lr=0.1, momentum=0.9)
    assert probe(optimizer, optimizer.param_groups[0], params32).reason is None


class MatricesPerTensor(torch.optim.Optimizer):
    """``p <- p - lr g`` for vectors, ``p <- p - lr g / ||g||`` for matrices: elementwise or per
    tensor depending on the parameter's number of dimensions."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad if p.dim() < 2 else p.grad / p.grad.norm(), alpha=-group["lr"])


def _vectors_then_matrices(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5,), (3,), (4, 4), (2, 3)]]


def test_a_verdict_on_vectors_is_not_reused_for_matrices():
    """The first fused steps see gradients on the vectors only (the probe finds them
    elementwise); when the matrices get gradients too they join the run, which now holds
    matrices: it is probed afresh and stepped unfused. Same bits as plain step throughout."""
    ref, fused = _vectors_then_matrices(), _vectors_then_matrices()
    ref_opt, opt = MatricesPerTensor(ref), fuse_optimizer(MatricesPerTensor(fused))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(6):
            gen = torch.Generator().manual_seed(t)
            for p, q in zip(ref, fused):
                g = torch.randn(p.shape, generator=gen)
                if p.grad is not None:  # kept in place (a fresh one would leave this cheap step unfused)
                    p.grad.copy_(g)
                    q.grad.copy_(g)
                elif p.dim() == 1 or t >= 2:
                    p.grad, q.grad = g.clone(), g.clone()
            ref_opt.step()
            opt.fuse_step()
            assert all(torch.equal(p, q) for p, q in zip(ref, fused)), t
    assert opt._bagua_fused_count == 2  # the vectors' run, before the matrices had gradients
    assert sum("stays unfused" in str(w.message) for w in caught) == 1


def test_a_verdict_is_not_reused_for_another_group_at_the_same_index():
    """Group 0 holds vectors (fused), group 1 matrices (per tensor, unfused). Remove group 0 and
    group 1 is now at index 0: it keeps its own verdict, not group 0's."""
    ref_params, params = _vectors_then_matrices(), _vectors_then_matrices()
    ref_opt = MatricesPerTensor([{"params": ref_params[:2]}, {"params": ref_params[2:]}])
    opt = fuse_optimizer(MatricesPerTensor([{"params": params[:2]}, {"params": params[2:]}]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # group 1's expected "stays unfused"
        for t in range(6):
            if t == 3:
                ref_opt.param_groups.pop(0)
                opt.param_groups.pop(0)
            gen = torch.Generator().manual_seed(t)
            for p, q in zip(ref_params, params):
                g = torch.randn(p.shape, generator=gen)
                if p.grad is None:
                    p.grad, q.grad = g.clone(), g.clone()
                else:  # kept in place (a fresh one would leave this cheap step unfused)
                    p.grad.copy_(g)
                    q.grad.copy_(g)
            ref_opt.step()
            opt.fuse_step()
            assert all(torch.equal(p, q) for p, q in zip(ref_params[2:], params[2:])), t


def fused_count_per_step(opt, groups, ref_opt, ref_groups, steps, fresh) -> list:
    """``_bagua_fused_count`` increments of ``steps`` fuse_steps (ref: plain steps), gradients
    fresh tensors or written into the existing ``.grad``."""
    counts = []
    for t in range(steps):
        for gs in (ref_groups, groups):
            set_grads(gs, 0 if fresh else 1, seed=t)  # set_grads: new tensors on even steps
        before = opt._bagua_fused_count
        ref_opt.step()
        opt.fuse_step()
        counts.append(opt._bagua_fused_count - before)
    return counts


@pytest.mark.parametrize("foreach", [True, False])
def test_cheap_optimizers_step_fresh_gradients_unfused(foreach):
    """torch's SGD without momentum does one foreach slot of work per tensor (foreach) or one
    single-tensor op (for-loop, two slots): copying fresh gradients into the flat buffer costs
    about what fusion saves, so fuse_step steps it unfused then, and fused as soon as gradients
    stay in place. With momentum (three slots and more) it is fused either way. Same bits
    throughout."""
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.SGD([{"params": ref_groups[0]}, {"params": ref_groups[1], "lr": 0.01}], lr=0.1, foreach=foreach)
    opt = fuse_optimizer(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1], "lr": 0.01}], lr=0.1, foreach=foreach))
    fresh = fused_count_per_step(opt, groups, ref_opt, ref_groups, 6, fresh=True)
    in_place = fused_count_per_step(opt, groups, ref_opt, ref_groups, 6, fresh=False)
    assert_same(ref_groups, groups, ref_opt, opt)
    assert fresh == [2, 0, 0, 0, 0, 0]  # the first step plans, and fuses
    assert in_place == [2] * 6
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.SGD([{"params": ref_groups[0]}, {"params": ref_groups[1]}], lr=0.1, momentum=0.9, foreach=foreach)
    opt = fuse_optimizer(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1, momentum=0.9, foreach=foreach))
    assert fused_count_per_step(opt, groups, ref_opt, ref_groups, 4, fresh=True) == [2] * 4
    assert_same(ref_groups, groups, ref_opt, opt)


@pytest.mark.parametrize("foreach", [True, False])
def test_momentum_turned_on_later_is_fused_with_fresh_gradients(foreach):
    """SGD without momentum is stepped unfused while its gradients are fresh; set momentum on
    mid-training and its step does three slots per tensor or more: the next fresh-gradient step
    probes again and fuses. Same bits throughout."""
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.SGD([{"params": ref_groups[0]}, {"params": ref_groups[1]}], lr=0.1, foreach=foreach)
    opt = fuse_optimizer(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1, foreach=foreach))
    assert fused_count_per_step(opt, groups, ref_opt, ref_groups, 3, fresh=True) == [2, 0, 0]
    for o in (ref_opt, opt):
        for group in o.param_groups:
            group["momentum"] = 0.9
    assert fused_count_per_step(opt, groups, ref_opt, ref_groups, 4, fresh=True) == [2] * 4
    assert_same(ref_groups, groups, ref_opt, opt)


# ---- any sequence of what training code does, against plain step (hypothesis) -------------------

ACTIONS = ["fresh", "in place", "every other fresh", "drop a gradient", "plain step", "new lr", "replace p.data",
           "state_dict round trip", "clip on", "replace a state tensor", "scale a state tensor in place"]


def _act(action, t, pair):
    """Apply ``action`` at step ``t`` to one copy ``(groups, optimizer)``; both copies get the same."""
    groups, opt = pair
    gen = torch.Generator().manual_seed(1000 + t)
    trainable = [(gi, i, p) for gi, ps in enumerate(groups) for i, p in enumerate(ps) if p.requires_grad and (gi, i) not in UNUSED]
    for k, (gi, i, p) in enumerate(trainable):
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        fresh = action != "in place" and (action != "every other fresh" or k % 2 == 0)
        if p.grad is None or fresh:
            p.grad = g
        else:
            p.grad.copy_(g)
    if action == "drop a gradient":
        trainable[t % len(trainable)][2].grad = None
    elif action == "new lr":
        opt.param_groups[0]["lr"] *= 0.5
    elif action == "replace p.data":
        p = trainable[t % len(trainable)][2]
        p.data = p.data.clone()
    elif action == "state_dict round trip":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif action == "clip on" and "max_grad_norm" in opt.param_groups[0]:
        opt.param_groups[0]["max_grad_norm"] = 1.0
    elif action in ("replace a state tensor", "scale a state tensor in place"):
        p = trainable[t % len(trainable)][2]
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if action == "replace a state tensor":
                    opt.state[p][key] = value.clone()
                else:
                    value.mul_(0.5)


SEQUENCE_OPTIMIZERS = {
    "SGD momentum foreach": lambda gs: torch.optim.SGD([{"params": gs[0]}, {"params": gs[1], "lr": 0.01}], lr=0.05, momentum=0.9, foreach=True),
    "Adam for-loop": lambda gs: torch.optim.Adam([{"params": gs[0]}, {"params": gs[1], "weight_decay": 0.1}], lr=1e-2, foreach=False),
    "Adadelta foreach": lambda gs: torch.optim.Adadelta([{"params": gs[0]}, {"params": gs[1]}], lr=1.0, foreach=True),
    "BertAdam, clip off": lambda gs: BertAdam([{"params": gs[0]}, {"params": gs[1]}], lr=1e-2, max_grad_norm=0.0),
    "SGD foreach": lambda gs: torch.optim.SGD([{"params": gs[0]}, {"params": gs[1], "lr": 0.01}], lr=0.1, foreach=True),
}


@settings(max_examples=50, deadline=None)
@example(name="BertAdam, clip off", actions=["fresh", "clip on", "fresh"])  # the probe's verdict must not outlive the clip
@example(name="SGD momentum foreach", actions=["every other fresh", "in place", "drop a gradient", "state_dict round trip",
                                               "replace p.data", "plain step", "new lr", "fresh"])
@given(name=st.sampled_from(sorted(SEQUENCE_OPTIMIZERS)), actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=10))
def test_any_sequence_of_training_habits_equals_plain_step(name, actions):
    """Fresh, kept and missing gradients, plain steps in between, lr changes, replaced p.data,
    state_dict round trips, state tensors replaced or changed in place, and a per-tensor clip
    switched on, in any order: after every step the fused optimizer's parameters and state equal
    plain step's bit for bit."""
    ref_groups, groups = make_params(), make_params()
    ref = (ref_groups, SEQUENCE_OPTIMIZERS[name](ref_groups))
    fused = (groups, fuse_optimizer(SEQUENCE_OPTIMIZERS[name](groups)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no longer live in the flat buffers", "stays unfused"
        for t, action in enumerate(actions):
            _act(action, t, ref)
            _act(action, t, fused)
            ref[1].step()
            (fused[1].step if action == "plain step" else fused[1].fuse_step)()
            assert_same(ref_groups, groups, ref[1], fused[1])
