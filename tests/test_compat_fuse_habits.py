"""functional_bagua.compat.fuse_optimizer keeps torch 2.x habits working: training loops with
zero_grad (set_to_none or not), lr schedulers, state_dict round trips, GradScaler, closures,
LBFGS, add_param_group, sparse gradients, freeing the optimizer, optimizer state edited between
steps, and any sequence of what training code does (hypothesis).

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
from compat_helpers import (
    UNUSED,
    Net,
    assert_models_equal,
    assert_same,
    batches,
    loss_of,
    make_optimizer,
    make_params,
    set_grads,
    two_copies,
)
from custom_optimizers import BertAdam
from devices import seeded
from hypothesis import example, given, settings

from functional_bagua.compat import fuse_optimizer, fused_steps


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_loop_with_backward_and_zero_grad(set_to_none):
    def make(net):
        return torch.optim.AdamW(
            [
                {"params": [net.b.weight, net.b.bias, net.unused.weight]},
                {"params": [net.a.weight, net.a.bias, net.c.weight, net.c.bias, net.unused.bias], "lr": 3e-3},
            ],
            lr=1e-2,
            weight_decay=0.1,
        )

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
    bucket_grads = {
        g.untyped_storage().data_ptr() for _, flat in opt._bagua_fusion.flattened.values() for g in flat.grad_buffers()
    }
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


@pytest.mark.parametrize(
    "edit", ["replace exp_avg", "reset state", "delete state", "new step tensor", "bump step in place"]
)
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


# ---- any sequence of what training code does, against plain step (hypothesis) -------------------

ACTIONS = [
    "fresh",
    "in place",
    "every other fresh",
    "drop a gradient",
    "plain step",
    "new lr",
    "replace p.data",
    "state_dict round trip",
    "clip on",
    "replace a state tensor",
    "scale a state tensor in place",
]


def _act(action, t, pair):
    """Apply ``action`` at step ``t`` to one copy ``(groups, optimizer)``; both copies get the same."""
    groups, opt = pair
    gen = seeded(1000 + t)
    trainable = [
        (gi, i, p)
        for gi, ps in enumerate(groups)
        for i, p in enumerate(ps)
        if p.requires_grad and (gi, i) not in UNUSED
    ]
    for k, (_gi, _i, p) in enumerate(trainable):
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
    "SGD momentum foreach": lambda gs: torch.optim.SGD(
        [{"params": gs[0]}, {"params": gs[1], "lr": 0.01}], lr=0.05, momentum=0.9, foreach=True
    ),
    "Adam for-loop": lambda gs: torch.optim.Adam(
        [{"params": gs[0]}, {"params": gs[1], "weight_decay": 0.1}], lr=1e-2, foreach=False
    ),
    "Adadelta foreach": lambda gs: torch.optim.Adadelta([{"params": gs[0]}, {"params": gs[1]}], lr=1.0, foreach=True),
    "BertAdam, clip off": lambda gs: BertAdam([{"params": gs[0]}, {"params": gs[1]}], lr=1e-2, max_grad_norm=0.0),
    "SGD foreach": lambda gs: torch.optim.SGD([{"params": gs[0]}, {"params": gs[1], "lr": 0.01}], lr=0.1, foreach=True),
}


@settings(max_examples=50, deadline=None)
@example(
    name="BertAdam, clip off", actions=["fresh", "clip on", "fresh"]
)  # the probe's verdict must not outlive the clip
@example(
    name="SGD momentum foreach",
    actions=[
        "every other fresh",
        "in place",
        "drop a gradient",
        "state_dict round trip",
        "replace p.data",
        "plain step",
        "new lr",
        "fresh",
    ],
)
@given(
    name=st.sampled_from(sorted(SEQUENCE_OPTIMIZERS)),
    actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=10),
)
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
