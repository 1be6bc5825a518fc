"""A rule's operations on ``Leaves`` recorded on one chunk of tensors and run again on others
(``foreach.recorded``, ``foreach.run_in_chunks``): the results are the rule's own on each chunk,
bit for bit, with the rule's Python run once; a rule whose operations depend on its tensors'
values (a number read from them), or that makes ``Leaves`` outside the recorded operations, is
run again on each chunk instead. And the numbers the multi-tensor ops take as 0-dim tensors,
made once per value, keep every bit of the number (``-0.0`` apart from ``0.0``)."""

from __future__ import annotations

import pytest
import torch
from devices import seeded

from functional_bagua import foreach, numerics
from functional_bagua.foreach import Leaves

pytestmark = pytest.mark.cpu_only("the multi-tensor ops are checked on the CPU, where fb.Optimizer records steps")

SHAPES = [(5, 4), (7,), (3, 2, 2), (6,), (2, 3)]
CHUNKS = [[0, 1], [2], [3, 4]]


def tensors(seed):
    gen = seeded(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def adam_like(counter):
    """An Adam-like rule written for one tensor: its scalar arithmetic on a shared 0-dim count,
    in-place and out-of-place operations, a torch function and a tensor method."""

    def rule(g, mu, nu, p, count):
        counter.append(1)
        t = count + 1
        correction = 1 - 0.9**t
        numbers = numerics.eager_numbers((correction,), g)
        mu = foreach.updated(mu, "lerp", g, 0.1)
        nu.mul_(0.999).addcmul_(g, g, value=0.001)
        denom = torch.sqrt(nu).add_(1e-8).clamp_(1e-6, 1e3)
        p.addcdiv_(mu, denom, value=-1e-2 / numbers[0])
        return p.abs().neg(), (mu, nu, t)

    return rule


def chunked_args(columns, count, given):
    """Per chunk of :data:`CHUNKS`, the rule's arguments: each column's tensors of the chunk as
    ``Leaves`` (state given up where in ``given``), and the shared ``count``."""
    out = []
    for indices in CHUNKS:
        overwrites = []
        leaves = [
            Leaves([column[i] for i in indices], given=overwrites if c in given else None, plain=torch.float32)
            for c, column in enumerate(columns)
        ]
        out.append([*leaves, count])
    return out


def run_each_chunk_alone(rule, columns, count, given):
    """The rule itself on each chunk, its results."""
    return [rule(*args) for args in chunked_args(columns, count, given)]


def flat(result):
    """A result's tensors, in order."""
    if isinstance(result, Leaves):
        return list(result.items)
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for part in result for t in flat(part)]


def test_operations_run_again_on_each_chunk_are_the_rule_on_each_chunk():
    """Two steps: the rule on the first chunk and its recorded operations on the others give the
    same bits (results and tensors written in place) as the rule on each chunk, and the rule's
    Python ran once a step."""
    count = torch.tensor(3.0, dtype=torch.float64)
    recorded_calls, alone_calls = [], []
    ours, theirs = [tensors(1) for _ in range(3)], [tensors(1) for _ in range(3)]
    for c in range(3):  # a positive second moment
        ours[c], theirs[c] = [t.abs() for t in ours[c]], [t.abs() for t in theirs[c]]
    grads = tensors(2)
    for _ in range(2):
        got = foreach.run_in_chunks(adam_like(recorded_calls), chunked_args([grads, *ours], count, (1, 2)), [])
        expected = run_each_chunk_alone(adam_like(alone_calls), [grads, *theirs], count, (1, 2))
        for a, b in zip(got, expected):
            assert all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))
        for mine, reference in zip(ours, theirs):
            assert all(torch.equal(x, y) for x, y in zip(mine, reference))
    assert len(recorded_calls) == 2, "the rule's Python runs on the first chunk only"
    assert len(alone_calls) == 2 * len(CHUNKS)


def test_a_rule_that_reads_its_tensors_values_runs_on_each_chunk():
    """A rule that takes a number from per-tensor 0-dim tensors (equal within a chunk, different
    between chunks): its operations with the first chunk's number are not run again on the
    others; the rule runs on each, each chunk scaled by its own number."""
    counts = [torch.tensor(float(k), dtype=torch.float64) for k in (1, 1, 2, 5, 5)]
    calls = []

    def rule(g, count):
        calls.append(1)
        (number,) = numerics.eager_numbers((count,), g)
        return g.mul(number)

    grads = tensors(3)
    args = [[Leaves([grads[i] for i in ix], plain=torch.float32), Leaves([counts[i] for i in ix])] for ix in CHUNKS]
    got = foreach.run_in_chunks(rule, args, [])
    for indices, result in zip(CHUNKS, got):
        for i, t in zip(indices, result.items):
            assert torch.equal(t, grads[i] * counts[i].item())
    assert len(calls) == len(CHUNKS)


def test_a_rule_that_makes_leaves_of_its_own_runs_on_each_chunk():
    """A rule that builds ``Leaves`` from another's tensors (outside the recorded operations), or
    returns such: run on each chunk, the results its own."""

    def doubled_through_items(g):
        return Leaves([t * 2 for t in g.items]).add(1.0)

    def returned_as_made(g):
        g.mul(3.0)
        return Leaves([t + 1 for t in g.items])

    grads = tensors(4)
    for rule, expected in ((doubled_through_items, lambda t: t * 2 + 1.0), (returned_as_made, lambda t: t + 1)):
        args = [[Leaves([grads[i] for i in ix], plain=torch.float32)] for ix in CHUNKS]
        got = foreach.run_in_chunks(rule, args, [])
        for indices, result in zip(CHUNKS, got):
            assert all(torch.equal(t, expected(grads[i])) for i, t in zip(indices, result.items))


def test_what_was_done_is_kept_where_a_chunk_raises():
    """A rule that raises on the second chunk (run alone there: it reads its tensors' values):
    the first chunk's result is in the list, so that its caller knows what was written."""

    def rule(g, count):
        (number,) = numerics.eager_numbers((count,), g)
        if number > 1:
            raise RuntimeError("a number too large")
        return g.mul(number)

    grads = tensors(5)
    counts = [torch.tensor(v, dtype=torch.float64) for v in (1.0, 1.0, 2.0, 2.0, 2.0)]
    args = [[Leaves([grads[i] for i in ix], plain=torch.float32), Leaves([counts[i] for i in ix])] for ix in CHUNKS]
    done: list = []
    with pytest.raises(RuntimeError, match="too large"):
        foreach.run_in_chunks(rule, args, done)
    assert len(done) == 1


def test_a_later_chunk_whose_values_differ_runs_one_tensor_at_a_time():
    """A rule that reads a number from its tensors (their largest magnitude), equal within the
    first chunk, different within the second: the first chunk runs grouped, the second one
    tensor at a time (where the grouped rule refuses), each tensor scaled by its own number."""
    calls = []

    def rule(g):
        calls.append(len(g))
        (largest,) = numerics.eager_numbers((g.abs().amax(),), g)
        return g.div(largest)

    grads = [torch.full((3,), 2.0), torch.full((2,), -2.0), torch.full((4,), 1.0), torch.full((2,), 3.0)]
    chunks = [[0, 1], [2, 3]]
    args = [[Leaves([grads[i] for i in ix], plain=torch.float32)] for ix in chunks]
    got = foreach.run_in_chunks(rule, args, [])
    for indices, result in zip(chunks, got):
        for i, t in zip(indices, result.items):
            assert torch.equal(t, grads[i] / grads[i].abs().max())
    assert calls == [2, 2, 1, 1], "the second chunk grouped first, then one tensor at a time"


def test_a_rule_returning_a_list_gives_each_chunk_its_own():
    """Results inside a list (not a tuple) are each chunk's own tensors."""

    def rule(g):
        return [g.mul(2.0), g.add(1.0)]

    grads = tensors(6)
    args = [[Leaves([grads[i] for i in ix], plain=torch.float32)] for ix in CHUNKS]
    got = foreach.run_in_chunks(rule, args, [])
    for indices, (doubled, plus_one) in zip(CHUNKS, got):
        assert all(torch.equal(t, grads[i] * 2) for i, t in zip(indices, doubled.items))
        assert all(torch.equal(t, grads[i] + 1) for i, t in zip(indices, plus_one.items))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_numbers_taken_as_tensors_keep_every_bit(dtype):
    """``0.0`` then ``-0.0``, ``2`` then ``2.0``, a NaN then one of the other sign, and a
    number then the next one up: each multi-tensor op gives the single-tensor op's bits (a
    number made into a tensor once per value must not stand for another)."""
    x = torch.tensor([1.0, -3.0, 0.5], dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    nan = float("nan")
    up = torch.nextafter(torch.tensor(0.1, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)).item()
    for number in (0.0, -0.0, 2, 2.0, nan, -nan, 0.1, up):
        for op in ("mul", "div", "add", "sub"):
            grouped = getattr(Leaves([x.clone()], plain=dtype), op + "_")(number).items[0]
            alone = getattr(x.clone(), op + "_")(number)
            assert torch.equal(grouped.view(bits), alone.view(bits)), (number, op)


def test_a_number_first_met_under_another_default_device_serves_cpu_tensors():
    """A number first made into a tensor while the default device is ``meta``: later, on CPU
    tensors, the op still computes (the number's tensor is made on the CPU)."""
    with torch.device("meta"):
        torch.tensor(1.0)  # the default device now meta
        Leaves([torch.ones(3, device="cpu")], plain=torch.float32).mul_(0.7071)
    x = Leaves([torch.ones(3)], plain=torch.float32)
    x.mul_(0.7071)
    assert torch.equal(x.items[0], torch.ones(3).mul_(0.7071))
