"""fb.Optimizer's steps on what a step's checks accepted (``functional_bagua.accepted``): a step
written into the parameters in place (AdEMAMix, LaProp) checks its inputs, and the next steps on
the same tensors run the rule on them directly. Checked here: those steps give the reference's
bits over a group of several tensors, also with the learning rate changed between steps; and
each change the record must see (a step count written by someone else, a gradient missing, a
gradient in a parameter's memory, a parameter of a new shape, the state loaded) sends the step
back through its checks: the same bits as the per-tensor path (``foreach.per_tensor``: no
groups, nothing recorded), or the checks' own error."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import NamedTuple

import pytest
import torch
from devices import seeded

import functional_bagua as fb
from functional_bagua import foreach

pytestmark = [
    pytest.mark.cpu_only("the step is written into the parameters with Python numbers on the CPU only"),
    pytest.mark.filterwarnings("ignore"),
]

SHAPES = [(64, 32), (32,), (7, 3, 2)]
REFERENCES = {  # id: (the reference's module, its class, its keyword arguments, our alias built)
    "ademamix": ("pytorch_optimizer", "AdEMAMix", dict(lr=1e-2, foreach=False), lambda: fb.ademamix(1e-2)),
    "ademamix-decoupled": (
        "pytorch_optimizer",
        "AdEMAMix",
        dict(lr=1e-2, weight_decay=0.1, weight_decouple=True, foreach=False),
        lambda: fb.ademamix(1e-2, weight_decay=0.1, weight_decouple=True),
    ),
    "laprop": ("pytorch_optimizer", "LaProp", dict(lr=1e-2, foreach=False), lambda: fb.laprop(1e-2)),
    "laprop-decayed": (
        "pytorch_optimizer",
        "LaProp",
        dict(lr=1e-2, weight_decay=0.1, foreach=False),
        lambda: fb.laprop(1e-2, weight_decay=0.1),
    ),
    "adopt-decoupled": (
        "adopt",
        "ADOPT",
        dict(lr=1e-2, weight_decay=0.1, decouple=True, foreach=False),
        lambda: fb.adopt(1e-2, weight_decay=0.1, decouple=True),
    ),
}


def parameters(seed):
    """Parameters of :data:`SHAPES` and a target for each."""
    gen = seeded(seed)
    tensors = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    return tensors, [torch.randn(s, generator=gen) for s in SHAPES]


def set_grads(tensors, targets):
    for p, target in zip(tensors, targets):
        p.grad = p.detach() - target  # |p - target|^2 / 2


@pytest.mark.parametrize("case", list(REFERENCES))
def test_steps_on_what_the_checks_accepted_are_the_references_bit_for_bit(case):
    """Eight steps over three tensors of one group, the learning rate lowered after the third
    (in both optimizers' groups, as a scheduler does): the reference's bits after every step;
    after the first step the group keeps what its checks accepted, and steps on it."""
    module, name, ref_kwargs, make = REFERENCES[case]
    package = pytest.importorskip(module, reason=f"{module} is the reference: an optional test dependency")
    ours, targets = parameters(3)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    reference, opt = getattr(package, name)(theirs, **ref_kwargs), fb.Optimizer(ours, make())
    for step in range(8):
        if step == 3:
            for group in (*reference.param_groups, *opt.param_groups):
                group["lr"] = 3e-3
        set_grads(theirs, targets)
        set_grads(ours, targets)
        reference.step()
        opt.step()
        assert opt._groups[0].accepted, "the group keeps what its checks accepted"
        for a, b in zip(ours, theirs):
            assert torch.equal(a.detach(), b.detach()), step


def a_count_written(opt, tensors, step):
    """The first tensor's step count set back by someone else, in place (a tensor of its state
    scaled, for a rule without per-tensor counts)."""
    if step == 3:
        names = list(opt.state[tensors[0]])
        count = next((name for name in names if name.endswith("count")), None)
        if count is not None:
            opt.state[tensors[0]][count].fill_(1)
        else:
            opt.state[tensors[0]][names[-1]].mul_(4.0)


def a_gradient_missing(opt, tensors, step):
    if step == 3:
        tensors[1].grad = None


def a_gradient_in_a_parameters_memory(opt, tensors, step):
    if step == 3:
        tensors[1].grad = tensors[1].detach()


EDITS = [a_count_written, a_gradient_missing, a_gradient_in_a_parameters_memory]


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize(
    "make",
    [
        lambda: fb.ademamix(1e-2),
        lambda: fb.laprop(1e-2, weight_decay=0.1),
        lambda: fb.adopt(1e-2),
        lambda: fb.prodigy(weight_decay=0.01),
        lambda: fb.dadapt_adam(weight_decay=0.01, decouple=True),
        lambda: fb.schedule_free_adamw(1e-2, weight_decay=0.01),
        lambda: fb.schedule_free_sgd(1e-2),
    ],
    ids=["ademamix", "laprop", "adopt", "prodigy", "dadapt_adam", "schedule_free_adamw", "schedule_free_sgd"],
)
def test_a_change_of_what_the_checks_accepted_sends_the_step_through_them_again(make, edit):
    """Six steps, the inputs changed before the fourth (``edit``), of a group that keeps what
    its checks accepted and of the same group stepped one tensor at a time (nothing kept): the
    same bits. A step that ran the rule on the record instead would use the other tensors'
    count for the one set back, or write a parameter through its own gradient."""
    runs = []
    for per_tensor in (False, True):
        tensors, targets = parameters(7)
        opt = fb.Optimizer(tensors, make())
        for step in range(6):
            set_grads(tensors, targets)
            edit(opt, tensors, step)
            if per_tensor:
                with foreach.per_tensor():
                    opt.step()
            else:
                opt.step()
        runs.append([p.detach().clone() for p in tensors])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_parameter_of_a_new_shape_raises_the_checks_error():
    """A parameter given a new shape in the same memory (``p.data = p.data.view(...)``) after
    steps the group kept: the step's checks run again and name the state made for other
    parameters (the rule would broadcast, or fail in torch)."""
    tensors, targets = parameters(11)
    opt = fb.Optimizer(tensors, fb.ademamix(1e-2))
    for _ in range(2):
        set_grads(tensors, targets)
        opt.step()
    tensors[1].data = tensors[1].data.view(4, 8)
    tensors[1].grad = torch.randn(4, 8)
    with pytest.raises(ValueError, match="made for other parameters"):
        opt.step()


def test_a_state_loaded_between_steps_is_stepped_as_loaded():
    """The state saved after two steps, loaded back into the same optimizer after four: the
    next steps are those of an optimizer that loaded it fresh, bit for bit."""
    runs = []
    for reload in (True, False):
        tensors, targets = parameters(13)
        opt = fb.Optimizer(tensors, fb.laprop(1e-2))
        for step in range(8):
            if step == 2:
                saved = {"opt": opt.state_dict(), "params": [p.detach().clone() for p in tensors]}
            if step == 4 and reload:
                opt.load_state_dict(saved["opt"])
                with torch.no_grad():
                    for p, v in zip(tensors, saved["params"]):
                        p.copy_(v)
            if step == 4 and not reload:
                opt = fb.Optimizer(tensors, fb.laprop(1e-2))
                opt.load_state_dict(saved["opt"])
                with torch.no_grad():
                    for p, v in zip(tensors, saved["params"]):
                        p.copy_(v)
            set_grads(tensors, targets)
            opt.step()
        runs.append([p.detach().clone() for p in tensors])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def stepped_both_ways(make, tensors_of, steps=8):
    """``tensors_of()``'s parameters after ``steps`` of ``make()`` in fb.Optimizer, grouped (the
    records kept) and one tensor at a time (none kept), on the same gradients (the parameters
    times the step number)."""
    runs = []
    for per_tensor in (False, True):
        tensors = tensors_of()
        opt = fb.Optimizer(tensors, make())
        for step in range(steps):
            for p in tensors:
                p.grad = p.detach() * (step + 1)
            if per_tensor:
                with foreach.per_tensor():
                    opt.step()
            else:
                opt.step()
        runs.append([p.detach().clone() for p in tensors])
    return runs


def bfloat16_vector():
    return [torch.nn.Parameter(torch.randn(256, generator=seeded(2)).bfloat16())]


def starting_together():
    base = torch.randn(8, generator=seeded(4))
    return [torch.nn.Parameter(base[:4]), torch.nn.Parameter(base.view(2, 4))]


@pytest.mark.parametrize("tensors_of", [bfloat16_vector, starting_together], ids=["bfloat16", "starting-together"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: fb.laprop(1e-2, weight_decay=0.1),
        lambda: fb.ademamix(1e-2, weight_decay=0.1, weight_decouple=True),
        lambda: fb.adopt(1e-2, weight_decay=0.1, decouple=True),
    ],
    ids=["laprop", "ademamix", "adopt"],
)
def test_what_the_pure_update_accepted_is_never_written_in_place(make, tensors_of):
    """Parameters the step may not write in place (bfloat16; two starting at one address): the
    pure update runs, and keeps a record of its own; the written step never replays on it (it
    would write them in place): the per-tensor path's bits."""
    for a, b in zip(*stepped_both_ways(make, tensors_of)):
        assert torch.equal(a, b)


class ScaledState(NamedTuple):
    count: torch.Tensor
    scale: torch.Tensor  # a 0-dim float32 constant per tensor, carried unchanged


def test_per_tensor_0_dim_state_that_differs_is_never_taken_as_one_value():
    """A rule whose state holds a 0-dim float32 value per tensor (``1 / numel``), carried as it
    is: each tensor keeps its own and steps with it, ``p - lr t scale`` after ``t`` steps of
    gradient 1 (a record taking the first tensor's value for all would move the second by 0.5)."""
    rule = fb.leafwise(
        ScaledState,
        lambda p: ScaledState(torch.zeros((), dtype=torch.int64), torch.tensor(1.0 / p.numel())),
        lambda g, s, p: (g * s.scale, ScaledState(s.count + 1, s.scale)),
        name="scaled",
    )
    tensors = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(4))]
    opt = fb.Optimizer(tensors, fb.chain(rule, fb.scale_by_learning_rate(1.0)))
    for _ in range(3):
        for p in tensors:
            p.grad = torch.ones_like(p)
        opt.step()
    assert [opt.state[p]["0/scale"].item() for p in tensors] == [0.5, 0.25]
    assert torch.equal(tensors[0].detach(), torch.full((2,), 1 - 3 * 0.5))
    assert torch.equal(tensors[1].detach(), torch.full((4,), 1 - 3 * 0.25))


def test_a_state_tensor_replaced_through_optimizer_state_is_freed():
    """``opt.state[p][name] = t`` (what trainers do to move the state): the tensor replaced is
    not kept alive by what the group's last step accepted."""
    tensors, targets = parameters(17)
    opt = fb.Optimizer(tensors, fb.ademamix(1e-2))
    for _ in range(2):
        set_grads(tensors, targets)
        opt.step()
    name = next(k for k, v in opt.state[tensors[0]].items() if v.dim() > 0)
    replaced = weakref.ref(opt.state[tensors[0]][name])
    opt.state[tensors[0]][name] = torch.zeros_like(tensors[0])
    opt.state_dict()  # the state made again with the new tensor
    gc.collect()
    assert replaced() is None


@pytest.mark.parametrize(
    "make",
    [lambda: fb.adam(1e-2), lambda: fb.ademamix(1e-2), lambda: fb.schedule_free_adamw(1e-2)],
    ids=["adam", "ademamix", "schedule_free_adamw"],
)
def test_steps_under_inference_mode_are_the_steps_outside_it(make):
    """``opt.step()`` under ``torch.inference_mode()`` (its state, made there, has no version
    counters): it steps, keeping no record, to the bits of the same steps outside it."""
    runs = []
    for inference in (True, False):
        tensors, targets = parameters(19)
        opt = fb.Optimizer(tensors, make(), fused=False)
        for _ in range(4):
            set_grads(tensors, targets)
            with torch.inference_mode() if inference else contextlib.nullcontext():
                opt.step()
        runs.append([p.detach().clone() for p in tensors])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
