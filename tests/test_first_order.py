"""ADOPT, AdEMAMix, LaProp, MARS and cautious updates, step for step in float64 against their
references: the authors' ``torch-adopt`` package, pytorch-optimizer's ``AdEMAMix`` and
``LaProp`` (``foreach=False``: its foreach path rounds step sizes to float32), and, for MARS (no
package of the authors') and the cautious mask, their rules written out here. Then the paths
that must agree with the pure update: fused, compiled, ``fb.Optimizer``, a schedule, a resumed
checkpoint."""

from __future__ import annotations

import pytest
import torch
from devices import seeded
from helpers import IN_PLACE, assert_trees_close, run_steps, run_updates

import functional_bagua as fb

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:`torch._utils.is_compiling`:UserWarning")

SHAPES = {"scalar": (), "bias": (5,), "matrix": (5, 4), "kernel": (2, 3, 2)}
STEPS = 12


def problem(seed=0):
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def torch_run(make_optimizer, params, grads, lr_at=None):
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = make_optimizer(list(tensors.values()))
    for t, g in enumerate(grads):
        if lr_at is not None:
            opt.param_groups[0]["lr"] = lr_at(t)
        for k, p in tensors.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in tensors.items()}


def reference_class(module, name, why):
    package = pytest.importorskip(module, reason=why)
    return with_the_graph_capture_check(getattr(package, name))


def with_the_graph_capture_check(cls):
    """``cls``, or where it calls torch.optim's ``_cuda_graph_capture_health_check`` and this torch
    names that check ``_accelerator_graph_capture_health_check`` (torch 2.11; torch-adopt 0.1.0
    calls the older name on CUDA), a subclass that has it under the older name: the reference's
    arithmetic is untouched."""
    if hasattr(cls, "_cuda_graph_capture_health_check"):
        return cls
    older_name = dict(_cuda_graph_capture_health_check=torch.optim.Optimizer._accelerator_graph_capture_health_check)
    return type(cls.__name__, (cls,), older_name)


ADOPT_WHY = "the authors' torch-adopt package (module adopt) is ADOPT's reference: an optional test dependency"
PYTORCH_OPTIMIZER_WHY = "pytorch-optimizer is the reference of AdEMAMix and LaProp: an optional test dependency"
CASES = {  # id: (reference module, class, its keyword arguments, our alias, its keyword arguments)
    # ADOPT's for-loop: its foreach path (CUDA's default) keeps the step count in float32
    # tensors for the clip step^(1/4), 3e-10 apart from the for-loop's Python numbers in float64
    "adopt": ("adopt", "ADOPT", dict(lr=0.01, foreach=False), fb.adopt, dict(lr=0.01)),
    "adopt-decoupled": (
        "adopt",
        "ADOPT",
        dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, decouple=True, foreach=False),
        fb.adopt,
        dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, decouple=True),
    ),
    "adopt-l2-unclipped-maximize": (
        "adopt",
        "ADOPT",
        dict(lr=0.01, weight_decay=0.1, clip_lambda=None, maximize=True, foreach=False),
        fb.adopt,
        dict(lr=0.01, weight_decay=0.1, clip_lambda=None, maximize=True),
    ),
    "ademamix": ("pytorch_optimizer", "AdEMAMix", dict(lr=0.01, foreach=False), fb.ademamix, dict(lr=0.01)),
    "ademamix-warmup-decoupled": (
        "pytorch_optimizer",
        "AdEMAMix",
        dict(lr=0.01, betas=(0.8, 0.99, 0.999), t_alpha_beta3=5, weight_decay=0.1, weight_decouple=True, foreach=False),
        fb.ademamix,
        dict(lr=0.01, betas=(0.8, 0.99, 0.999), t_alpha_beta3=5, weight_decay=0.1, weight_decouple=True),
    ),
    "ademamix-l2-maximize": (
        "pytorch_optimizer",
        "AdEMAMix",
        dict(lr=0.01, weight_decay=0.1, maximize=True, foreach=False),
        fb.ademamix,
        dict(lr=0.01, weight_decay=0.1, maximize=True),
    ),
    "laprop": ("pytorch_optimizer", "LaProp", dict(lr=0.01, foreach=False), fb.laprop, dict(lr=0.01)),
    "laprop-centered-decay": (
        "pytorch_optimizer",
        "LaProp",
        dict(lr=0.01, weight_decay=0.1, centered=True, steps_before_using_centered=3, foreach=False),
        fb.laprop,
        dict(lr=0.01, weight_decay=0.1, centered=True, steps_before_using_centered=3),
    ),
    "laprop-maximize": (
        "pytorch_optimizer",
        "LaProp",
        dict(lr=0.01, maximize=True, foreach=False),
        fb.laprop,
        dict(lr=0.01, maximize=True),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_aliases_step_as_their_reference_packages(case):
    module, name, ref_kwargs, alias, kwargs = CASES[case]
    cls = reference_class(module, name, ADOPT_WHY if module == "adopt" else PYTORCH_OPTIMIZER_WHY)
    params, grads = problem()
    want = torch_run(lambda ps: cls(ps, **ref_kwargs), params, grads)
    got, _ = run_updates(alias(**kwargs), params, grads)
    assert any(not torch.equal(want[k], params[k]) for k in want)
    assert_trees_close(got, want)


LEARNING_RATE_FREE = {  # id: (reference module, class, its keyword arguments, our alias, its keyword arguments)
    "prodigy": ("prodigyopt", "Prodigy", {}, fb.prodigy, {}),
    "prodigy-bias-corrected-safeguarded": (
        "prodigyopt",
        "Prodigy",
        dict(lr=0.5, weight_decay=0.1, use_bias_correction=True, safeguard_warmup=True, d_coef=2.0, growth_rate=1.5),
        fb.prodigy,
        dict(lr=0.5, weight_decay=0.1, use_bias_correction=True, safeguard_warmup=True, d_coef=2.0, growth_rate=1.5),
    ),
    "prodigy-l2-no-momentum": (
        "prodigyopt",
        "Prodigy",
        dict(betas=(0.0, 0.99), beta3=0.9, weight_decay=0.1, decouple=False, growth_rate=2.0),
        fb.prodigy,
        dict(betas=(0.0, 0.99), beta3=0.9, weight_decay=0.1, decouple=False, growth_rate=2.0),
    ),
    "dadapt-adam": ("dadaptation", "DAdaptAdam", {}, fb.dadapt_adam, {}),
    "dadapt-adam-decoupled-bias-corrected": (
        "dadaptation",
        "DAdaptAdam",
        dict(lr=0.5, weight_decay=0.1, decouple=True, use_bias_correction=True, growth_rate=1.2),
        fb.dadapt_adam,
        dict(lr=0.5, weight_decay=0.1, decouple=True, use_bias_correction=True, growth_rate=1.2),
    ),
    "dadapt-adam-l2": ("dadaptation", "DAdaptAdam", dict(weight_decay=0.1), fb.dadapt_adam, dict(weight_decay=0.1)),
}


def quadratic(seed=8):
    """A problem where the distance travelled grows the estimate d: the gradient of
    ``|p - target|^2 / 2`` at the parameters, the first step's gradients all zero (an early
    return in the references: the moments move, nothing else)."""
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    target = {k: 3 * torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}

    def grads(t, p):
        return {k: torch.zeros_like(v) if t == 0 else v - target[k] for k, v in p.items()}

    return params, grads


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", list(LEARNING_RATE_FREE))
def test_learning_rate_free_aliases_estimate_d_and_step_as_the_authors_packages(case, capsys):
    module, name, ref_kwargs, alias, kwargs = LEARNING_RATE_FREE[case]
    cls = reference_class(module, name, f"the authors' {module} package is the reference: an optional test dependency")
    params, grads_at = quadratic()
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = cls(list(tensors.values()), **ref_kwargs)
    tx = alias(**kwargs)
    ours, state = dict(params), tx.init(params)
    for t in range(30):
        for k, g in grads_at(t, {k: p.detach() for k, p in tensors.items()}).items():
            tensors[k].grad = g
        opt.step()
        updates, state = tx.update(grads_at(t, ours), state, ours)
        ours = fb.apply_updates(ours, updates)
    assert_trees_close(ours, {k: p.detach() for k, p in tensors.items()}, tol=1e-12)
    d = state[1].d
    # d_hat is a ratio of sums whose terms cancel: its last bits follow the order of the additions
    torch.testing.assert_close(d, torch.tensor(opt.param_groups[0]["d"], dtype=torch.float64), rtol=1e-9, atol=0)
    assert d > 1e-6  # d grew from d0
    assert int(state[1].count) == opt.state[tensors["matrix"]]["step"]  # a step of zero gradients does not count


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", ["prodigy-bias-corrected-safeguarded", "dadapt-adam"])
def test_a_schedule_through_zero_skips_those_steps_as_the_references_skip_a_group_at_lr_0(case):
    module, name, ref_kwargs, alias, kwargs = LEARNING_RATE_FREE[case]
    cls = reference_class(module, name, f"the authors' {module} package is the reference: an optional test dependency")
    rates = [0.0, 0.1, 0.5, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]

    def schedule(t):
        return torch.tensor(rates, dtype=torch.float64)[torch.clamp(torch.as_tensor(t).long(), max=len(rates) - 1)]

    params, grads_at = quadratic(9)
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = cls(list(tensors.values()), **{**ref_kwargs, "lr": 1.0})
    tx = alias(**{**kwargs, "lr": schedule})
    ours, state = dict(params), tx.init(params)
    for t, rate in enumerate(rates):
        opt.param_groups[0]["lr"] = rate
        for k, g in grads_at(t + 1, {k: p.detach() for k, p in tensors.items()}).items():
            tensors[k].grad = g
        opt.step()
        updates, state = tx.update(grads_at(t + 1, ours), state, ours)
        ours = fb.apply_updates(ours, updates)
    assert any(not torch.equal(ours[k], params[k]) for k in params)
    assert_trees_close(ours, {k: p.detach() for k, p in tensors.items()}, tol=1e-12)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", ["prodigy-bias-corrected-safeguarded", "dadapt-adam"])
def test_built_with_lr_0_nothing_moves_as_the_references_skip_a_group_at_lr_0(case):
    """lr=0.0 given as a number: the references skip a group whose lr is 0 (built with 1, set
    to 0: they refuse 0 when built; no moment, estimate or count moves), and so does the alias:
    its parameters, moments and count stay as they were."""
    module, name, ref_kwargs, alias, kwargs = LEARNING_RATE_FREE[case]
    cls = reference_class(module, name, f"the authors' {module} package is the reference: an optional test dependency")
    params, grads_at = quadratic(10)
    lr_0 = dict(lr_at=lambda t: 0.0)
    want = torch_run(lambda ps: cls(ps, **{**ref_kwargs, "lr": 1.0}), params, [grads_at(1, params)] * 3, **lr_0)
    tx = alias(**{**kwargs, "lr": 0.0})
    got, state = run_updates(tx, params, [grads_at(1, params)] * 3)
    assert_trees_close(got, want, tol=0)
    assert_trees_close(got, params, tol=0)
    assert int(state[1].count) == 0
    assert all(bool((m == 0).all()) for m in state[1].mu.values())


def assert_written_as_the_reference(case, seed, clip=None, lr_factor=None):
    """Six steps of ``fb.Optimizer`` over one tensor with the ``IN_PLACE[case]`` alias (behind
    ``clip`` in a chain, where given) and of its reference on the same gradients (clipped by
    ``clip``; with ``lr_factor``, both learning rates set by a ``LambdaLR`` of it after each
    step): the same bits after each step."""
    module, name, ref_kwargs, make = IN_PLACE[case]
    cls = reference_class(module, name, f"{module} is the reference: an optional test dependency")
    gen = seeded(seed)
    start, target = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    built = make()  # an alias built, or a factory and its keyword arguments (fb.Optimizer builds it)
    if clip is not None:
        built = fb.chain(clip, built)
    reference = cls([theirs], **ref_kwargs)
    opt = (
        fb.Optimizer([ours], built)
        if isinstance(built, fb.GradientTransformation)
        else fb.Optimizer([ours], built[0], **built[1])
    )
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in (reference, opt)] if lr_factor else []
    for _ in range(6):
        ours.grad = ours.detach() - target  # |p - target|^2 / 2: the estimate d grows
        g = theirs.detach() - target
        theirs.grad = g if clip is None else clip.update({"g": g}, clip.init({"g": g}))[0]["g"]
        reference.step()
        opt.step()
        for scheduler in schedulers:
            scheduler.step()
        assert torch.equal(ours.detach(), theirs.detach())
    assert not torch.equal(ours.detach(), start)


@pytest.mark.cpu_only("the step is written into the parameters with Python numbers on the CPU only")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", list(IN_PLACE))
def test_fb_optimizer_writes_the_step_into_the_parameters_as_the_references(case):
    """fb.Optimizer steps Prodigy and D-Adaptation Adam as the authors' packages write their
    step: ``p.add_(p, alpha=-decay dlr)``, ``p.addcdiv_(mu, denom, value=-dlr)`` (``g`` and
    ``-dlr d`` without momentum), their factors unrounded; AdEMAMix as pytorch-optimizer's
    ``p.addcdiv_(m1 / c1 + alpha m2, denom, value=-lr)`` (with a decoupled decay
    ``p.mul_(1 - lr wd)`` first, also in the factory form), LaProp its momentum added with its
    step size (one pass), then its decoupled decay ``p.mul_(1 - wd lr)``: the same bits as the
    references in
    float32 (one tensor, so the estimate's sums are added in one order), where forming the
    update and adding it would differ."""
    assert_written_as_the_reference(case, seed=5)


@pytest.mark.cpu_only("the step is written into the parameters with Python numbers on the CPU only")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", [case for case in IN_PLACE if not case.endswith("factory")])
def test_after_clipping_in_a_chain_the_step_is_still_written_as_the_reference_writes_it(case):
    """``fb.chain(fb.clip_by_global_norm(1.0), alias)`` (the alias a chain inside the chain):
    ``fb.Optimizer`` clips, then writes the alias's step into the parameters as the reference
    does, bit for bit with the reference stepping on the same clipped gradient."""
    assert_written_as_the_reference(case, seed=9, clip=fb.clip_by_global_norm(1.0))


@pytest.mark.cpu_only("the step is written into the parameters with Python numbers on the CPU only")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", list(IN_PLACE))
def test_under_a_scheduler_the_step_is_still_written_as_the_reference_writes_it(case):
    """A torch scheduler changing the learning rate after every step (the alias then reads the
    group's tensors, the factory its held numbers): each step is still the reference's, bit for
    bit, with the learning rate the scheduler gave both."""
    assert_written_as_the_reference(case, seed=12, lr_factor=lambda t: 1 / (1 + 0.1 * t))


@pytest.mark.cpu_only("the step is written into the parameters with Python numbers on the CPU only")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", [case for case in IN_PLACE if not case.endswith("factory")])
def test_clipped_and_scheduled_the_step_is_still_written_as_the_reference_writes_it(case):
    """``fb.chain(fb.clip_by_global_norm(1.0), alias)`` under a scheduler (the usual recipe):
    once the learning rate changed, the group runs the chain built with the numbers its tensors
    hold, and the alias's step is still the reference's, bit for bit."""
    assert_written_as_the_reference(
        case, seed=13, clip=fb.clip_by_global_norm(1.0), lr_factor=lambda t: 1 / (1 + 0.1 * t)
    )


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    "make",
    [
        lambda: fb.prodigy(weight_decay=0.01),
        lambda: fb.dadapt_adam(weight_decay=0.1, decouple=True),
        lambda: fb.chain(fb.clip_by_global_norm(1.0), fb.prodigy(weight_decay=0.01)),
    ],
    ids=["prodigy", "dadapt_adam", "clipped-prodigy"],
)
def test_a_group_that_cannot_take_the_step_written_in_place_runs_the_pure_update(make):
    """A 0-dim parameter in the group of a learning-rate-free rule (its estimate ``d`` sums over
    every tensor): the step is not written into the parameters (it takes tensors of at least one
    dimension) and the group runs the pure update, bit for bit (where writing the step in would
    differ: decoupled weight decay, Prodigy's ``dlr``)."""
    gen = seeded(14)
    shapes = [(), (700,)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    tensors = [torch.nn.Parameter(v.clone()) for v in start]
    opt = fb.Optimizer(tensors, make())
    tx, params = make(), dict(enumerate(start))
    state = tx.init(params)
    for step in grads:
        for p, g in zip(tensors, step):
            p.grad = g.clone()
        opt.step()
        updates, state = tx.update(dict(enumerate(step)), state, params)
        params = fb.apply_updates(params, updates)
    for i, p in enumerate(tensors):
        assert torch.equal(p.detach(), params[i]), i
    assert not torch.equal(tensors[1].detach(), start[1])


PARTLY_WRITTEN = {  # id: (pytorch-optimizer's class, its keyword arguments, our alias built)
    "ademamix": ("AdEMAMix", dict(lr=1e-2, foreach=False), lambda: fb.ademamix(1e-2)),
    "ademamix-decoupled": (
        "AdEMAMix",
        dict(lr=1e-2, weight_decay=0.1, weight_decouple=True, foreach=False),
        lambda: fb.ademamix(1e-2, weight_decay=0.1, weight_decouple=True),
    ),
    "laprop": ("LaProp", dict(lr=1e-2, foreach=False), lambda: fb.laprop(1e-2)),
    "laprop-decayed": (
        "LaProp",
        dict(lr=1e-2, weight_decay=0.1, foreach=False),
        lambda: fb.laprop(1e-2, weight_decay=0.1),
    ),
}


@pytest.mark.cpu_only("the step is written into the parameters with Python numbers on the CPU only")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", list(PARTLY_WRITTEN))
def test_beside_a_0_dim_parameter_the_others_are_written_as_the_reference_writes_them(case):
    """A 0-dim parameter (a learned scale) in the group of a per-tensor rule: it takes its pure
    update (to a rounding of the reference's 0-dim arithmetic) and the float32 and float64
    vectors beside it are still written into as the reference writes them, bit for bit (the
    whole group's pure update would differ)."""
    name, ref_kwargs, make = PARTLY_WRITTEN[case]
    cls = reference_class("pytorch_optimizer", name, "pytorch-optimizer is the reference: an optional test dependency")
    gen = seeded(21)
    start = [torch.randn((), generator=gen), torch.randn(700, generator=gen), torch.randn(300, generator=gen).double()]
    targets = [torch.tensor(0.5), torch.randn(700, generator=gen), torch.randn(300, generator=gen).double()]
    theirs = [torch.nn.Parameter(v.clone()) for v in start]
    ours = [torch.nn.Parameter(v.clone()) for v in start]
    reference, opt = cls(theirs, **ref_kwargs), fb.Optimizer(ours, make())
    for _ in range(6):
        for p, target in [*zip(theirs, targets), *zip(ours, targets)]:
            p.grad = p.detach() - target
        reference.step()
        opt.step()
        assert torch.equal(ours[1].detach(), theirs[1].detach()) and torch.equal(ours[2].detach(), theirs[2].detach())
        torch.testing.assert_close(ours[0].detach(), theirs[0].detach(), rtol=1e-6, atol=1e-7)
    assert all(not torch.equal(p.detach(), v) for p, v in zip(ours, start))


def test_an_ademamix_step_that_cannot_be_written_in_place_adds_its_update():
    """AdEMAMix on 0-dim parameters only (none can be written into as the reference writes,
    ``p.addcdiv_``): the direction is formed and added with the learning rate as ``alpha``,
    ``p.add_(u, alpha=-lr)``, bit for bit; with a decoupled decay, ``u + wd p`` added so."""
    gen = seeded(18)
    start = [torch.randn((), generator=gen) for _ in range(2)]
    grads = [[torch.randn((), generator=gen) for _ in range(2)] for _ in range(4)]
    for decay in (0.0, 0.1):
        tensors = [torch.nn.Parameter(v.clone()) for v in start]
        opt = fb.Optimizer(tensors, fb.ademamix(1e-2, weight_decay=decay, weight_decouple=True))
        direction, expected = fb.scale_by_ademamix(), [v.clone() for v in start]
        state = direction.init(dict(enumerate(expected)))
        for step in grads:
            for p, g in zip(tensors, step):
                p.grad = g.clone()
            opt.step()
            updates, state = direction.update(dict(enumerate(step)), state, dict(enumerate(expected)))
            for i, v in enumerate(expected):
                v.add_(updates[i].add(v, alpha=decay) if decay else updates[i], alpha=-1e-2)
        for i, p in enumerate(tensors):
            assert torch.equal(p.detach(), expected[i]), (decay, i)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_parameters_keep_their_dtype_with_a_0_dim_one_among_them(dtype):
    """A learnable scalar (0-dim) among float32, bfloat16 or float16 parameters: two 0-dim tensors
    promote to float64, so the float64 scalars of a rule must not meet it as they are; and
    unclipped ADOPT's first g / eps, inf in float16, must not reach the momentum. ADOPT, Prodigy
    and D-Adaptation also against their references in float32."""
    gen = seeded(10)
    params = {"scale": torch.tensor(1.5).to(dtype), "w": torch.randn(4, 3, generator=gen).to(dtype)}
    grads = [{k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()} for _ in range(4)]
    for name, make in {**COMPOSED, "adopt-unclipped": lambda: fb.adopt(1e-2, clip_lambda=None)}.items():
        if dtype == torch.float16 and name in ("prodigy", "dadapt-adam"):
            continue  # their moments scale by d^2 (1e-12 at first), below float16's range, as in the references
        got, state = run_updates(make(), params, grads)
        for k, v in got.items():
            assert v.dtype == dtype and bool(torch.isfinite(v).all()), (name, k, v)
        for leaf in fb.tree.flatten(state)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() > 0:
                assert leaf.dtype == dtype, (name, leaf.dtype)
    if dtype == torch.float32:
        for case in ("adopt", "prodigy", "dadapt-adam"):
            module, cls_name, ref_kwargs, alias, kwargs = {**CASES, **LEARNING_RATE_FREE}[case]
            cls = reference_class(module, cls_name, f"{module} is the reference: an optional test dependency")
            want = torch_run(lambda ps: cls(ps, **ref_kwargs), params, grads)
            got, _ = run_updates(alias(**kwargs), params, grads)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {k}: {m}")


def test_adopt_leaves_the_parameters_where_they_are_at_its_first_step():
    params, grads = problem()
    moved, _ = run_updates(fb.adopt(lr=0.1, weight_decay=0.1, decouple=True), params, grads[:1])
    assert_trees_close(moved, params, tol=0)


@pytest.mark.parametrize("name", ["LaProp", "AdEMAMix"])
def test_a_learning_rate_schedule_is_the_reference_with_its_lr_set_before_each_step(name):
    """LaProp keeps the rate inside its momentum (and a running average of it for the bias
    correction): a changing rate reaches the step gradually, as in the reference."""
    cls = reference_class("pytorch_optimizer", name, PYTORCH_OPTIMIZER_WHY)
    schedule = fb.schedules.linear(0.02, 0.002, STEPS)
    params, grads = problem(1)
    want = torch_run(lambda ps: cls(ps, lr=1.0, foreach=False), params, grads, lr_at=lambda t: schedule(t).item())
    alias = fb.laprop if name == "LaProp" else fb.ademamix
    got, _ = run_updates(alias(lr=schedule), params, grads)
    assert_trees_close(got, want)


def mars_reference(params, grads, lr, betas, eps, wd, gamma, optimize_1d, lr_1d, betas_1d, wd_1d):
    """The authors' MARS-AdamW (approximate MARS), one tensor at a time, written out from their
    algorithm: the corrected gradient with the previous one, clipped to norm 1, into AdamW; the
    tensors that are not 2-D get plain AdamW with their own numbers unless optimize_1d."""
    params = {k: v.clone() for k, v in params.items()}
    state = {k: (torch.zeros_like(v), torch.zeros_like(v), torch.zeros_like(v)) for k, v in params.items()}
    for t, g_all in enumerate(grads, start=1):
        for k, p in params.items():
            g, (m, v, last) = g_all[k], state[k]
            if optimize_1d or p.dim() == 2:
                b1, b2 = betas
                c = g + gamma * b1 / (1 - b1) * (g - last)
                if torch.linalg.vector_norm(c) > 1:
                    c = c / torch.linalg.vector_norm(c)
                step_lr, decay = lr, wd
            else:
                (b1, b2), c, step_lr, decay = betas_1d, g, lr_1d, wd_1d
            m = b1 * m + (1 - b1) * c
            v = b2 * v + (1 - b2) * c * c
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            params[k] = p - step_lr * (decay * p + m_hat / (torch.sqrt(v_hat) + eps))
            state[k] = (m, v, g)
    return params


@pytest.mark.parametrize("optimize_1d", [False, True], ids=["2d-only", "every-tensor"])
def test_mars_adamw_is_the_authors_rule(optimize_1d):
    params, grads = problem(2)
    numbers = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, gamma=0.5)
    extra = dict(optimize_1d=optimize_1d, lr_1d=0.02, betas_1d=(0.8, 0.9), weight_decay_1d=0.05)
    want = mars_reference(
        params,
        grads,
        numbers["lr"],
        numbers["betas"],
        numbers["eps"],
        numbers["weight_decay"],
        numbers["gamma"],
        optimize_1d,
        extra["lr_1d"],
        extra["betas_1d"],
        extra["weight_decay_1d"],
    )
    got, _ = run_updates(fb.mars_adamw(**numbers, **extra), params, grads)
    assert_trees_close(got, want, tol=1e-12)


def test_mars_around_any_optimizer_feeds_it_the_corrected_gradients():
    """fb.mars(inner) = inner run on c_t, here computed by hand from the gradients and clipped to
    the norm given (Adam's direction at eps 1: not invariant to the scale of what it is fed)."""
    params, grads = problem(3)
    corrected, previous = [], {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        c = {k: g[k] + 0.1 * 0.9 / 0.1 * (g[k] - previous[k]) for k in g}
        corrected.append(
            {k: x * (2 / torch.linalg.vector_norm(x)) if torch.linalg.vector_norm(x) > 2 else x for k, x in c.items()}
        )
        previous = g
    want, _ = run_updates(fb.adam(1e-2, eps=1.0), params, corrected)
    got, _ = run_updates(fb.mars(fb.adam(1e-2, eps=1.0), gamma=0.1, b1=0.9, max_norm=2.0), params, grads)
    assert_trees_close(got, want, tol=1e-12)


@pytest.mark.parametrize("rescale", ["paper", "mean"])
def test_cautious_adam_is_the_mask_written_out(rescale):
    """C-AdamW: Adam's direction, zero where its sign disagrees with the gradient's, scaled by
    numel / (nnz + 1) (the paper) or 1 / max(mean(mask), 1e-3) (timm)."""
    params, grads = problem(4)
    for g in grads[2:]:
        g["matrix"][0] = 0.0  # a zero gradient agrees with no direction: masked
    b1, b2, eps, lr, wd = 0.9, 0.99, 1e-8, 1e-2, 0.1
    want = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    for t, g in enumerate(grads, start=1):
        for k in want:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            d = (m[k] / (1 - b1**t)) / (torch.sqrt(v[k] / (1 - b2**t)) + eps)
            mask = (d * g[k] > 0).double()
            scale = mask.numel() / (mask.sum() + 1) if rescale == "paper" else 1 / max(mask.mean().item(), 1e-3)
            want[k] = want[k] - lr * (d * mask * scale + wd * want[k])
    tx = fb.chain(
        fb.cautious(fb.scale_by_adam(b1, b2, eps), rescale), fb.add_decayed_weights(wd), fb.scale_by_learning_rate(lr)
    )
    got, _ = run_updates(tx, params, grads)
    assert_trees_close(got, want, tol=1e-12)


COMPOSED = {  # transforms whose paths are compared with their own pure update
    "adopt": lambda: fb.adopt(1e-2, weight_decay=0.1, decouple=True),
    "ademamix": lambda: fb.ademamix(1e-2, t_alpha_beta3=4, weight_decay=0.1, weight_decouple=True),
    "laprop": lambda: fb.laprop(1e-2, weight_decay=0.1, centered=True, steps_before_using_centered=2),
    "mars": lambda: fb.mars_adamw(1e-2, weight_decay=0.1, optimize_1d=True),
    "cautious": lambda: fb.chain(fb.cautious(fb.scale_by_adam()), fb.scale_by_learning_rate(1e-2)),
    "prodigy": lambda: fb.prodigy(weight_decay=0.1, use_bias_correction=True),
    "dadapt-adam": lambda: fb.dadapt_adam(weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_fused_over_flat_buffers_equals_the_tree(name):
    params, grads = problem(5)
    want, _ = run_updates(COMPOSED[name](), params, grads)
    layout = fb.FlatLayout.of(params)
    fused = fb.fuse(COMPOSED[name](), layout)
    flat = layout.flatten(params)
    state = fused.init(flat)
    for g in grads:
        updates, state = fused.update(layout.flatten(g), state, flat)
        flat = fb.apply_updates(flat, updates)
    assert_trees_close(layout.unflatten(flat), want, tol=1e-12)


@pytest.mark.parametrize("name", list(COMPOSED))
def test_in_a_chain_with_clipping_under_gradient_accumulation_it_steps_on_the_clipped_mean(name):
    """multi_steps(chain(clip_by_global_norm, tx), 2): every second call, tx on the clipped mean of
    the two gradients, as a run that takes the means and clips them by hand."""
    params, grads = problem(11)
    means = []
    for a, b in zip(grads[::2], grads[1::2]):
        mean = {k: (a[k] + b[k]) / 2 for k in a}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in mean.values()]))
        means.append({k: v * (1.0 / norm) if norm > 1.0 else v for k, v in mean.items()})
    want, _ = run_updates(COMPOSED[name](), params, means)
    got, _ = run_updates(fb.multi_steps(fb.chain(fb.clip_by_global_norm(1.0), COMPOSED[name]()), 2), params, grads)
    # the clipped mean is rounded otherwise than here (the norm's summation order): the adaptive
    # denominators carry that difference through the steps, far below what a wrong order would give
    assert_trees_close(got, want, tol=1e-8)


def test_compiled_updates_equal_eager_ones():
    """Each update traced whole by dynamo (fullgraph: no graph break, no Python fallback), its
    graphs run as traced (inductor's code for these graphs is exercised by benchmarks/first_order.py)."""
    params, grads = problem(6)
    for name, make in COMPOSED.items():
        tx = make()
        compiled = torch.compile(tx.update, backend="eager", fullgraph=True)
        state_c = state_e = tx.init(params)
        for g in grads[:3]:
            got, state_c = compiled(g, state_c, params)
            want, state_e = tx.update(g, state_e, params)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-13, atol=1e-15, msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.cpu_only("the factors are read as numbers on the CPU only; a device keeps them as tensors")
def test_adopt_s_second_moment_in_float32_is_the_reference_s_bit_for_bit():
    """``nu.mul_(b2).addcmul_(g, g, value=1 - b2)`` as torch-adopt writes it, the weight
    ``1 - b2`` rounded once to float32 (not ``1 - fl32(b2)``)."""
    gen = seeded(9)
    grads = [torch.randn(1000, generator=gen) for _ in range(3)]
    tx, params = fb.scale_by_adopt(b2=0.9999), {"p": torch.zeros(1000)}
    state = tx.init(params)
    expected = torch.zeros(1000).addcmul_(grads[0], grads[0])  # the first step only takes g^2
    for i, g in enumerate(grads):
        _, state = tx.update({"p": g}, state, params)
        if i > 0:
            expected.mul_(0.9999).addcmul_(g, g, value=1 - 0.9999)
    assert torch.equal(state.nu["p"], expected)


def test_inductor_compiled_in_place_steps_over_flat_buffers_equal_the_eager_ones():
    """fuse_inplace(kernel="compiled"): inductor's generated code for the schedule-free averaging,
    ADOPT's first-step masking and Prodigy's global sums, writing into the buffers, against the
    eager fused update (float64: only the order of the sums differs)."""
    params, grads = problem(12)
    layout = fb.FlatLayout.of(params)
    makers = {
        "schedule_free_adamw": lambda: fb.schedule_free_adamw(1e-2, warmup_steps=2, weight_decay=0.1),
        "adopt": lambda: fb.adopt(1e-2, weight_decay=0.1, decouple=True),
        "prodigy": lambda: fb.prodigy(weight_decay=0.1),
    }
    for name, make in makers.items():
        runs = []
        for kernel in ("compiled", "eager"):
            step_ = fb.fuse_inplace(make(), layout, kernel=kernel)
            flat = layout.flatten({k: v.clone() for k, v in params.items()})
            state = step_.init(flat)
            for g in grads[:4]:
                step_(layout.flatten(g), state, flat)
            runs.append(layout.unflatten(flat))
        for k in params:
            torch.testing.assert_close(runs[0][k], runs[1][k], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.parametrize("name", list(COMPOSED))
def test_fb_optimizer_steps_as_the_pure_update_and_resumes_bit_for_bit(name):
    params, grads = problem(7)
    want, _ = run_updates(COMPOSED[name](), params, grads)
    tensors = [torch.nn.Parameter(params[k].clone()) for k in SHAPES]
    opt = fb.Optimizer(tensors, COMPOSED[name]())
    for t, g in enumerate(grads):
        if t == STEPS // 2:  # a checkpoint, loaded into a new optimizer over new parameters
            saved, values = opt.state_dict(), [p.detach().clone() for p in tensors]
            tensors = [torch.nn.Parameter(v) for v in values]
            opt = fb.Optimizer(tensors, COMPOSED[name]())
            opt.load_state_dict(saved)
        for p, k in zip(tensors, SHAPES):
            p.grad = g[k].clone()
        opt.step()
    assert_trees_close(dict(zip(SHAPES, (p.detach() for p in tensors))), want, tol=1e-12)


FACTORIES = ["schedule_free_adamw", "schedule_free_sgd", "adopt", "ademamix", "laprop", "mars_adamw"]
FACTORIES += ["prodigy", "dadapt_adam"]


@pytest.mark.parametrize("name", FACTORIES)
def test_the_factory_form_steps_as_the_alias_built_with_the_same_numbers(name):
    """fb.Optimizer(params, fb.<alias>, lr=...) holds the numbers as tensors and passes the
    alias's other arguments (ADOPT's clip_lambda, a function) as they are: the same steps as
    the alias built directly, bit for bit on the CPU, where each step builds the alias with the
    held values read as Python numbers (on a GPU the alias computes with them as 0-dim tensors
    there: the products of float64 factors within a rounding)."""
    params, grads = problem(13)
    runs = []
    for make in (
        lambda ps: fb.Optimizer(ps, getattr(fb, name), lr=1e-2),
        lambda ps: fb.Optimizer(ps, getattr(fb, name)(lr=1e-2)),
    ):
        tensors = [torch.nn.Parameter(params[k].clone()) for k in SHAPES]
        opt = make(tensors)
        for g in grads[:4]:
            for p, k in zip(tensors, SHAPES):
                p.grad = g[k].clone()
            opt.step()
        runs.append(dict(zip(SHAPES, (p.detach() for p in tensors))))
    assert_trees_close(runs[0], runs[1], tol=0 if tensors[0].device.type == "cpu" else 1e-14)


def test_bad_input_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="eps must be > 0"):
        fb.adopt(eps=0.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 2"):
        fb.ademamix(betas=(0.9, 0.999, 1.0))
    with pytest.raises(ValueError, match="t_alpha_beta3 must be > 0"):
        fb.ademamix(t_alpha_beta3=0)
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        fb.laprop(weight_decay=-0.1)
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        fb.mars(fb.adamw(), gamma=-0.5)
    with pytest.raises(ValueError, match="Invalid gamma value"):
        fb.mars_adamw(gamma=-0.5)
    with pytest.raises(ValueError, match=r"b1 must lie in \[0, 1\)"):
        fb.mars(fb.adamw(), b1=1.0)
    with pytest.raises(ValueError, match="takes a step of its own .adamw.*fb.cautious"):
        fb.cautious(fb.adamw(1e-3))
    with pytest.raises(ValueError, match="d_coef must be > 0"):
        fb.prodigy(d_coef=0.0)
    with pytest.raises(ValueError, match="Invalid d0 value"):
        fb.dadapt_adam(d0=0.0)
    with pytest.raises(ValueError, match="growth_rate must be >= 1"):
        fb.prodigy(growth_rate=0.5)
    with pytest.raises(ValueError, match="rescale must be one of"):
        fb.cautious(fb.scale_by_adam(), rescale="median")
    params, grads = problem()
    layout = fb.FlatLayout.of(params)
    with pytest.raises(NotImplementedError, match="partition"):
        fb.fuse(fb.mars_adamw(), layout).init(layout.flatten(params))


@pytest.mark.filterwarnings("ignore")
def test_a_clipped_chain_whose_step_is_written_in_place_resumes_bit_for_bit():
    """``fb.chain(fb.clip_by_global_norm(1.0), fb.ademamix(...))`` in ``fb.Optimizer`` (the
    alias's step written into the parameters after the clip): three steps, ``state_dict``, a new
    optimizer loading it and three more steps are the six steps of one optimizer, bit for bit."""
    gen = seeded(12)
    start = [torch.randn(40, 3, generator=gen), torch.randn(3, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) * 4 for v in start] for _ in range(6)]

    def make():
        return fb.chain(fb.clip_by_global_norm(1.0), fb.ademamix(1e-2, weight_decay=0.1, weight_decouple=True))

    whole = [torch.nn.Parameter(v.clone()) for v in start]
    run_steps(whole, fb.Optimizer(whole, make()), grads)
    first = [torch.nn.Parameter(v.clone()) for v in start]
    opt = fb.Optimizer(first, make())
    run_steps(first, opt, grads[:3])
    saved = opt.state_dict()
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = fb.Optimizer(second, make())
    resumed.load_state_dict(saved)
    run_steps(second, resumed, grads[3:])
    for a, b in zip(second, whole):
        assert torch.equal(a.detach(), b.detach())
