"""The second-order transforms (SOAP, Shampoo, PSGD-Kron) at their edges: purity, tensors of
other shapes sharing a view, empty and low-precision tensors, frozen tensors, and PSGD-Kron's
per-tensor bias correction against kron-torch when a tensor's first gradient comes late."""

from __future__ import annotations

import contextlib
import io

import optree
import pytest
import torch
from devices import seeded
from second_order_helpers import draws

import functional_bagua as fb

try:
    import kron_torch
except ImportError:
    kron_torch = None

TRANSFORMS = {
    "soap": lambda: fb.soap(precondition_frequency=2),
    "shampoo": lambda: fb.shampoo(grafting="adam", precondition_frequency=2),
    "psgd_kron": lambda: fb.psgd_kron(),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_update_leaves_its_input_state_and_gradients_unchanged(name):
    params, grads = draws({"a": (4, 3), "b": (4, 3), "c": (5,), "s": ()}, steps=5)
    tx = TRANSFORMS[name]()
    state = tx.init(params)
    for t, g in enumerate(grads):
        g = dict(g, c=None) if t == 2 else g
        before = optree.tree_map(lambda x: None if x is None else x.clone(), (state, g), none_is_leaf=True)
        _, new_state = tx.update(g, state, params)
        same = optree.tree_map(
            lambda x, y: (x is None and y is None) or torch.equal(x, y), (state, g), before, none_is_leaf=True
        )
        assert all(optree.tree_leaves(same)), t
        state = new_state


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_a_compiled_fused_update_leaves_its_input_state_unchanged(name):
    """Compiled, SOAP's and Shampoo's refreshes run in operators that write in place, into copies
    of the bases and roots the step was given; the state passed in must stay as it was
    (dynamo alone: the operators run as eagerly, no copies of inductor's to hide a write)."""
    params, grads = draws({"a": (4, 4), "b": (4, 4), "c": (5,)}, steps=5)
    layout = fb.FlatLayout.of(params)
    tx = fb.fuse(TRANSFORMS[name](), layout)
    update = torch.compile(tx.update, fullgraph=True, backend="eager")
    flat = layout.flatten(params)
    state = tx.init(flat)
    for t, g in enumerate(grads):
        before = optree.tree_map(lambda x: x.clone(), state)
        _, new_state = update(layout.flatten(g), state, flat)
        same = optree.tree_map(torch.equal, state, before)
        assert all(optree.tree_leaves(same)), t
        state = new_state


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_a_factory_rebuilt_inside_a_compiled_step_traces_in_one_graph(name):
    """``inject_hyperparams`` (and ``fb.Optimizer``'s factory form) builds the transform again in
    every step, from hyperparameters held as tensors that a compiled step reads as data: the
    factory's checks, its caches and the decisions its state's structure rests on must not read
    them (each was a break in the graph; under ``fb.Optimizer`` dynamo then mistraced Shampoo's
    trees and raised). ``fullgraph=True`` raises at any break."""
    params, grads = draws({"w": (4, 4), "b": (4,)}, steps=3)
    alias, betas = {
        "soap": (fb.soap, {"betas": (0.9, 0.95)}),
        "shampoo": (fb.shampoo, {"betas": (0.9, 0.95)}),
        "psgd_kron": (fb.psgd_kron, {"b1": 0.9}),
    }[name]
    tx = fb.inject_hyperparams(alias)(lr=1e-2, **betas)
    compiled = torch.compile(tx.update, fullgraph=True, backend="eager")
    states = [tx.init(params), tx.init(params)]
    for step, g in enumerate(grads):
        torch.manual_seed(step)  # PSGD-Kron's probes
        eager, states[0] = tx.update(g, states[0], params)
        torch.manual_seed(step)
        got, states[1] = compiled(g, states[1], params)
        torch.testing.assert_close(got, eager, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_tensors_of_other_shapes_sharing_a_view_and_empty_tensors_keep_their_shapes(name):
    params = {"one": torch.ones(1), "scalar": torch.ones(()), "empty": torch.zeros(0, 3), "w": torch.ones(3, 2)}
    tx = TRANSFORMS[name]()
    state = tx.init(params)
    for _ in range(3):
        grads = {k: torch.randn(v.shape) for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        for k, v in params.items():
            assert updates[k].shape == v.shape, (k, updates[k].shape)
        assert updates["empty"].numel() == 0


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_step_close_to_float64(name, dtype):
    """A vector and a matrix in bfloat16 or float16: the updates within their precision of a
    float64 run on the same (rounded) numbers (Shampoo's roots cancel only in float32 or more,
    which it keeps them in)."""
    params, grads = draws({"v": (6,), "w": (4, 3)}, steps=3)
    params = {k: v.to(dtype).double() for k, v in params.items()}
    grads = [{k: v.to(dtype).double() for k, v in g.items()} for g in grads]
    # Shampoo with epsilon 1e-12 on statistics of less than full rank (3 gradients of a 6-vector)
    # multiplies float32 rounding by ~1e6 along their null space, whatever the parameters' dtype:
    # compare it where that does not swamp the precision under test
    make = (
        (lambda: fb.shampoo(grafting="adam", precondition_frequency=2, epsilon=1e-4))
        if name == "shampoo"
        else TRANSFORMS[name]
    )
    exact, low = make(), make()
    s64, s16 = exact.init(params), low.init({k: v.to(dtype) for k, v in params.items()})
    for t, g in enumerate(grads):
        torch.manual_seed(t)
        u64, s64 = exact.update(g, s64, params)
        torch.manual_seed(t)
        u16, s16 = low.update({k: v.to(dtype) for k, v in g.items()}, s16, {k: v.to(dtype) for k, v in params.items()})
        for k in u64:
            assert u16[k].dtype == dtype
            scale = u64[k].abs().max().item() + 1e-3
            assert (u16[k].double() - u64[k]).abs().max().item() <= 0.05 * scale, (t, k)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_a_frozen_tensor_keeps_its_state_in_storage_of_its_own(name):
    params, grads = draws({"a": (4, 4), "b": (4, 4)}, steps=3)
    tx = TRANSFORMS[name]()
    state = tx.init(params)
    for t, g in enumerate(grads):
        state = tx.update(dict(g, b=None) if t == 2 else g, state, params)[1]
    # the kept tensors of "b" are its own, not rows of the batch "a" and "b" stepped in before
    frozen = [v for path, v in zip(*optree.tree_flatten_with_path(state)[:2]) if "b" in path and v.dim() > 0]
    assert frozen and all(v._base is None for v in frozen)


@pytest.mark.skipif(
    kron_torch is None, reason="kron-torch (the PSGD-Kron reference) is not installed: pip install kron-torch"
)
def test_psgd_kron_bias_corrects_with_each_tensors_own_count_as_kron_torch():
    params, grads = draws({"a": (5, 4), "b": (6,)}, steps=6)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = kron_torch.Kron(list(ref.values()), lr=1e-2, precond_dtype=torch.float64)
    tx = fb.psgd_kron(lr=1e-2, precond_dtype=torch.float64)
    state, p = tx.init(params), params
    with torch.compiler.set_stance("force_eager"):
        for t, g in enumerate(grads):
            late = dict(g, b=None) if t < 3 else g  # "b" gets its first gradient at step 3
            for k, q in ref.items():
                q.grad = None if late[k] is None else late[k].clone()
            torch.manual_seed(t)
            with contextlib.redirect_stdout(io.StringIO()):
                opt.step()
            torch.manual_seed(t)
            u, state = tx.update(late, state, p)
            p = fb.apply_updates(p, u)
            for k in p:
                torch.testing.assert_close(
                    p[k], ref[k].detach(), rtol=1e-6, atol=1e-8, msg=lambda m: f"step {t} {k}: {m}"
                )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"precond_dtype": torch.bfloat16}, "precond_dtype must be torch.float32 or torch.float64"),
        ({"precond_init_scale": 0.0}, "precond_init_scale must be > 0"),
        ({"min_ndim_triangular": 2.5}, "min_ndim_triangular must be an int >= 0"),
    ],
)
def test_psgd_kron_refuses_what_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fb.scale_by_psgd_kron(**kwargs)


@pytest.mark.parametrize("factory", [fb.scale_by_soap, fb.scale_by_shampoo])
def test_eigendecompositions_in_half_precision_are_refused(factory):
    with pytest.raises(ValueError, match="matrix_dtype"):
        factory(matrix_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "made, used, message",
    [
        (
            lambda: fb.scale_by_shampoo(matrix_dtype=torch.float32),
            lambda: fb.scale_by_shampoo(),
            "made with another matrix_dtype",
        ),
        (
            lambda: fb.scale_by_psgd_kron(),
            lambda: fb.scale_by_psgd_kron(precond_dtype=torch.float64),
            "made with another precond_dtype",
        ),
    ],
    ids=["shampoo", "psgd_kron"],
)
def test_a_state_made_in_another_precision_is_refused_naming_the_option(made, used, message):
    params, grads = draws({"a": (4, 3)}, steps=1)
    with pytest.raises(ValueError, match=message):
        used().update(grads[0], made().init(params), params)
    layout = fb.FlatLayout.of(params)
    flat = layout.flatten(params)
    with pytest.raises(ValueError, match="shapes and dtypes"):  # the same inside fuse
        fb.fuse(used(), layout).update(layout.flatten(grads[0]), fb.fuse(made(), layout).init(flat), flat)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_a_compiled_fused_update_with_padded_strides_equals_the_eager_one(name):
    """Inductor pads the strides of the tensors a graph computes (on CUDA by default: a batch of
    40 x 33 matrices of float64 has a stride of 1320, padded to 1328), while it compiles each
    ``torch.cond`` branch (PSGD-Kron's) for dense operands, and SOAP's and Shampoo's refresh
    operators write into such tensors; here the padding is switched on for the CPU too."""
    params, grads = draws({f"w{i}": (40, 33) for i in range(3)}, steps=4)
    layout = fb.FlatLayout.of(params)
    # SOAP one-sided: a 40 x 40 statistic of rank 33 would have a degenerate eigenspace, whose basis
    # eager and compiled rounding pick differently
    # Shampoo's roots by Newton: its iteration, and eigh for the unconverged matrices, in the refresh
    tx = {
        "soap": lambda: fb.soap(precondition_frequency=2, max_precondition_dim=35),
        "shampoo": lambda: fb.shampoo(
            grafting="adam", precondition_frequency=2, root_method="newton", newton_iterations=4
        ),
    }.get(name, TRANSFORMS[name])()
    fused = fb.fuse(tx, layout)

    def step(p: dict, s: object, g: dict) -> tuple:
        u, s = fused.update(g, s, p)
        return fb.apply_updates(p, u), s

    compiled = torch.compile(step, fullgraph=True)
    runs = []
    for run in (step, compiled):
        torch.manual_seed(0)  # PSGD-Kron's probe vectors
        p = layout.flatten(params)
        s = fused.init(p)
        with torch._inductor.config.patch(disable_padding_cpu=False, fallback_random=True):
            for g in grads:
                p, s = run(p, s, layout.flatten(g))
        runs.append(p)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-7, atol=1e-9)


def test_a_compiled_refresh_that_reads_symbolic_floats():
    """Compiled with dynamic=True (and, without it, on recompiling one code object for another
    number), dynamo makes floats symbolic: the floats Shampoo's refresh reads (epsilon, the
    Newton tolerance) are passed to its operator as a tensor. Its roots by Newton: at the
    refresh the 2 x 2 statistic converges, the 5 x 5 one (of rank 4) is left to eigh, as
    eagerly."""
    params, grads = draws({"w": (5, 2)}, steps=3)
    tx = fb.shampoo(epsilon=1e-3, precondition_frequency=2, root_method="newton", newton_iterations=6)
    compiled = torch.compile(tx.update, fullgraph=True, dynamic=True)
    states = [tx.init(params), tx.init(params)]
    for g in grads:
        eager, states[0] = tx.update(g, states[0], params)
        got, states[1] = compiled(g, states[1], params)
        torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-14)


def test_soap_compiled_with_dynamic_shapes_refreshes_as_eagerly():
    """Compiled with dynamic=True dynamo made a float of SOAP's refresh symbolic, and the
    torch.cond its refresh ran under refused it; its decompositions now run in an operator of
    their own. Full-rank statistics (square gradients), so eager and compiled agree closely."""
    params, grads = draws({"w": (5, 5), "v": (4, 4)}, steps=6)
    tx = fb.soap(lr=1e-2, precondition_frequency=2)
    compiled = torch.compile(tx.update, fullgraph=True, dynamic=True, backend="aot_eager")
    states = [tx.init(params), tx.init(params)]
    for g in grads:
        eager, states[0] = tx.update(g, states[0], params)
        got, states[1] = compiled(g, states[1], params)
        torch.testing.assert_close(got, eager, rtol=1e-10, atol=1e-12)


def test_psgd_kron_compiled_with_dynamic_shapes_reads_its_constants_as_operands():
    """Compiled with dynamic=True dynamo made the module's probe scale a symbolic float, which
    the fit's torch.cond lifted as a tensor read by .item() (inductor: KeyError
    'unbacked_bindings'); it is passed in as an operand with the fit's step size."""
    params, grads = draws({"w": (5, 3), "b": (4,)}, steps=3)
    tx = fb.psgd_kron(lr=1e-2, precond_dtype=torch.float64)
    compiled = torch.compile(tx.update, fullgraph=True, dynamic=True)
    states = [tx.init(params), tx.init(params)]
    with torch._inductor.config.patch(fallback_random=True):  # the probes: torch's own randn
        for step, g in enumerate(grads):
            torch.manual_seed(step)
            eager, states[0] = tx.update(g, states[0], params)
            torch.manual_seed(step)
            got, states[1] = compiled(g, states[1], params)
            torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-9)


def test_flat_operand_cond_gives_the_branches_their_operands_eagerly_and_compiled():
    """Nested tuples, a 0-dim and a strided tensor come back as given; anything else is named."""
    from functional_bagua.transforms.batched_matrices import flat_operand_cond

    operands = ((torch.arange(6.0).reshape(2, 3), (torch.tensor(2.0),)), torch.arange(12.0).reshape(3, 4).mT)

    def branch(pair, strided):
        (matrix, (scalar,)) = pair
        return matrix * scalar, strided @ strided.mT

    def other(pair, strided):
        return pair[0].clone(), strided.mT @ strided

    expected = branch(*operands)
    for run in (flat_operand_cond, torch.compile(flat_operand_cond, backend="eager", fullgraph=True)):
        got = run(torch.tensor(True), branch, other, operands)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="operands must be tensors in nested tuples, got int"):
        flat_operand_cond(torch.tensor(True), branch, other, (*operands, 3))


def test_the_ranks_fingerprint_tells_equal_tensors_from_nearly_equal_ones():
    """What ranks compare before sharing results: equal for equal tensors (a NaN whatever its
    bits), different for one element a rounding step off, two rows or columns swapped, or the
    tensors in another order."""
    from functional_bagua.transforms.batched_matrices import _fingerprint

    gen = seeded(0)
    a, b = torch.randn(3, 5, 4, generator=gen), torch.randn(6, generator=gen, dtype=torch.float64)

    def bits(*tensors: torch.Tensor) -> torch.Tensor:
        return _fingerprint(tensors).view(torch.int64)

    base = bits(a, b)
    assert torch.equal(bits(a.clone(), b.clone()), base)
    nans = []
    for nan_bits in (0x7FC00000, 0x7FC00001):  # two float32 NaNs whose bits differ
        nan = a.clone()
        nan.view(torch.int32)[0, 0, 0] = nan_bits
        nans.append(nan)
    assert nans[0].view(torch.int32)[0, 0, 0] != nans[1].view(torch.int32)[0, 0, 0]
    assert torch.equal(bits(nans[0], b), bits(nans[1], b))
    one_ulp = a.clone()
    one_ulp[1, 2, 3] = torch.nextafter(one_ulp[1, 2, 3], torch.tensor(float("inf")))
    rows_swapped, columns_swapped = a.clone(), a.clone()
    rows_swapped[0, [1, 3]] = a[0, [3, 1]]
    columns_swapped[2, :, [0, 2]] = a[2, :, [2, 0]]
    for changed in (one_ulp, rows_swapped, columns_swapped):
        assert not torch.equal(bits(changed, b), base)
    assert not torch.equal(bits(a, b.flip(0)), base)
    assert not torch.equal(bits(b, a), base)
    # entries moved so that every row and column sum stays
    square = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    assert not torch.equal(bits(square), bits(square.flip(0)))
    # a NaN in one tensor hides no difference in another
    changed_b = b.clone()
    changed_b[2] += 1e6
    assert not torch.equal(bits(nans[0], changed_b), bits(nans[0], b))
    # +inf and -inf in different tensors do not cancel
    inf, minus_inf = torch.tensor([float("inf"), 1.0]), torch.tensor([float("-inf"), 1.0])
    assert not torch.equal(bits(inf, minus_inf), bits(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])))
    # empty tensors count for nothing (and raise nothing)
    assert torch.equal(bits(a, b, torch.zeros(3, 0)), base)
