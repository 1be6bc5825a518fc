"""The grouped path (functional_bagua.foreach: one multi-tensor op per device/dtype group) against
the per-tensor path, bit for bit, for every alias and the wrappers, with None gradients, several
dtypes in one tree and complex parameters; and the built-in elementwise rules run grouped."""

from __future__ import annotations

import contextlib

import pytest
import torch
from devices import seeded
from helpers import ALL_ALIASES, NEWER_FIRST_ORDER, RICH_SETTINGS, assert_trees_equal, clone_tree

import functional_bagua as fb
from functional_bagua import foreach

STEPS = 4
PER_TENSOR_ONLY = {fb.muon}  # its orthogonalization needs matrices of one shape at a time; its tree is 2-D
REFUSE_COMPLEX = {fb.muon, fb.adafactor, fb.lamb, fb.lars}  # per-tensor rules refuse complex parameters
READS_SHAPES = {fb.adafactor, fb.muon}  # rules that read their tensor's shape run one tensor at a time


def mixed_problem(alias, seed=0):
    """Parameters of three dtypes, several per dtype (so groups have several tensors), and
    gradients for STEPS steps, some of them None."""
    gen = seeded(seed)
    shapes = (
        {"w": (4, 3), "v": (3, 5), "u": (5, 3)}
        if alias is fb.muon
        else {"w": (4, 3), "b": (3,), "s": (), "k": (2, 1, 3, 3), "h": (6,), "d": (3, 2), "e": (2,)}
    )
    dtypes = {"h": torch.bfloat16, "d": torch.float64, "e": torch.float64}
    params = {k: torch.randn(s, generator=gen).to(dtypes.get(k, torch.float32)) for k, s in shapes.items()}
    steps = []
    for t in range(STEPS):
        grads = {k: torch.randn(p.shape, generator=gen).to(p.dtype) for k, p in params.items()}
        if t % 2 == 1:
            grads[next(iter(grads))] = None  # a parameter without a gradient this step
        steps.append(grads)
    return params, steps


def run(tx, params, steps):
    params = clone_tree(params)
    state = tx.init(params)
    trace = []
    for grads in steps:
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
        trace.append((clone_tree(updates), clone_tree(params), clone_tree(state)))
    return trace


def both_paths(tx, params, steps):
    grouped = run(tx, params, steps)
    with foreach.per_tensor():
        single = run(tx, params, steps)
    return grouped, single


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_every_alias_gives_the_same_bits_grouped_and_per_tensor(alias):
    params, steps = mixed_problem(alias)
    grouped, single = both_paths(alias(**RICH_SETTINGS.get(alias, {})), params, steps)
    assert_trees_equal(grouped, single)


@pytest.mark.parametrize(
    "alias", [a for a in (*ALL_ALIASES, *NEWER_FIRST_ORDER) if a not in PER_TENSOR_ONLY], ids=lambda a: a.__name__
)
def test_moments_of_0_dim_float64_parameters_are_each_their_own(alias):
    """A group of 0-dim float64 parameters only (learned scales in float64): their moments start
    equal, but are per-tensor values, not one shared scalar (as a step count is): the grouped
    path gives each tensor its own, the per-tensor path's bits (taken as one, each tensor's
    ``g^2`` would be added into every second moment). Then ``fb.Optimizer``, which gives the
    state up to be stepped in place, the same."""
    settings = RICH_SETTINGS.get(alias, NEWER_FIRST_ORDER.get(alias, {}))
    params = {k: torch.tensor(v, dtype=torch.float64) for k, v in (("a", 0.3), ("b", -1.2), ("c", 0.7))}
    steps = [
        {k: torch.tensor(g * (t + 1), dtype=torch.float64) for k, g in zip("abc", (0.5, -1.5, 2.0))} for t in range(3)
    ]
    grouped, single = both_paths(alias(**settings), params, steps)
    assert_trees_equal(grouped, single)
    runs = []
    for per_tensor in (False, True):
        tensors = [torch.nn.Parameter(v.clone()) for v in params.values()]
        opt = fb.Optimizer(tensors, alias(**settings), fused=False)
        for step in steps:
            for p, g in zip(tensors, step.values()):
                p.grad = g.clone()
            with foreach.per_tensor() if per_tensor else contextlib.nullcontext():
                opt.step()
        runs.append([p.detach().clone() for p in tensors])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "alias", sorted(set(ALL_ALIASES) - REFUSE_COMPLEX, key=lambda a: a.__name__), ids=lambda a: a.__name__
)
def test_complex_parameters_give_the_same_bits(alias):
    gen = seeded(3)
    params = {k: torch.randn(4, 3, dtype=torch.complex64, generator=gen) for k in "ab"} | {
        "r": torch.randn(4, generator=gen)
    }
    steps = [{k: torch.randn(p.shape, dtype=p.dtype, generator=gen) for k, p in params.items()} for _ in range(3)]
    grouped, single = both_paths(alias(**RICH_SETTINGS.get(alias, {})), params, steps)
    assert_trees_equal(grouped, single)


WRAPPERS = {
    "inject_hyperparams": lambda: fb.inject_hyperparams(fb.adamw)(lr=1e-2, weight_decay=0.1),
    "schedule": lambda: fb.adam(fb.schedules.cosine_decay(1e-2, 10)),
    "chain with clip_by_global_norm": lambda: fb.chain(fb.clip_by_global_norm(0.5), fb.sgd(0.1, momentum=0.9)),
    "clip": lambda: fb.chain(fb.clip(0.3), fb.adam(1e-2)),
    "masked": lambda: fb.masked(fb.add_decayed_weights(0.1), lambda p: {k: v.dim() > 1 for k, v in p.items()}),
    "partition": lambda: fb.partition(
        {"decay": fb.adamw(1e-2, weight_decay=0.1), "plain": fb.sgd(0.1)},
        lambda p: {k: "decay" if v.dim() > 1 else "plain" for k, v in p.items()},
    ),
    "multi_steps": lambda: fb.multi_steps(fb.adam(1e-2), every_k_schedule=2),
    "apply_if_finite": lambda: fb.apply_if_finite(fb.adam(1e-2), max_consecutive_errors=2),
    "lookahead": lambda: fb.lookahead(fb.adam(1e-2), sync_period=2, alpha=0.5),
    "ema": lambda: fb.chain(fb.adam(1e-2), fb.ema(0.9)),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_wrappers_give_the_same_bits_grouped_and_per_tensor(name):
    params, steps = mixed_problem(fb.adam)
    grouped, single = both_paths(WRAPPERS[name](), params, steps)
    assert_trees_equal(grouped, single)


@pytest.mark.parametrize(
    "alias", sorted(set(ALL_ALIASES) - READS_SHAPES, key=lambda a: a.__name__), ids=lambda a: a.__name__
)
def test_builtin_rules_run_grouped(alias, monkeypatch):
    """Every elementwise rule of the aliases runs as one group per dtype: strict() raises where a
    rule would fall back to one tensor at a time, and each group's rule is called once."""
    calls = []
    original = foreach.run_grouped

    def counting(rule, columns, indices, *given, **options):
        calls.append(len(indices))
        return original(rule, columns, indices, *given, **options)

    monkeypatch.setattr(foreach, "run_grouped", counting)
    params, steps = mixed_problem(alias)
    tx = alias(**RICH_SETTINGS.get(alias, {}))
    state = tx.init(params)
    with foreach.strict():
        tx.update(steps[0], state, params)
    assert calls and max(calls) > 1, calls


def test_leaves_refuse_what_only_one_tensor_has():
    leaves = foreach.Leaves([torch.ones(2), torch.ones(3)])
    with pytest.raises(foreach.PerTensorOnly):
        leaves.shape  # noqa: B018
    with pytest.raises(foreach.PerTensorOnly):
        bool(leaves)
    assert [t.tolist() for t in (leaves * 2 + 1).items] == [[3.0, 3.0], [3.0, 3.0, 3.0]]


def test_a_users_rule_that_reads_shapes_still_works():
    """A rule the grouped path cannot run (it reads its tensor's shape) runs per tensor."""

    def update_leaf(g, s, p):
        return g * g.shape[0], s

    tx = fb.leafwise(fb.EmptyState, lambda p: fb.EmptyState(), update_leaf, name="by_rows")
    params = {"a": torch.ones(2, 3), "b": torch.ones(4)}
    updates, _ = tx.update(params, tx.init(params), params)
    assert torch.equal(updates["a"], torch.full((2, 3), 2.0)) and torch.equal(updates["b"], torch.full((4,), 4.0))


def test_shared_step_counts_come_back_one_per_tensor():
    """A group whose tensors share their step count runs the count's arithmetic once, and each
    tensor gets its own new count (no aliases): torch's in-place kernel, stepping the counts one
    by one after a grouped update, moves each by one."""
    from functional_bagua import kernels

    params = {k: torch.randn(5) for k in "abc"}
    grads = {k: torch.randn(5) for k in "abc"}
    tx = fb.adam(1e-2)
    _, state = tx.update(grads, tx.init(params), params)
    counts = [kernels.moments_of("adam", state).count[k] for k in "abc"]
    assert [c.item() for c in counts] == [1, 1, 1]
    assert len({c.data_ptr() for c in counts}) == 3
    kernels.run(kernels.spec_of(tx), grads, state, clone_tree(params))
    assert [kernels.moments_of("adam", state).count[k].item() for k in "abc"] == [2, 2, 2]


@pytest.mark.parametrize("method", ["add_", "mul_", "div_"])
def test_in_place_ops_on_leaves_are_the_tensor_methods(method):
    """Leaves' in-place ops (for a rule's own temporaries) overwrite each tensor as the tensor
    method does, with another Leaves, a number, a shared 0-dim tensor or a 0-dim tensor per item."""
    gen = seeded(0)
    xs = [torch.randn(n, generator=gen) for n in (3, 5)]
    ys = [torch.randn(n, generator=gen) for n in (3, 5)]
    for other in (foreach.Leaves(ys), 0.7, torch.tensor(1.3, dtype=torch.float64)):
        leaves = foreach.Leaves([x.clone() for x in xs])
        result = getattr(leaves, method)(other)
        assert result is leaves
        others = other.items if isinstance(other, foreach.Leaves) else [other] * 2
        for got, x, y in zip(leaves.items, xs, others):
            assert torch.equal(got, getattr(x.clone(), method)(y))
    per_item = foreach.Leaves([torch.tensor(2.0), torch.tensor(3.0)])
    leaves = foreach.Leaves([x.clone() for x in xs])
    getattr(leaves, method)(per_item)
    for got, x, y in zip(leaves.items, xs, per_item.items):
        assert torch.equal(got, getattr(x.clone(), method)(y))


def test_neg_in_place_on_leaves_is_the_tensor_method():
    xs = [torch.randn(n, generator=seeded(1)) for n in (3, 5)]
    leaves = foreach.Leaves([x.clone() for x in xs])
    assert leaves.neg_() is leaves
    for got, x in zip(leaves.items, xs):
        assert torch.equal(got, x.clone().neg_())


FACTORS = [
    0.9,
    -1e-3,
    1 / 3,
    1e-8,
    3,
    1e30,
    2**60 + 2**36 + 1,  # ints past 2^53: rounded once to the tensors' dtype, as the single-tensor op does
    -(2**60 + 2**36 + 1),
    (1 - 0.999**7, torch.float64),
    (1 / 3, torch.float32),
    (0.5, torch.float64),
]


@pytest.mark.parametrize("as_on_a_gpu", [False, True], ids=["cpu-form", "gpu-form"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "add_", "mul_", "div_"])
def test_a_number_or_0_dim_factor_gives_each_tensor_its_single_tensor_bits(dtype, op, as_on_a_gpu, monkeypatch):
    """Leaves pass a number (or a 0-dim tensor of another dtype) to torch's multi-tensor ops in
    the form they convert once (the CPU's), or take whole (a GPU's: one 0-dim tensor of the
    list's dtype, chosen here on the CPU too); each tensor (0-dim and strided ones too) gets the
    bits and dtype of the single-tensor op, ``getattr(t, op)(factor)``."""
    if as_on_a_gpu:
        monkeypatch.setattr(foreach, "_converts_scalars_per_tensor", lambda device: False)
    gen = seeded(0)
    tensors = [
        (torch.randn(1000, generator=gen) * 10).to(dtype),
        torch.randn((), generator=gen).to(dtype),
        torch.randn(3, 5, generator=gen).to(dtype)[:, ::2],
    ]
    for factor in FACTORS:
        b = torch.tensor(factor[0], dtype=factor[1]) if isinstance(factor, tuple) else factor
        expected = [getattr(t.clone(), op)(b) for t in tensors]
        got = getattr(foreach.Leaves([t.clone() for t in tensors]), op)(b).items
        for e, g in zip(expected, got):
            assert g.dtype == e.dtype and g.shape == e.shape, (op, factor)
            assert torch.equal(g, e), (op, factor)


def test_a_number_meets_tensors_of_several_dtypes_as_each_single_tensor_op():
    tensors = [torch.linspace(-3, 3, 7), torch.linspace(-3, 3, 7, dtype=torch.float64), torch.tensor(0.7)]
    for op in ("mul", "add", "div"):
        for b in (0.9, torch.tensor(1 / 3, dtype=torch.float64)):
            got = getattr(foreach.Leaves(tensors), op)(b).items
            for t, g in zip(tensors, got):
                e = getattr(t, op)(b)
                assert g.dtype == e.dtype and torch.equal(g, e), (op, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("op", ["lerp", "clamp", "clamp_min", "clamp_max", "maximum", "minimum"])
def test_a_0_dim_cpu_operand_of_lerp_clamp_or_extremes_runs_one_multi_tensor_op_with_the_single_tensor_bits(
    dtype, op, monkeypatch
):
    """A 0-dim CPU tensor (a weight or a bound computed from the step count), beside tensors on
    the CPU or a GPU, reaches torch's multi-tensor op as a number rounded to the tensors' dtype: one call for the group, each
    tensor the bits and dtype of the single-tensor op (float32 and float64; other dtypes one
    tensor at a time, as before)."""
    gen = seeded(1)
    tensors = [(torch.randn(1000, generator=gen) * 3).to(dtype), torch.randn(4, 5, generator=gen).to(dtype)[:, ::2]]
    ends = [torch.randn(t.shape, generator=gen).to(dtype) for t in tensors]
    calls = []
    original = foreach._map
    monkeypatch.setattr(foreach, "_map", lambda *a: calls.append(a) or original(*a))
    for value in (1 / 3, 0.7, 1 - 0.9**5):
        for scalar_dtype in (torch.float64, torch.float32, dtype):
            b = torch.tensor(value, dtype=scalar_dtype, device="cpu")
            on = b.to(tensors[0].device)  # the single-tensor op's operand, on the tensors' device
            if op == "lerp":
                expected = [t.lerp(e, on.to(dtype)) for t, e in zip(tensors, ends)]
                got = foreach.Leaves(tensors).lerp(foreach.Leaves(ends), b.to(dtype)).items
            elif op == "clamp":
                expected = [t.clamp(-on, on) for t in tensors]
                got = foreach.Leaves(tensors).clamp(-b, b).items
            else:
                expected = [getattr(t, op)(on) for t in tensors]
                got = getattr(foreach.Leaves(tensors), op)(b).items
            for e, g in zip(expected, got):
                assert g.dtype == e.dtype and torch.equal(g, e), (op, value, scalar_dtype)
    assert bool(calls) == (dtype == torch.bfloat16), "one multi-tensor op for float32 and float64 only"
    # beside a 0-dim tensor of the group, a bound of another dtype promotes it as the single-tensor op does
    scalar, bound = torch.tensor(0.25, dtype=dtype), torch.tensor(1 / 3, dtype=torch.float64, device="cpu")
    for e, g in zip(
        [t.clamp_min(bound.to(t.device)) for t in (scalar, *tensors)],
        foreach.Leaves([scalar, *tensors]).clamp_min(bound).items,
    ):
        assert g.dtype == e.dtype and torch.equal(g, e)


@pytest.mark.parametrize(
    "alias, settings",
    [(a, RICH_SETTINGS.get(a, {})) for a in ALL_ALIASES if a is not fb.muon] + list(NEWER_FIRST_ORDER.items()),
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_per_tensor_scalars_computed_stacked_give_each_tensor_its_bits(alias, settings, monkeypatch):
    """As on a GPU: the group's step counts enter the rule one per tensor (0-dim tensors on the
    device are not compared, so not shared), and each elementwise op on them runs once on them
    stacked into a vector; the updates and states are those of the rule run one tensor at a time.
    (The CPU computes stacked here only for this test: its vectorized kernels could round a
    ``pow`` otherwise than its scalar ones; a GPU runs the same code on each element.)"""
    params, steps = mixed_problem(alias)
    per_tensor_run = run_per_tensor(alias(**settings), params, steps)
    with as_on_a_gpu(monkeypatch) as stacked_ops, torch.no_grad():  # as fb.Optimizer.step runs
        grouped = run(alias(**settings), params, steps)
    assert_trees_equal(grouped, per_tensor_run)
    if alias in (fb.adamw, fb.nadam, fb.schedule_free_adamw):  # bias corrections from per-tensor counts
        assert stacked_ops.count(True) >= 3, stacked_ops


@contextlib.contextmanager
def as_on_a_gpu(monkeypatch):
    """Scalars not shared and computed stacked, as on a GPU; yields whether each elementwise op
    on per-tensor scalars ran stacked."""
    stacked_ops: list = []
    original = foreach._on_stacked_scalars

    def counted(fn, args, kwargs, n):
        result = original(fn, args, kwargs, n)
        stacked_ops.append(result is not None)
        return result

    with monkeypatch.context() as m:
        m.setattr(foreach, "_stacks_scalars", lambda device: True)
        m.setattr(foreach, "_shared_or_leaves", lambda picked, beside=None: foreach.Leaves(picked))
        m.setattr(foreach, "_on_stacked_scalars", counted)
        yield stacked_ops


def run_per_tensor(tx, params, steps):
    with foreach.per_tensor():
        return run(tx, params, steps)


@pytest.mark.parametrize(
    "alias", [fb.adam, fb.nadam, fb.radam, fb.schedule_free_adamw, fb.adopt], ids=lambda a: a.__name__
)
def test_a_group_of_0_dim_parameters_runs_its_whole_rule_stacked_as_each_tensor_alone(alias, monkeypatch):
    """Only 0-dim parameters (learnable scales), some without a gradient at some steps: on a
    GPU each operation of the rule runs once on them stacked; each gets its single-tensor bits."""
    gen = seeded(3)
    params = {
        f"s{i}": torch.randn((), generator=gen).to(dtype)
        for i, dtype in enumerate([torch.float32] * 3 + [torch.float64] * 2)
    }
    steps = [
        {k: None if t % 2 and k == "s0" else torch.randn((), generator=gen).to(p.dtype) for k, p in params.items()}
        for t in range(STEPS)
    ]
    per_tensor_run = run_per_tensor(alias(lr=1e-2), params, steps)
    with as_on_a_gpu(monkeypatch) as stacked_ops, torch.no_grad():
        grouped = run(alias(lr=1e-2), params, steps)
    assert_trees_equal(grouped, per_tensor_run)
    assert stacked_ops.count(True) >= 3, stacked_ops


@pytest.mark.parametrize("alias", list(NEWER_FIRST_ORDER) + [fb.prodigy, fb.dadapt_adam], ids=lambda a: a.__name__)
def test_newer_first_order_aliases_give_the_same_bits_grouped_and_per_tensor(alias):
    """Schedule-free, ADOPT, AdEMAMix, LaProp, MARS and the learning-rate-free pair (whose sums
    and moments run through foreach.run_each), grouped against one tensor at a time, float32,
    float64 and bfloat16 parameters with some gradients None."""
    params, steps = mixed_problem(alias)
    settings = NEWER_FIRST_ORDER.get(alias, dict(weight_decay=0.1))
    grouped, single = both_paths(alias(**settings), params, steps)
    assert_trees_equal(grouped, single)


def test_clamp_in_place_with_both_bounds_gives_the_single_tensor_bits_small_or_large():
    """Leaves.clamp_(lo, hi): two multi-tensor clamps for small tensors, one single-tensor
    clamp_ per tensor for large ones (one pass instead of two); both the bits of t.clamp(lo, hi),
    NaN kept."""
    gen = seeded(4)
    for n in (7, foreach.LARGE_TENSOR + 3):
        tensors = [torch.randn(n, generator=gen) * 3 for _ in range(3)]
        tensors[0][1] = float("nan")
        expected = [t.clamp(-1.5, 1.25) for t in tensors]
        got = foreach.Leaves([t.clone() for t in tensors]).clamp_(-1.5, 1.25).items
        for e, g in zip(expected, got):
            assert torch.equal(e.nan_to_num(7.0), g.nan_to_num(7.0)) and bool(g.isnan().any()) == bool(e.isnan().any())


def test_a_count_computed_once_for_a_group_is_copied_into_each_tensors_own_count():
    """fb.Optimizer (its state given up) writes a group's step count, computed once from the
    shared count, into each tensor's count: every count holds the number of steps, none aliases
    another's (one stepped in place leaves the others, and that tensor then steps alone), as
    torch.optim's per-parameter step tensors; counts that share one tensor get new ones."""
    gen = seeded(15)
    tensors = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(3)]
    opt = fb.Optimizer(tensors, fb.adopt(1e-2))

    def counts():
        return [next(v for k, v in opt.state[p].items() if k.endswith("count")) for p in tensors]

    for _ in range(3):
        for p in tensors:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    assert [int(c) for c in counts()] == [3, 3, 3]
    assert len({c.data_ptr() for c in counts()}) == 3
    counts()[0].add_(10)  # as a kernel stepping counts one by one would
    assert [int(c) for c in counts()] == [13, 3, 3]
    for p in tensors:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert [int(c) for c in counts()] == [14, 4, 4]
    # one count tensor shared by every parameter's state (a state edited by hand): the step
    # gives each its own again, none written through another
    shared = torch.tensor(4)
    for p in tensors:
        key = next(k for k in opt.state[p] if k.endswith("count"))
        opt.state[p][key] = shared
    for p in tensors:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert [int(c) for c in counts()] == [5, 5, 5] and int(shared) == 4
    assert len({c.data_ptr() for c in counts()}) == 3


def test_one_value_is_copied_only_into_tensors_of_its_shape_dtype_and_device():
    """OneValue.copied_into writes the value into old tensors that fit it exactly; an old tensor
    of another shape (which a copy would broadcast into) or dtype gets new copies instead, the
    old ones untouched."""
    value = torch.tensor(7, dtype=torch.int64)
    olds = [torch.tensor(1, dtype=torch.int64), torch.tensor(2, dtype=torch.int64)]
    placed = foreach.OneValue(value, 2).copied_into(olds)
    assert all(p is o for p, o in zip(placed, olds)) and [int(o) for o in olds] == [7, 7]
    for misfit in (torch.tensor([1], dtype=torch.int64), torch.tensor(1.0)):
        olds = [torch.tensor(1, dtype=torch.int64), misfit]
        kept = misfit.clone()
        placed = foreach.OneValue(value, 2).copied_into(olds)
        assert all(p is not o for p, o in zip(placed, olds)) and [int(p) for p in placed] == [7, 7]
        assert torch.equal(olds[1], kept) and int(olds[0]) == 1
        assert len({p.data_ptr() for p in placed}) == 2


@pytest.mark.cpu_only("a step is written in place on the CPU only")
def test_the_writable_part_is_every_tensor_or_those_that_may_be_written_alone():
    """``writable_part``: all the indices where their tensors may be written in place together;
    else those that may be alone (not 0-dim, float32 or float64: either); none where those
    start at one address."""
    tensors = [torch.zeros(()), torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(4)]
    tensors.append(torch.zeros(5, dtype=torch.bfloat16))

    def of(indices):
        return [tensors[i] for i in indices]

    assert foreach.writable_part([1, 3], of) == [1, 3]
    assert foreach.writable_part([0, 1, 2, 3, 4], of) == [1, 2, 3]
    assert foreach.writable_part([2, 1, 3], of) == [2, 1, 3]
    assert foreach.writable_part([0, 4], of) == []
    shared = torch.zeros(6)
    starting_together = [shared[:3], shared[:2], torch.zeros(())]
    assert foreach.writable_part([0, 1, 2], lambda indices: [starting_together[i] for i in indices]) == []


class _ArgumentDevices(torch.overrides.TorchFunctionMode):
    """Records the devices of the tensor arguments each torch function is called with."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, [a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]))
        return func(*args, **kwargs)


def test_a_rule_on_one_tensor_computes_its_factors_on_the_cpu_and_gives_them_to_its_ops_on_the_device():
    """ScalarsBeside (a rule run on one tensor beside counts held on the CPU): arithmetic among
    0-dim CPU tensors stays there (the grouped path's factors, bit for bit), also in place, and
    an op given a tensor on the device takes each 0-dim CPU operand there (the clamps refuse a
    CPU bound beside a GPU tensor). (The meta device stands in for a GPU.)"""
    meta = torch.device("meta")
    count, x = torch.tensor(3, dtype=torch.int64, device="cpu"), torch.empty(3, 4, device=meta)
    with _ArgumentDevices() as seen, foreach.ScalarsBeside(meta):
        bound = (count.to(torch.float64) + 1) ** 0.25
        clipped = x.clamp(-bound, bound)
        count.add_(torch.ones((), dtype=torch.int64, device="cpu"))
        scale = torch.empty((), device=meta).clamp_min(bound)  # a 0-dim parameter's too
    assert bound.device.type == "cpu" and clipped.is_meta and count.item() == 4 and scale.is_meta
    by_function = {getattr(func, "__name__", str(func)): devices for func, devices in seen.calls}
    assert by_function["clamp_min"] == ["meta", "meta"]
    assert by_function["pow"] == ["cpu"]  # the factor: on the CPU
    assert by_function["clamp"] == ["meta", "meta", "meta"]  # the bound taken beside the tensor
    assert by_function["add_"] == ["cpu", "cpu"]  # no tensor on the device: as it is


def test_step_counts_on_two_devices_are_not_taken_as_one():
    """A group whose counts a trainer moved in part (``optimizer.state[p][...] = t.to(device)``):
    they are not compared (that would stack tensors of two devices), each tensor keeps its own.
    (The meta device stands in for a GPU.)"""
    cpu = torch.device("cpu")
    counts = [torch.tensor(3, device=cpu), torch.tensor(3, device="meta")]
    assert isinstance(foreach._shared_or_leaves(counts), foreach.Leaves)
    assert foreach._shared_or_leaves([torch.tensor(3, device=cpu), torch.tensor(3, device=cpu)]).dim() == 0


def test_a_cpu_factor_beside_gpu_tensors_one_at_a_time_is_taken_there_as_a_rule_on_one_tensor_takes_it():
    """Where the multi-tensor op cannot take a 0-dim CPU factor as a number (bfloat16 tensors),
    each tensor's op gets it on their device, as :class:`foreach.ScalarsBeside` gives it to a
    rule run on one tensor: the same operand either way. (The meta device stands in for a GPU.)"""
    tensors = [torch.empty(3, device="meta", dtype=torch.bfloat16) for _ in range(2)]
    factor = torch.tensor(0.999, dtype=torch.float64, device="cpu")
    with _ArgumentDevices() as seen:
        foreach.Leaves(tensors).mul_(factor)
        foreach.Leaves(tensors).clamp_(-factor, factor)
        foreach.Leaves(tensors).lerp_(foreach.Leaves(tensors), factor)
    per_tensor = [
        (getattr(f, "__name__", ""), d)
        for f, d in seen.calls
        if getattr(f, "__name__", "") in ("mul_", "clamp_", "lerp_")
    ]
    assert per_tensor and all(set(devices) == {"meta"} for _, devices in per_tensor), per_tensor


class _Divisors(torch.overrides.TorchFunctionMode):
    """Records the divisor each multi-tensor division is given."""

    def __init__(self):
        super().__init__()
        self.divisors = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch._foreach_div, torch._foreach_div_):
            self.divisors.append(args[1])
        return func(*args, **(kwargs or {}))


def test_a_cpu_factor_divides_gpu_tensors_as_it_divides_one_of_them():
    """CUDA's multi-tensor division by one number multiplies by its reciprocal (one rounding
    more), as its division by a CPU scalar does; a rule run on one tensor divides by the factor
    taken to the device (:class:`foreach.ScalarsBeside`), a true division. So a 0-dim CPU factor
    read as a number reaches the multi-tensor division as a list of it (torch's ScalarList form,
    a true division, one kernel still): grouped and one tensor at a time divide alike. A number
    the rule gives itself is left as it is (one tensor at a time, it is a CPU scalar there too).
    (The meta device stands in for a GPU.)"""
    tensors = [torch.empty(3, device="meta", dtype=torch.float64) for _ in range(3)]
    factor = torch.tensor(0.3122, dtype=torch.float64, device="cpu")
    with _Divisors() as seen:
        foreach.Leaves(tensors).div(factor)
        foreach.Leaves(tensors).div_(factor)
        foreach.Leaves(tensors).div(0.5)
    assert seen.divisors == [[factor.item()] * 3, [factor.item()] * 3, 0.5]
