"""Flat buffers and fused execution: fused == unfused for every alias of the parity table."""

from __future__ import annotations

import re

import pytest
import torch
from devices import at, reduction_tolerance, seeded
from models import batches, loss_fn, make_model
from parity_table import CASES, STEPS, run_functional

import functional_bagua as fb
from functional_bagua.flat import group_key

# per-tensor rules that reduce over a tensor (norms, means, matmuls) run on segment views; the
# only math that may differ from unfused at all is a reduction across tensors (global norms)
EXACT = dict(rtol=0, atol=0)


def run_fused(tx, kind, dtype, data):
    model = make_model(kind, dtype)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params)
    flat = layout.flatten(params)
    fused = fb.fuse(tx, layout)
    state = fused.init(flat)

    def loss_of(buffers, x, y):
        # the forward on fresh copies of the buffers' views: on CUDA a view's address changes which
        # kernels cuDNN runs, and with them the gradients' last bits; the fused update then gets
        # exactly the unfused run's gradients (differentiated back through the copies into the buffers)
        params = {k: v.clone() for k, v in layout.unflatten(buffers).items()}
        return loss_fn(torch.func.functional_call(model, params, (x,)), y)

    for x, y in data:
        grads = torch.func.grad(loss_of)(flat, x, y)
        updates, state = fused.update(grads, state, flat)
        flat = fb.apply_updates(flat, updates)
    return layout.unflatten(flat), state, layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("alias, torch_cls, kind, kwargs", CASES)
def test_fused_equals_unfused(alias, torch_cls, kind, kwargs, dtype):
    data = batches(STEPS, dtype)
    expected, _ = run_functional(alias(**kwargs), kind, dtype, data)
    actual, state, layout = run_fused(alias(**kwargs), kind, dtype, data)
    assert layout.keys == [at(str(dtype).removeprefix("torch."))]
    # Adafactor's factored moments are row and column means of each segment: on CUDA a reduction
    # over a view into the buffer and over the tensor alone round differently in the last bits
    tol = reduction_tolerance(dtype) if alias is fb.adafactor else EXACT
    for name in expected:
        assert actual[name].dtype == expected[name].dtype
        torch.testing.assert_close(actual[name], expected[name], **tol, msg=lambda m: f"{name}: {m}")


def _mixed_params():
    gen = seeded(0)
    return {
        "emb": torch.randn(6, 4, generator=gen).bfloat16(),
        "w": torch.randn(4, 3, generator=gen, dtype=torch.float64),
        "b": torch.randn(3, generator=gen, dtype=torch.float64),
        "v": torch.randn(3, 5, generator=gen, dtype=torch.float64),
        "s": torch.randn((), generator=gen, dtype=torch.float64),
    }


BEYOND_TORCH = {
    "lamb": lambda: fb.lamb(lr=1e-2, weight_decay=0.1),
    "lars": lambda: fb.lars(lr=0.1, weight_decay=0.01, nesterov=True),
    "lion": lambda: fb.lion(lr=1e-2, weight_decay=0.1),
    "adabelief": lambda: fb.adabelief(lr=1e-2),
    "multi_steps+ema": lambda: fb.multi_steps(fb.chain(fb.adamw(1e-2), fb.ema(0.9)), 2),
    "lookahead": lambda: fb.lookahead(fb.sgd(0.1, momentum=0.9), sync_period=2),
    "apply_if_finite": lambda: fb.apply_if_finite(fb.adam(1e-2), 2),
}


def _train_both(tx_fn, params, steps=5, dtype_of_grads=None, max_buffer_mb=None):
    """The same random gradients through ``tx`` unfused and fused; both final params trees."""
    gen = seeded(1)
    layout = fb.FlatLayout.of(params, max_buffer_mb=max_buffer_mb)
    tx, fused = tx_fn(), fb.fuse(tx_fn(), layout)
    plain, flat = params, layout.flatten(params)
    state, fused_state = tx.init(plain), fused.init(flat)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()}
        updates, state = tx.update(grads, state, plain)
        plain = fb.apply_updates(plain, updates)
        updates, fused_state = fused.update(layout.flatten(grads), fused_state, flat)
        flat = fb.apply_updates(flat, updates)
    return plain, layout.unflatten(flat)


@pytest.mark.parametrize("make", BEYOND_TORCH.values(), ids=BEYOND_TORCH.keys())
def test_fused_equals_unfused_beyond_torch_and_for_wrappers_with_mixed_dtypes(make):
    expected, actual = _train_both(make, _mixed_params())
    for name in expected:
        assert actual[name].dtype == expected[name].dtype
        torch.testing.assert_close(actual[name], expected[name], **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("make", BEYOND_TORCH.values(), ids=BEYOND_TORCH.keys())
def test_fused_over_capped_buffers_equals_unfused(make):
    """With ``max_buffer_mb`` each dtype's tensors spread over several flat buffers; the fused
    update is still the unfused one."""
    params = _mixed_params()
    cap_mb = 20 * 8 / 2**20  # 20 float64 elements
    layout = fb.FlatLayout.of(params, max_buffer_mb=cap_mb)
    assert len(layout.keys) > len(fb.FlatLayout.of(params).keys)
    expected, actual = _train_both(make, params, max_buffer_mb=cap_mb)
    for name in expected:  # LAMB's and LARS's per-tensor norms: exact on the CPU (devices.py)
        tol = reduction_tolerance(expected[name].dtype)
        assert actual[name].dtype == expected[name].dtype
        torch.testing.assert_close(actual[name], expected[name], **tol, msg=lambda m: f"{name}: {m}")


def test_capped_layout_keeps_each_buffer_under_the_cap_and_round_trips():
    """Buffers of one dtype fill in leaf order up to the cap, a tensor larger than the cap alone;
    flatten and unflatten round-trip; the keys name dtype, device and part."""
    params = {n: torch.randn(k) for n, k in (("a", 10), ("b", 30), ("c", 5), ("d", 100), ("e", 1))}
    params["h"] = torch.randn(7, dtype=torch.float64)
    layout = fb.FlatLayout.of(params, max_buffer_mb=40 * 4 / 2**20)  # 40 float32 elements
    sizes = {key: [s.name for s in layout.segments(key)] for key in layout.keys}
    assert sizes == {
        at("float32"): ["a", "b"],
        at("float32") + "/1": ["c"],
        at("float32") + "/2": ["d"],
        at("float32") + "/3": ["e"],
        at("float64"): ["h"],
    }
    views = layout.unflatten(layout.flatten(params))
    assert all(torch.equal(views[name], p) for name, p in params.items())
    with pytest.raises(ValueError, match="must be positive"):
        fb.FlatLayout.of(params, max_buffer_mb=0)


def test_fused_global_norm_clipping_equals_unfused_up_to_summation_order():
    """A norm over all tensors sums in another order over flat buffers: float tolerance."""
    make = lambda: fb.chain(fb.clip_by_global_norm(0.5), fb.sgd(0.1, momentum=0.9))  # noqa: E731
    expected, actual = _train_both(make, {k: v for k, v in _mixed_params().items() if k != "emb"})
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-14, atol=1e-14)


def test_flat_layout_groups_by_dtype_and_round_trips():
    params = _mixed_params()
    layout = fb.FlatLayout.of(params)
    assert set(layout.keys) == {at("bfloat16"), at("float64")}
    flat = layout.flatten(params)
    assert flat[at("float64")].numel() == 12 + 3 + 15 + 1 and flat[at("bfloat16")].numel() == 24
    views = layout.unflatten(flat)
    for name, p in params.items():
        assert torch.equal(views[name], p) and views[name].dtype == p.dtype
        assert (
            views[name].untyped_storage().data_ptr() == flat[group_key(p.dtype, p.device)].untyped_storage().data_ptr()
        )
    views["w"][0, 0] = 42.0  # a view: writes go to the buffer
    assert 42.0 in flat[at("float64")]


def test_fuse_rejects_trees_that_are_not_the_layouts_flat_buffers():
    params = _mixed_params()
    layout = fb.FlatLayout.of(params)
    fused = fb.fuse(fb.adam(), layout)
    keys = re.escape(f"expected flat buffers with keys {[at('bfloat16'), at('float64')]}")
    with pytest.raises(ValueError, match=keys):
        fused.init(params)
    flat = layout.flatten(params)
    bad = dict(flat, **{at("float64"): flat[at("float64")][:-1]})
    with pytest.raises(
        ValueError, match=re.escape(f"flat buffer '{at('float64')}' should be (31,) torch.float64, got (30,)")
    ):
        fused.update(bad, fused.init(flat), flat)


def test_name_routing_wrappers_refuse_to_run_fused():
    params = _mixed_params()
    layout = fb.FlatLayout.of(params)
    for tx in (
        fb.masked(fb.add_decayed_weights(0.1), lambda p: {k: True for k in p}),
        fb.partition({"a": fb.sgd()}, lambda p: {k: "a" for k in p}),
    ):
        with pytest.raises(NotImplementedError, match="cannot run inside fuse"):
            fb.fuse(tx, layout).init(layout.flatten(params))


def test_fused_muon_checks_each_tensor_shape():
    layout = fb.FlatLayout.of({"w": torch.zeros(3, 4), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters .* torch.Size\(\[4\]\) \('b'\)"):
        fb.fuse(fb.muon(), layout).init(layout.zeros())


def test_flatten_module_puts_params_and_grads_in_flat_buffers():
    model, reference = make_model("shapes", torch.float32), make_model("shapes", torch.float32)
    parameters = list(model.parameters())
    flat = fb.flatten_module(model)
    assert list(model.parameters()) == parameters  # same Parameter objects
    x, y = batches(1, torch.float32)[0]
    for _ in range(2):  # the second backward accumulates into the same views
        loss_fn(model(x), y).backward()
        loss_fn(reference(x), y).backward()
    flat.check(model)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    grads = flat.layout.unflatten(flat.grads)
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    flat.zero_grad()
    assert not any(g.any() for g in flat.grads.values())
    # a torch optimizer on the module steps the flat buffer through the views
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    flat.check(model)
    model.zero_grad()  # set_to_none drops the views: check() says so
    with pytest.raises(RuntimeError, match="no longer a view of its flat buffer"):
        flat.check(model)


def test_a_flattened_module_is_freed_when_dropped():
    """Its gradient hooks live where the garbage collector cannot see them; they must not hold the module."""
    import gc
    import weakref

    model = make_model("shapes", torch.float32)
    fb.flatten_module(model)
    x, y = batches(1, torch.float32)[0]
    loss_fn(model(x), y).backward()
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_flatten_parameters_moves_a_list_into_one_buffer_per_dtype_in_list_order():
    gen = seeded(0)
    shapes = [(3, 2), (4,), (2, 2), (5,), (1, 3)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float32, torch.float64]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=d)) for s, d in zip(shapes, dtypes)]
    values = [p.detach().clone() for p in params]
    ids = list(map(id, params))
    layout, buffers = fb.flatten_parameters(params)
    assert list(map(id, params)) == ids and all(torch.equal(p, v) for p, v in zip(params, values))
    for dtype in (torch.float32, torch.float64):
        buffer = buffers[group_key(dtype, torch.empty(0).device)]
        members = [p for p in params if p.dtype == dtype]
        # back to back in list order, in the buffer's storage
        offset = 0
        for p in members:
            assert p.data_ptr() == buffer.data_ptr() + offset * p.element_size()
            offset += p.numel()
        assert offset == buffer.numel()
        assert torch.equal(buffer, torch.cat([v.reshape(-1) for v in values if v.dtype == dtype]))
    with torch.no_grad():
        params[1].add_(1.0)  # the parameter is a view: the buffer changes with it
    assert torch.equal(buffers[at("float64")][:4], values[1] + 1.0)
    assert layout == fb.FlatLayout.of([v for v in values])


def test_span_views_tensors_that_lie_back_to_back_and_split_like_inverts_it():
    from functional_bagua.flat import span, split_like

    buffer = torch.arange(10.0)
    pieces = [buffer[0:6].view(2, 3), buffer[6:10]]
    flat = span(pieces)
    assert flat is not None and flat.data_ptr() == buffer.data_ptr() and torch.equal(flat, buffer)
    back = split_like(flat, pieces)
    assert [v.shape for v in back] == [p.shape for p in pieces]
    assert all(v.data_ptr() == p.data_ptr() for v, p in zip(back, pieces))
    assert span([buffer[0:3], buffer[4:6]]) is None  # a gap
    assert span([buffer[4:6], buffer[0:4]]) is None  # out of order
    assert span([buffer[0:2], buffer.double()[2:4]]) is None  # another dtype
    assert span([buffer.view(2, 5).t(), buffer[10:]]) is None  # not contiguous
    assert span([buffer[0:5]]).data_ptr() == buffer.data_ptr()


# --- in-place (donated) execution ----------------------------------------------------------------

KERNEL_CASES = {
    "adam-amsgrad-l2": (
        lambda: fb.adam(lr=1e-2, weight_decay=0.1, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True),
    ),
    "adamw": (
        lambda: fb.adamw(lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "adamw-maximize": (
        lambda: fb.adamw(lr=1e-2, maximize=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True, fused=True),
    ),
    "sgd": (
        lambda: fb.sgd(lr=0.1, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01, fused=True),
    ),
    "sgd-momentum": (
        lambda: fb.sgd(lr=0.1, momentum=0.9, dampening=0.2),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2, fused=True),
    ),
    "sgd-nesterov": (
        lambda: fb.sgd(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, maximize=True, fused=True),
    ),
}


def _inplace_run(make_tx, kernel, steps=5, dtype=torch.float32, on_grads=None):
    """Params and state after ``steps`` in-place steps; ``on_grads(flat_grads)`` sees each step's
    gradients first. Checks that the step leaves the gradients as they were."""
    model = make_model("shapes", dtype)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params)
    flat = layout.flatten(params)
    step_ = fb.fuse_inplace(make_tx(), layout, kernel=kernel)
    state = step_.init(flat)

    def loss_of(buffers, x, y):
        return loss_fn(torch.func.functional_call(model, layout.unflatten(buffers), (x,)), y)

    for x, y in batches(steps, dtype):
        grads = torch.func.grad(loss_of)(flat, x, y)
        if on_grads is not None:
            on_grads(grads)
        kept = {k: g.clone() for k, g in grads.items()}
        step_(grads, state, flat)
        assert all(torch.equal(grads[k], kept[k]) for k in grads), "the step wrote into the gradients"
    return layout.unflatten(flat), state


@pytest.mark.parametrize("make_tx, make_torch", KERNEL_CASES.values(), ids=KERNEL_CASES.keys())
def test_torch_kernel_in_place_equals_torch_fused_optimizer(make_tx, make_torch):
    """Bitwise equal to the torch optimizer (fused=True) stepping the same flat buffer; within
    float32 rounding of it stepping the model's separate tensors (the kernel's vectorised body and
    scalar tail round differently, and which elements fall in the tail depends on the split)."""
    start = fb.params_of(make_model("shapes", torch.float32))
    layout = fb.FlatLayout.of(start)
    flat_param = torch.nn.Parameter(layout.flatten(start)[at("float32")])
    flat_opt = make_torch([flat_param])

    def step_flat_reference(grads):
        flat_param.grad = grads[at("float32")].clone()
        flat_opt.step()

    actual, _ = _inplace_run(make_tx, "torch", on_grads=step_flat_reference)
    torch.testing.assert_close(layout.flatten(actual)[at("float32")], flat_param.detach(), **EXACT)

    model = make_model("shapes", torch.float32)
    opt = make_torch(model.parameters())
    for x, y in batches(5, torch.float32):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(actual[name], p.detach(), rtol=2e-5, atol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("make_tx", [v[0] for v in KERNEL_CASES.values()], ids=KERNEL_CASES.keys())
def test_torch_kernel_in_place_is_within_rounding_of_the_pure_update(make_tx):
    expected, expected_state, _ = run_fused(make_tx(), "shapes", torch.float64, batches(5, torch.float64))
    actual, state = _inplace_run(make_tx, "torch", dtype=torch.float64)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fb.state_dict(state), fb.state_dict(expected_state), rtol=1e-12, atol=1e-12)


INPLACE_EAGER = {
    "adamw": lambda: fb.adamw(lr=1e-2, weight_decay=0.1),
    "lamb": lambda: fb.lamb(lr=1e-2, weight_decay=0.1),
    "adafactor": lambda: fb.adafactor(lr=1e-2),
    "sgd-schedule": lambda: fb.sgd(lr=fb.schedules.exponential_decay(0.1, 1, 0.9), momentum=0.9),
}


@pytest.mark.parametrize("make_tx", INPLACE_EAGER.values(), ids=INPLACE_EAGER.keys())
def test_eager_in_place_equals_the_pure_fused_update_bitwise(make_tx):
    expected, expected_state, _ = run_fused(make_tx(), "shapes", torch.float32, batches(5, torch.float32))
    actual, state = _inplace_run(make_tx, "eager")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **EXACT)
    torch.testing.assert_close(fb.state_dict(state), fb.state_dict(expected_state), **EXACT)


@pytest.mark.slow
def test_compiled_in_place_equals_the_pure_fused_update():
    make_tx = INPLACE_EAGER["sgd-schedule"]
    expected, _, _ = run_fused(make_tx(), "shapes", torch.float32, batches(5, torch.float32))
    actual, _ = _inplace_run(make_tx, "compiled")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6)


def test_torch_kernel_finds_the_moments_wherever_the_chain_keeps_them():
    """The kernel read the moments at a position fixed when the alias was written; a chain that
    keeps them elsewhere (here wrapped in one more chain, behind a stateful transform) is stepped
    the same, and a tagged chain with no moments, or two, says so."""
    from functional_bagua import kernels

    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    def reordered():
        inner = fb.chain(fb.scale_by_adam(), fb.add_decayed_weights(0.1), fb.scale_by_learning_rate(1e-2))
        return kernels.tag(fb.chain(fb.scale_by_schedule(fb.schedules.constant(1.0)), inner), "adamw", **hyper)

    expected, _ = _inplace_run(lambda: fb.adamw(lr=1e-2, weight_decay=0.1), "torch", dtype=torch.float64)
    actual, state = _inplace_run(reordered, "torch", dtype=torch.float64)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **EXACT)
    assert int(state[1][0].count[at("float64")]) == 5  # the moments it found, and stepped
    layout = fb.FlatLayout.of({"w": torch.zeros(3)})
    flat = layout.flatten({"w": torch.zeros(3)})
    for tx, says in (
        (kernels.tag(fb.chain(fb.scale(1.0)), "adam", **hyper), "holds no ScaleByAdamState"),
        (kernels.tag(fb.chain(fb.scale_by_adam(), fb.scale_by_adam()), "adam", **hyper), "holds 2 ScaleByAdamStates"),
    ):
        with pytest.raises(ValueError, match=says):
            fb.fuse_inplace(tx, layout, kernel="torch")(flat, fb.fuse(tx, layout).init(flat), flat)


@pytest.mark.parametrize("kernel", ["torch", "eager", "auto"])
def test_fuse_inplace_initialises_the_state_fuse_would(kernel):
    params = fb.params_of(make_model("shapes", torch.float32))
    layout = fb.FlatLayout.of(params)
    flat = layout.flatten(params)
    tx = fb.adamw(1e-2, weight_decay=0.1)
    expected, actual = fb.fuse(tx, layout).init(flat), fb.fuse_inplace(tx, layout, kernel=kernel).init(flat)
    assert fb.tree.flatten(actual)[1] == fb.tree.flatten(expected)[1]
    torch.testing.assert_close(fb.state_dict(actual), fb.state_dict(expected), rtol=0, atol=0)


def test_fuse_inplace_rejects_unknown_kernels():
    layout = fb.FlatLayout.of({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="torch has a fused kernel only for sgd, adam and adamw"):
        fb.fuse_inplace(fb.lamb(), layout, kernel="torch")
    with pytest.raises(ValueError, match="kernel must be one of"):
        fb.fuse_inplace(fb.adamw(), layout, kernel="triton")


def test_flat_layout_of_a_nested_tree_round_trips():
    params = {
        "enc": {"w": torch.randn(3, 2), "b": torch.zeros(2)},
        "heads": [torch.ones(4), torch.arange(6.0).view(2, 3)],
    }
    layout = fb.FlatLayout.of(params)
    back = layout.unflatten(layout.flatten(params))
    assert back["heads"][1].shape == (2, 3) and torch.equal(back["heads"][1], params["heads"][1])
    assert torch.equal(back["enc"]["w"], params["enc"]["w"])
    assert [s.name for s in layout.segments(at("float32"))] == ["enc/b", "enc/w", "heads/0", "heads/1"]


KERNEL_ALIASES = {name: make_tx for name, (make_tx, _) in KERNEL_CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("make_tx", KERNEL_ALIASES.values(), ids=KERNEL_ALIASES.keys())
def test_compiled_in_place_of_a_kernel_alias_is_within_rounding_of_torchs_kernel(make_tx):
    """kernel="compiled" for sgd/adam/adamw: inductor's kernels (not torch's fused one) write the
    update into the buffers; parameters and state within float32 rounding of kernel="torch"."""
    expected, expected_state = _inplace_run(make_tx, "torch")
    actual, state = _inplace_run(make_tx, "compiled")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6)
    # the momentum buffers sum gradients of parameters that differ in the last bits: where they
    # nearly cancel, an absolute difference of a few float32 steps of the gradients' size
    torch.testing.assert_close(fb.state_dict(state), fb.state_dict(expected_state), rtol=1e-4, atol=1e-5)
