"""functional_bagua.compat.fuse_optimizer: fuse_step gives the plain step's result, bit for bit,
for every torch.optim optimizer and for optimizers written outside torch; per-tensor optimizers
are detected and stepped unfused; half precision, gradients with a dtype of their own,
channels_last and sparse CSR parameters are stepped as step() steps them.

Reference: the same optimizer class on an identical copy of the parameters, stepped with plain
``step()`` on the same gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from compat_helpers import (
    CASES,
    STEPS,
    alternate,
    assert_same,
    make_optimizer,
    make_params,
    set_grads,
    trainable_groups,
)
from custom_optimizers import BertAdam, SignMomentum
from devices import ON_CUDA, seeded

from functional_bagua.compat import fuse_optimizer, fuse_step, is_fused_optimizer
from functional_bagua.compat.fusion_check import fusion_changes_step


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


@pytest.mark.parametrize(
    "cls,kwargs",
    [(SignMomentum, dict(lr=1e-2, weight_decay=0.1)), (BertAdam, dict(lr=1e-2, t_total=STEPS, max_grad_norm=0.5))],
)
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


# ---- memory formats, sparse layouts and dtypes --------------------------------------------------


def test_channels_last_parameters_keep_their_memory_format():
    """do_flatten made every parameter a contiguous view of the flat buffer, so a channels_last
    convolution kernel lost its memory format; such parameters are now stepped where they are."""

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2)
        )
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
        gen = seeded(0)
        params = [torch.nn.Parameter(torch.randn(4, 4, generator=gen).to_sparse_csr()) for _ in range(2)]
        params += [torch.nn.Parameter(torch.randn(3, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
        opt = torch.optim.SGD(params, lr=0.1)
        opt = fuse_optimizer(opt) if fused else opt
        for t in range(3):
            for p in params:
                p.grad = (
                    torch.full((4, 4), t + 1.0).to_sparse_csr()
                    if p.layout == torch.sparse_csr
                    else torch.full(p.shape, t + 1.0)
                )
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
        gen = seeded(0)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5, 3), (3,), (4, 4), (6,), (2, 2), (7,)]]

    ref, fused = params(), params()
    ref_opt, opt = make(ref), fuse_optimizer(make(fused))
    for t in range(8):
        if t in (0, 4):  # the second parameter from the start, the third once fused in a run
            for ps in (ref, fused):
                ps[1 if t == 0 else 2].grad = None
                ps[1 if t == 0 else 2].grad_dtype = torch.float64
        gen = seeded(t + 1)
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
    parameters as they are, and every step equals plain step bit for bit. CUDA parameters are
    fused, and equal plain step bit for bit too."""

    def params():
        gen = seeded(0)
        shapes = [(5, 3), (3,), (4, 4), (6,), (2, 2), (7,), (40,), (9, 9)]
        return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]

    ref, fused = params(), params()
    ref_opt, opt = HALF_CASES[name](ref), fuse_optimizer(HALF_CASES[name](fused))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the expected "stays unfused" of SGD
        for t in range(10):
            gen = seeded(t + 1)
            for p, q in zip(ref, fused):
                g = torch.randn(p.shape, generator=gen).to(dtype)
                p.grad, q.grad = g.clone(), g.clone()
            ref_opt.step()
            opt.fuse_step()
            assert all(torch.equal(p, q) for p, q in zip(ref, fused)), t
    if ON_CUDA:  # CUDA kernels round each element alike wherever it lies: fused, and still equal
        assert opt._bagua_fused_count > 0
        return
    assert opt._bagua_fused_count == 0
    assert len({q.untyped_storage().data_ptr() for q in fused}) == len(fused)  # not moved into a flat buffer
