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
import copy
import gc
import math
import weakref
from typing import NamedTuple

import hypothesis.strategies as st
import pytest
import torch
from devices import seeded
from helpers import IN_PLACE
from hypothesis import given, settings

import functional_bagua as fb
from functional_bagua import accepted, foreach, numerics
from functional_bagua.leaf_lists import KeptLists
from functional_bagua.parameter_state import positions

pytestmark = [
    pytest.mark.cpu_only("the step is written into the parameters with Python numbers on the CPU only"),
    pytest.mark.filterwarnings("ignore"),
]

SHAPES = [(64, 32), (32,), (7, 3, 2)]
REFERENCES = [  # of IN_PLACE
    "ademamix",
    "ademamix-decoupled",
    "laprop",
    "laprop-decayed",
    "adopt-decoupled",
    "prodigy-decoupled",
    "dadapt-adam-decoupled",
]


CHUNKS = {None: [3], 1: [1, 1, 1], 4096: [1, 2]}  # per chunk_bytes: the tensors of each chunk


def parameters(seed):
    """Parameters of :data:`SHAPES` and a target for each."""
    gen = seeded(seed)
    tensors = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    return tensors, [torch.randn(s, generator=gen) for s in SHAPES]


def set_grads(tensors, targets):
    for p, target in zip(tensors, targets):
        p.grad = p.detach() - target  # |p - target|^2 / 2


def stepped(make, tensors, grads_at, steps, edit=None, around=contextlib.nullcontext, **optimizer_kwargs):
    """``tensors`` after ``steps`` of ``fb.Optimizer(tensors, make(), **optimizer_kwargs)``:
    each step's gradients set by ``grads_at(tensors, step)``, then ``edit(opt, tensors, step)``
    where given, the step run inside ``around()``."""
    opt = fb.Optimizer(tensors, make(), **optimizer_kwargs)
    for step in range(steps):
        grads_at(tensors, step)
        if edit is not None:
            edit(opt, tensors, step)
        with around():
            opt.step()
    return [p.detach().clone() for p in tensors]


def assert_same_bits(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def towards_targets(seed):
    """:func:`parameters` and, for :func:`stepped`, their gradients towards their targets."""
    tensors, targets = parameters(seed)
    return tensors, lambda ts, step: set_grads(ts, targets)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 1 << 22), min_size=1, max_size=40), most=st.integers(1, 1 << 23))
def test_chunks_take_the_tensors_in_order_in_about_equal_shares(sizes, most):
    """``in_cache_chunks``: consecutive non-empty slices covering every tensor once, in order; no
    more of them than ``ceil(total / most)`` (one where everything fits); each slice, less its
    largest tensor, under an equal share ``total / count`` of the bytes."""
    chunks = accepted.in_cache_chunks(sizes, most)
    indices = range(len(sizes))
    assert [i for part in chunks for i in indices[part]] == list(indices)
    assert all(len(indices[part]) > 0 for part in chunks)
    total = sum(sizes)
    count = max(1, math.ceil(total / most))
    assert len(chunks) <= count
    if total <= most:
        assert len(chunks) == 1
    for part in chunks:
        assert (sum(sizes[part]) - max(sizes[part])) * count < max(total, 1)


@pytest.fixture(params=[None, 1, 4096], ids=["one-chunk", "chunks-of-one", "chunks-of-4-KiB"])
def chunk_bytes(request, monkeypatch):
    """The parameter bytes a step on a record runs its rule over at once: the default (the
    three tensors of :data:`SHAPES` in one chunk), one tensor at a time, and chunks of about
    4 KiB (the 8 KiB matrix alone, the two small tensors together)."""
    if request.param is not None:
        monkeypatch.setattr(accepted, "CHUNK_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("case", REFERENCES)
def test_steps_on_what_the_checks_accepted_are_the_references_bit_for_bit(case, chunk_bytes, monkeypatch):
    """Eight steps over three tensors of one group, the learning rate lowered after the third
    (in both optimizers' groups, as a scheduler does): the reference's bits after every step;
    after the first step the group keeps what its checks accepted, and steps on it, in chunks
    of its tensors (``chunk_bytes``) as the reference steps them, one after the other."""
    module, name, ref_kwargs, make = IN_PLACE[case]
    package = pytest.importorskip(module, reason=f"{module} is the reference: an optional test dependency")
    replays = replays_counted(monkeypatch)
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
        records = list(opt._groups[0].accepted.values())
        assert records, "the group keeps what its checks accepted"
        assert [len(range(len(SHAPES))[part]) for part in records[0].chunks] == CHUNKS[chunk_bytes]
        for a, b in zip(ours, theirs):
            assert torch.equal(a.detach(), b.detach()), step
    # the rule's operations recorded on the first chunk, run again on the others (not the rule)
    chunked = not case.startswith(("prodigy", "dadapt"))
    assert len(replays) == (7 * (len(CHUNKS[chunk_bytes]) - 1) if chunked else 0)


def replays_counted(monkeypatch):
    """The list to which each run of recorded operations on other tensors appends (``Tape.run_on``)."""
    runs: list = []
    run_on = foreach.Tape.run_on

    def counted(tape, inputs):
        runs.append(len(inputs))
        return run_on(tape, inputs)

    monkeypatch.setattr(foreach.Tape, "run_on", counted)
    return runs


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


def a_parameter_moved(opt, tensors, step):
    """The first parameter moved to new memory (``p.data = ...``, as ``model.to(...)`` moves it):
    the next step must write the new memory, not the view of the old one a step kept."""
    if step == 3:
        tensors[0].data = tensors[0].data.clone()


def a_parameter_restrided(opt, tensors, step):
    """The first parameter given other strides over the same memory, from the same start and of
    the same shape: a kept view with the old strides would step other elements."""
    if step == 3:
        p = tensors[0]
        p.data = p.data.as_strided(p.shape, (1, p.shape[0]))


EDITS = [a_count_written, a_gradient_missing, a_gradient_in_a_parameters_memory]
CHAINS = [  # a chain's lists kept (LeafLists.kept_or_of): its head, or the whole pure update
    lambda: fb.schedule_free_adamw(1e-2, weight_decay=0.01),
    lambda: fb.chain(fb.scale_by_adam(), fb.add_decayed_weights(0.01), fb.scale(-1e-2)),
]
WAYS = (contextlib.nullcontext, foreach.per_tensor)  # grouped (records kept), one tensor at a time (none)


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
        CHAINS[1],
    ],
    ids=["ademamix", "laprop", "adopt", "prodigy", "dadapt_adam", "schedule_free_adamw", "schedule_free_sgd", "chain"],
)
def test_a_change_of_what_the_checks_accepted_sends_the_step_through_them_again(make, edit, chunk_bytes):
    """Six steps, the inputs changed before the fourth (``edit``), of a group that keeps what
    its checks accepted and of the same group stepped one tensor at a time (nothing kept): the
    same bits, also where the group steps its tensors in chunks (``chunk_bytes``). A step that
    ran the rule on the record instead would use the other tensors' count for the one set back,
    or write a parameter through its own gradient."""
    grouped, per_tensor = (stepped(make, *towards_targets(7), 6, edit, around) for around in WAYS)
    assert_same_bits(grouped, per_tensor)


@pytest.mark.parametrize("edit", [a_parameter_moved, a_parameter_restrided])
@pytest.mark.parametrize(
    "make",
    [
        lambda: fb.ademamix(1e-2),
        lambda: fb.prodigy(weight_decay=0.01),
        lambda: fb.schedule_free_adamw(1e-2, weight_decay=0.01),
        lambda: fb.schedule_free_sgd(1e-2),
        CHAINS[1],
    ],
    ids=["ademamix", "prodigy", "schedule_free_adamw", "schedule_free_sgd", "chain"],
)
def test_a_parameter_given_other_memory_is_stepped_there(make, edit):
    """Six steps, a parameter given other memory or strides (``p.data = ...``) before the
    fourth: the bits of an optimizer made afresh at that step that loads the state (nothing
    kept from the steps before: no views of the parameters, no records). A step on the views
    an earlier step kept would write the old memory, or other elements of it."""
    runs = []
    for renew in (False, True):
        tensors, grads_at = towards_targets(29)
        opt = fb.Optimizer(tensors, make(), fused=False)
        for step in range(6):
            grads_at(tensors, step)
            edit(opt, tensors, step)
            if renew and step == 3:
                fresh = fb.Optimizer(tensors, make(), fused=False)
                fresh.load_state_dict(opt.state_dict())
                opt = fresh
            opt.step()
        runs.append([p.detach().clone() for p in tensors])
    assert_same_bits(*runs)


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


@pytest.mark.parametrize("make", CHAINS, ids=["schedule_free_adamw", "chain"])
def test_a_chain_keeps_its_checked_lists_and_a_gradient_of_another_dtype_raises_the_checks_error(make):
    """A chain inside ``fb.Optimizer`` keeps the lists its checks made (``KeptLists``) and steps
    the next gradients on them; a gradient of another dtype then raises the checks' own error,
    as it does one tensor at a time (where nothing is kept)."""
    errors = []
    for around in WAYS:
        tensors, targets = parameters(23)
        opt = fb.Optimizer(tensors, make(), fused=False)
        with around():
            for _ in range(2):
                set_grads(tensors, targets)
                opt.step()
            kept = [v for v in opt._groups[0].accepted.values() if isinstance(v, KeptLists)]
            assert len(kept) == (1 if around is contextlib.nullcontext else 0)
            set_grads(tensors, targets)
            tensors[1].grad_dtype = None  # torch allows a gradient of another dtype
            tensors[1].grad = tensors[1].grad.double()
            with pytest.raises(TypeError) as raised:
                opt.step()
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_kept_views_are_the_parameters_own_while_they_hold_the_same_memory():
    """``KeptViews.of``: the same views while the parameters are unchanged; new views, of the
    parameter as it is now, after each change a kept view would not show (new memory, other
    strides from the same start, another dtype of the same size from the same start, a negated
    view of the same memory); none kept of complex parameters; a copy starts without them."""
    params = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16)), torch.nn.Parameter(torch.randn(3))]
    keys = positions(2)
    views = accepted.KeptViews()
    first = views.of(keys, params)
    assert views.of(keys, params) is first
    assert all(type(v) is torch.Tensor and not v.requires_grad for v in first.values())
    changes = [
        lambda p: p.data.clone(),
        lambda p: p.data.as_strided((4, 4), (1, 4)),
        lambda p: p.data.view(torch.bfloat16),
        lambda p: torch._neg_view(p.data),  # as x.conj().imag of a complex x: negated, the same memory
    ]
    for change in changes:
        before = views.of(keys, params)
        params[0].data = change(params[0])
        now = views.of(keys, params)
        assert now is not before
        v = now[keys[0]]
        assert (v.data_ptr(), v.shape, v.stride(), v.dtype, v.is_neg()) == (
            params[0].data_ptr(),
            params[0].shape,
            params[0].stride(),
            params[0].dtype,
            params[0].is_neg(),
        )
    assert copy.deepcopy(views).views is None
    complex_params = [torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]
    assert views.of(positions(1), complex_params) is not views.of(positions(1), complex_params)


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
            if step == 4:
                if not reload:  # a fresh optimizer loads it
                    opt = fb.Optimizer(tensors, fb.laprop(1e-2))
                opt.load_state_dict(saved["opt"])
                with torch.no_grad():
                    for p, v in zip(tensors, saved["params"]):
                        p.copy_(v)
            set_grads(tensors, targets)
            opt.step()
        runs.append([p.detach().clone() for p in tensors])
    assert_same_bits(*runs)


def times_the_step(tensors, step):
    """The gradients of :func:`stepped` as the parameters times the step number."""
    for p in tensors:
        p.grad = p.detach() * (step + 1)


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
    grouped, per_tensor = (stepped(make, tensors_of(), times_the_step, 8, around=around) for around in WAYS)
    assert_same_bits(grouped, per_tensor)


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
    inside, outside = (
        stepped(make, *towards_targets(19), 4, around=around, fused=False)
        for around in (torch.inference_mode, contextlib.nullcontext)
    )
    assert_same_bits(inside, outside)


class _Momentum(NamedTuple):
    mu: torch.Tensor


def _by_largest_gradient():
    """A leafwise rule, declared ``in_cache_chunks``, that reads a number from its gradients (their
    largest magnitude) and steps ``p`` by its momentum over that number."""

    def largest(g):
        (number,) = numerics.eager_numbers((g.abs().amax(),), g)
        return number

    def update_leaf(g, s, p):
        number = largest(g)
        mu = foreach.updated(s.mu, "lerp", g, 0.1)
        return mu / number, _Momentum(mu)

    def write_leaf(g, s, p, alpha):
        number = largest(g)
        mu = foreach.updated(s.mu, "lerp", g, 0.1)
        p.add_(mu, alpha=alpha / number)
        return _Momentum(mu)

    rule = fb.leafwise(
        _Momentum,
        lambda p: _Momentum(torch.zeros_like(p)),
        update_leaf,
        name="by_largest_gradient",
        fresh_updates=True,
        write_leaf=write_leaf,
        in_cache_chunks=True,
    )
    return fb.chain(rule, fb.scale_by_learning_rate(0.1))


def test_a_chunked_rule_that_reads_values_that_differ_steps_them_one_tensor_at_a_time(monkeypatch):
    """The rule above over three tensors in two chunks (the 4 KB vector alone, the two small
    ones together): its gradients' largest magnitudes equal for two steps (the group steps
    grouped and keeps a record), then different within the second chunk. The step on the record
    runs that chunk one tensor at a time: the per-tensor path's bits, nothing stepped twice."""
    monkeypatch.setattr(accepted, "CHUNK_BYTES", 4000)
    gen = seeded(21)
    steps = []
    for step in range(4):
        grads = [torch.rand(n, generator=gen) * 2 - 1 for n in (1000, 5, 7)]
        for i, g in enumerate(grads):
            g[0] = 2.0 if step >= 2 and i == 2 else 1.0
        steps.append(grads)

    def grads_at(tensors, step):
        for p, g in zip(tensors, steps[step]):
            p.grad = g.clone()

    runs = []
    for around in WAYS:
        tensors = [torch.nn.Parameter(torch.randn(n, generator=seeded(22 + n))) for n in (1000, 5, 7)]
        runs.append(stepped(_by_largest_gradient, tensors, grads_at, 4, around=around))
    assert_same_bits(*runs)


def test_gradients_noted_checked_in_a_step_are_those_very_tensors():
    """``note_checked``: within a step (``kept_in``) a record accepts the very gradient objects
    noted, of the same signatures, without reading them again; other objects, other
    signatures, or outside a step: read again."""
    grads = [torch.ones(2), torch.ones(3)]
    signatures = accepted.signatures_of(grads)
    accepted.note_checked(grads, signatures)
    assert not accepted._noted(grads, signatures)  # outside a step nothing is noted
    with accepted.kept_in({}):
        assert not accepted._noted(grads, signatures)
        accepted.note_checked(grads, signatures)
        assert accepted._noted(list(grads), list(signatures))
        assert not accepted._noted([torch.ones(2), grads[1]], signatures)  # equal values, another object
        assert not accepted._noted(grads, accepted.signatures_of([torch.ones(2), torch.ones(4)]))
        assert not accepted._noted(grads[:1], signatures[:1])
    with accepted.kept_in({}):
        assert not accepted._noted(grads, signatures)  # each step notes its own


@pytest.mark.parametrize("make", [*CHAINS, lambda: fb.ademamix(1e-2)], ids=["schedule_free_adamw", "chain", "ademamix"])
def test_what_a_group_keeps_holds_no_gradient_and_no_parameter_memory_given_up(make):
    """Each step's gradients are freed once ``zero_grad`` drops them (a chain's kept lists hold
    none); after ``p.data = ...`` the views of the memory the parameters held before are freed
    at the group's next step (the kept views, and the records and lists that name them)."""
    tensors, targets = parameters(31)
    opt = fb.Optimizer(tensors, make(), fused=False)
    grads_seen = []
    for _ in range(3):
        set_grads(tensors, targets)
        grads_seen.extend(weakref.ref(p.grad) for p in tensors)
        opt.step()
        opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(ref() is None for ref in grads_seen)
    views = opt._groups[0].views.views
    assert views is not None
    old = [weakref.ref(v) for v in views.values()]
    del views
    for p in tensors:
        p.data = p.data.clone()
    set_grads(tensors, targets)
    opt.step()
    gc.collect()
    assert all(ref() is None for ref in old)
