"""The check behind functional_bagua.compat.fuse_optimizer's fuse_step: the probe that counts
a step's per-tensor work and finds per-tensor math, probing again when a hyperparameter changes,
verdicts not reused for other members or groups, cheap optimizers stepped unfused while their
gradients are fresh, and plans (and the state index they read) kept between steps.

Reference: the same optimizer class on an identical copy of the parameters, stepped with plain
``step()`` on the same gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from compat_helpers import (
    assert_same,
    bert_adam_pair,
    count_probes,
    fused_count_per_step,
    make_params,
    run_both,
    set_grads,
    step_both,
)
from devices import seeded

from functional_bagua.compat import fuse_optimizer
from functional_bagua.compat.fusion_check import SINGLE_OP_WORK, probe

# ---- the probe: per-tensor work and per-tensor math ----------------------------------------------


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


@pytest.mark.parametrize(
    "make,work",
    [
        (lambda ps: OneForeachOp(ps), 1),
        (lambda ps: OpsPerTensor(ps, ops=1), SINGLE_OP_WORK),
        (lambda ps: OpsPerTensor(ps, ops=3), 3 * SINGLE_OP_WORK),
    ],
    ids=["one-foreach-op", "one-op-per-tensor", "three-ops-per-tensor"],
)
def test_probe_counts_the_per_tensor_work_of_a_step(make, work):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(4,), (3, 2), (5,)]]
    optimizer = make(params)
    found = probe(optimizer, optimizer.param_groups[0], params)
    assert found.reason is None and found.work_per_param == work


@pytest.mark.cpu_only("position-dependent rounding is a property of the CPU kernels' vector/tail split")
def test_the_probe_sees_position_dependent_rounding():
    """The probe itself, on members too small for one vector of the CPU kernels: it steps at
    least PROBE_MIN_NUMEL elements, so bfloat16 SGD's vector/tail difference shows (before, three
    members of a few elements each were all tail, fused or not)."""
    gen = seeded(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16))
        for s in [(3,), (2, 2), (6,), (7,), (5, 3)] * 8
    ]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert probe(optimizer, optimizer.param_groups[0], params).reason is not None
    params32 = [torch.nn.Parameter(p.detach().float()) for p in params]
    optimizer = torch.optim.SGD(params32, lr=0.1, momentum=0.9)
    assert probe(optimizer, optimizer.param_groups[0], params32).reason is None


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


# ---- hyperparameters that change: a new probe ----------------------------------------------------


def test_a_hyperparameter_that_turns_per_tensor_math_on_asks_for_a_new_probe(monkeypatch):
    """BertAdam without its clip (max_grad_norm=0) is elementwise and fused; set max_grad_norm=1
    mid-training and its clip is per parameter: fuse_step probes again, warns, steps the group
    unfused, and matches plain step bit for bit. A learning rate and a beta that change every
    step (as with a scheduler) probe nothing new."""
    probes = count_probes(monkeypatch)
    ref_groups, groups, ref_opt, opt = bert_adam_pair(max_grad_norm=0.0)

    def schedule_and_clip(t):
        for o in (ref_opt, opt):
            o.param_groups[0]["lr"] = 1e-2 / (t + 1)
            o.param_groups[0]["b1"] = 0.9 - 0.01 * t  # as a momentum schedule would
            o.param_groups[0]["max_grad_norm"] = 1.0 if t >= 4 else 0.0
        for p in ref_groups[0] + groups[0]:
            if p.grad is not None:
                p.grad.mul_(50.0)  # norms well above the clip threshold once it is on

    fused, caught = [], []
    for t in range(8):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fused.append(step_both([ref_groups[0]], [groups[0]], ref_opt, opt, t, schedule_and_clip))
        caught += [str(w.message) for w in seen if "stays unfused" in str(w.message)]
    assert fused == [1, 1, 1, 1, 0, 0, 0, 0]
    assert len(probes) == 2 and len(caught) == 1


def test_a_clip_threshold_lowered_from_inf_asks_for_a_new_probe():
    """The verdict was kept per sign of each hyperparameter, so BertAdam's per-parameter clip
    lowered from inf (never clips: elementwise, fused) to 0.1 (clips per tensor) stayed fused and
    differed from step() by up to 1.7e-2 with no warning. Now any value other than a scheduled
    lr/momentum/betas/weight_decay probes again."""
    ref_groups, groups, ref_opt, opt = bert_adam_pair(max_grad_norm=float("inf"))

    def lower_the_clip(t):
        for o in (ref_opt, opt):
            o.param_groups[0]["max_grad_norm"] = 0.1 if t >= 3 else float("inf")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused = [step_both([ref_groups[0]], [groups[0]], ref_opt, opt, t, lower_the_clip) for t in range(6)]
    assert fused == [1, 1, 1, 0, 0, 0]
    messages = [str(w.message) for w in seen]
    assert sum("stays unfused" in m for m in messages) == 1
    assert sum("['max_grad_norm'] changed, so fuse_step probes again" in m for m in messages) == 1


def test_a_value_that_changes_every_step_probes_each_time_and_warns_once(monkeypatch):
    """A hyperparameter outside the scheduled names that changes every step costs a probe per
    step (keeping only the last verdict), is said once, and the result stays plain step's."""
    probes = count_probes(monkeypatch)
    ref_groups, groups, ref_opt, opt = bert_adam_pair(max_grad_norm=0.0)

    def change_e(t):
        for o in (ref_opt, opt):
            o.param_groups[0]["e"] = 1e-6 * (t + 1)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in range(5):
            step_both([ref_groups[0]], [groups[0]], ref_opt, opt, t, change_e)
    assert len(probes) == 5 and len(opt._bagua_fusion.probes) == 1
    assert sum("['e'] changed" in str(w.message) for w in seen) == 1


# ---- verdicts are not reused for other members or groups -----------------------------------------


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
    gen = seeded(seed)
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
            gen = seeded(t)
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
            gen = seeded(t)
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


# ---- fresh gradients and cheap optimizers --------------------------------------------------------


@pytest.mark.parametrize("foreach", [True, False])
def test_cheap_optimizers_step_fresh_gradients_unfused(foreach):
    """torch's SGD without momentum does one foreach slot of work per tensor (foreach) or one
    single-tensor op (for-loop, two slots): copying fresh gradients into the flat buffer costs
    about what fusion saves, so fuse_step steps it unfused then, and fused as soon as gradients
    stay in place. With momentum (three slots and more) it is fused either way. Same bits
    throughout."""
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.SGD(
        [{"params": ref_groups[0]}, {"params": ref_groups[1], "lr": 0.01}], lr=0.1, foreach=foreach
    )
    opt = fuse_optimizer(
        torch.optim.SGD([{"params": groups[0]}, {"params": groups[1], "lr": 0.01}], lr=0.1, foreach=foreach)
    )
    fresh = fused_count_per_step(opt, groups, ref_opt, ref_groups, 6, fresh=True)
    in_place = fused_count_per_step(opt, groups, ref_opt, ref_groups, 6, fresh=False)
    assert_same(ref_groups, groups, ref_opt, opt)
    assert fresh == [2, 0, 0, 0, 0, 0]  # the first step plans, and fuses
    assert in_place == [2] * 6
    ref_groups, groups = make_params(), make_params()
    ref_opt = torch.optim.SGD(
        [{"params": ref_groups[0]}, {"params": ref_groups[1]}], lr=0.1, momentum=0.9, foreach=foreach
    )
    opt = fuse_optimizer(
        torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1, momentum=0.9, foreach=foreach)
    )
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


# ---- plans kept between steps --------------------------------------------------------------------


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
    run_both(ref_groups, groups, ref_opt, opt, 6)
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
        gen = seeded(t)
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
    grads_buffers = {
        g.untyped_storage().data_ptr() for _, flat in opt._bagua_fusion.flattened.values() for g in flat.grad_buffers()
    }
    survivors = [q for i, q in enumerate(groups[0]) if q.requires_grad and i % 3 != 0]
    assert survivors and all(q.grad.untyped_storage().data_ptr() in grads_buffers for q in survivors)
