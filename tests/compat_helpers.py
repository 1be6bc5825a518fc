"""Shared by the test_compat_fuse_*.py files (functional_bagua.compat.fuse_optimizer): the
torch.optim optimizers and settings they run, two parameter groups and the gradients of each step,
a bit-for-bit comparison of parameters and optimizer state, a small network for training loops,
and the loops that step a reference optimizer with plain ``step()`` and a fused copy with
``fuse_step()`` on the same gradients.
"""

from __future__ import annotations

import copy
import warnings

import torch
from custom_optimizers import BertAdam
from devices import ON_CUDA, seeded

from functional_bagua.compat import fuse_optimizer

STEPS = 100

# name -> (class, group-0 defaults, group-1 overrides)
OPTIMIZERS = {
    "SGD": (
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        dict(lr=0.01, momentum=0.5, nesterov=False),
    ),
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
HAS_FUSED_KERNEL = {"SGD", "Adam", "AdamW"} | (set() if ON_CUDA else {"Adagrad"})  # torch fuses Adagrad on the CPU only
CASES = [(name, impl) for name in OPTIMIZERS for impl in ("for-loop", "foreach")]
CASES += [(name, "fused") for name in sorted(HAS_FUSED_KERNEL)]
IMPL_KWARGS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def make_params(seed=0):
    """Two groups. Group 0: float32, with an unused parameter (never a gradient) and a frozen one
    between trainable ones. Group 1: float64 and float32 mixed."""
    gen = seeded(seed)

    def param(shape, dtype=torch.float32, requires_grad=True):
        return torch.nn.Parameter(
            torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype), requires_grad=requires_grad
        )

    group0 = [
        param((5, 3)),
        param((3,)),
        param((4, 4)),
        param((6,)),
        param((2, 2), requires_grad=False),
        param((7,)),
        param((3, 1)),
    ]
    group1 = [
        param((3, 2), torch.float64),
        param((2, 2)),
        param((6,), torch.float64),
        param((5,)),
        param((2, 3), torch.float64),
    ]
    return group0, group1


UNUSED = {(0, 3)}  # (group, index) of the parameter that never gets a gradient


def make_optimizer(name, impl, groups):
    cls, defaults, overrides = OPTIMIZERS[name]
    return cls([{"params": groups[0]}, {"params": groups[1], **overrides}], **defaults, **IMPL_KWARGS[impl])


def set_grads(groups, step, seed=1):
    """The gradients of step ``step`` (same for every copy): fresh tensors on even steps (as after
    ``zero_grad(set_to_none=True)``), written into the existing ``.grad`` on odd ones."""
    gen = seeded(seed * 100_003 + step)
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


def step_both(ref_groups, groups, ref_opt, opt, t, before_step=None) -> int:
    """Step ``t`` on both copies: the gradients of step ``t`` (:func:`set_grads`), then
    ``before_step(t)`` if given (to change hyperparameters or gradients alike on both copies),
    plain ``step()`` for ``ref_opt`` and ``fuse_step()`` for ``opt``; parameters and state must
    then be equal bit for bit. Returns how many groups that fuse_step fused."""
    set_grads(ref_groups, t)
    set_grads(groups, t)
    if before_step is not None:
        before_step(t)
    before = opt._bagua_fused_count
    ref_opt.step()
    opt.fuse_step()
    fused = opt._bagua_fused_count - before
    assert_same(ref_groups, groups, ref_opt, opt)
    return fused


def run_both(ref_groups, groups, ref_opt, opt, steps: int) -> None:
    """``steps`` steps on both copies, as :func:`step_both` but without comparing after each: the
    caller compares at the end (and checks what it needs in between)."""
    for t in range(steps):
        set_grads(ref_groups, t)
        set_grads(groups, t)
        ref_opt.step()
        opt.fuse_step()


# ---- a small network for training loops ---------------------------------------------------------


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
    gen = seeded(seed)
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


# ---- probes and fused-group counts ------------------------------------------------------------


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
