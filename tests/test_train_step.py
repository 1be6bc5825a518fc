"""make_train_step: eager and compiled, plain and fused, against torch.optim on the module."""

from __future__ import annotations

import pytest
import torch
from devices import seeded
from models import batches, default_dtype, loss_fn, make_model
from torch._dynamo.testing import CompileCounter

import functional_bagua as fb
import functional_bagua.distributed as fbd

DTYPE = torch.float64
STEPS = 6


def train_torch(kind="norm"):
    model = make_model(kind, DTYPE)
    with default_dtype(DTYPE):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for x, y in batches(STEPS, DTYPE):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return model, losses


def train_step_fn(compile, fused=False, tx=None, kind="norm", max_buffer_mb=None):
    model = make_model(kind, DTYPE)
    tx = tx or fb.adamw(lr=1e-2, weight_decay=0.1)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params, max_buffer_mb=max_buffer_mb) if fused else None
    if fused:
        params = layout.flatten(params)
    state = (fb.fuse(tx, layout) if fused else tx).init(params)
    step = fb.make_train_step(model, loss_fn, tx, compile=compile, layout=layout)
    losses = []
    for batch in batches(STEPS, DTYPE):
        params, state, loss = step(params, state, batch)
        losses.append(loss.item())
    return model, (layout.unflatten(params) if fused else params), losses, state


def trained_with_torch_fused_adamw(kind):
    """The ``kind`` model after STEPS steps of torch.optim.AdamW(fused=True) on the test batches."""
    reference = make_model(kind, DTYPE)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for x, y in batches(STEPS, DTYPE):
        opt.zero_grad()
        loss_fn(reference(x), y).backward()
        opt.step()
    return reference


def assert_model_matches(model, params, reference, tol=1e-12):
    for name, p in reference.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    for name, b in reference.named_buffers():  # running statistics came back into the module
        torch.testing.assert_close(
            dict(model.named_buffers())[name], b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("fused", [False, True], ids=["tree", "fused"])
def test_eager_train_step_equals_torch_optim_with_batchnorm_buffers(fused):
    reference, ref_losses = train_torch()
    model, params, losses, _ = train_step_fn(compile=False, fused=fused)
    assert_model_matches(model, params, reference)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    assert dict(model.named_buffers())["norm.num_batches_tracked"].item() == STEPS


@pytest.mark.slow
def test_compiled_train_step_with_a_schedule_compiles_once_and_equals_torch():
    counter = CompileCounter()
    schedule = fb.schedules.warmup_cosine_decay(0.0, 1e-2, 2, STEPS)
    reference = make_model("norm", DTYPE)
    with default_dtype(DTYPE):
        opt = torch.optim.AdamW(reference.parameters(), lr=1.0, weight_decay=0.1)
        for t, (x, y) in enumerate(batches(STEPS, DTYPE)):
            opt.param_groups[0]["lr"] = schedule(t).item()
            opt.zero_grad()
            loss_fn(reference(x), y).backward()
            opt.step()
    model, params, _, state = train_step_fn(
        compile={"backend": counter}, fused=True, tx=fb.adamw(lr=schedule, weight_decay=0.1)
    )
    assert counter.frame_count == 1
    assert state.hyperparams["lr"].item() == pytest.approx(schedule(STEPS - 1).item())
    assert_model_matches(model, params, reference)


@pytest.mark.slow
def test_inductor_compiled_train_step_equals_eager():
    torch._dynamo.reset()
    model, params, losses, _ = train_step_fn(compile=True, kind="shapes")
    eager_model, eager_params, eager_losses, _ = train_step_fn(compile=False, kind="shapes")
    for name in eager_params:
        torch.testing.assert_close(params[name], eager_params[name], rtol=1e-9, atol=1e-9)
    assert losses == pytest.approx(eager_losses, rel=1e-9)


@pytest.mark.slow
def test_compiled_flat_train_step_updates_with_torchs_fused_kernel():
    """make_train_step(compile=True) on flat buffers with adamw: the graph calls torch's fused
    AdamW (functional form) and the run is torch.optim.AdamW(fused=True)'s on the module."""
    ops = []

    def recording(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    model, params, losses, _ = train_step_fn(compile={"backend": recording}, fused=True, kind="shapes")
    assert "aten._fused_adamw" in ops, sorted(set(ops))
    reference = trained_with_torch_fused_adamw("shapes")
    assert_model_matches(model, params, reference)


@pytest.mark.parametrize("fused", [False, True], ids=["tree", "flat"])
def test_eager_train_step_updates_with_torchs_fused_kernel_bitwise(fused, monkeypatch):
    """Eager, adamw: the step runs torch's fused kernel (functional form), so the run is
    torch.optim.AdamW(fused=True)'s on the module: bit for bit on the parameter dict; on flat
    buffers within an ulp (the kernel's vector lanes meet the elements at other offsets)."""
    from functional_bagua import kernels

    calls = []
    original = kernels.run_pure
    monkeypatch.setattr(kernels, "run_pure", lambda *args: calls.append(1) or original(*args))
    model, params, _, _ = train_step_fn(compile=False, fused=fused)
    assert len(calls) == STEPS
    reference = trained_with_torch_fused_adamw("norm")
    assert_model_matches(model, params, reference, tol=1e-15 if fused else 0)


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: fb.adamw(1e-2, weight_decay=0.1),
        lambda: fb.adam(1e-2, amsgrad=True),
        lambda: fb.sgd(0.1, momentum=0.9, nesterov=True),
        lambda: fb.sgd(0.1),
    ],
    ids=["adamw", "adam_amsgrad", "sgd_nesterov", "sgd"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["tree", "flat"])
def test_donated_eager_step_runs_in_place_with_the_same_bits(make_tx, fused):
    """donate=True: the eager step overwrites the parameters and state it is given (the same
    tensors come back) and its numbers are the functional kernel's, bit for bit, every step."""
    runs = {}
    for donate in (False, True):
        model = make_model("norm", DTYPE)
        tx = make_tx()
        params = fb.params_of(model)
        layout = fb.FlatLayout.of(params) if fused else None
        if fused:
            params = layout.flatten(params)
        state = (fb.fuse(tx, layout) if fused else tx).init(params)
        step = fb.make_train_step(model, loss_fn, tx, compile=False, layout=layout, donate=donate)
        trace = []
        for batch in batches(STEPS, DTYPE):
            given = {k: v.data_ptr() for k, v in params.items()}
            params, state, loss = step(params, state, batch)
            trace.append(({k: v.clone() for k, v in params.items()}, loss))
            assert ({k: v.data_ptr() for k, v in params.items()} == given) == donate
        runs[donate] = trace
    for (p1, l1), (p2, l2) in zip(runs[True], runs[False]):
        assert torch.equal(l1, l2)
        for name in p2:
            assert torch.equal(p1[name], p2[name]), name


def _run_step(make_tx, fused, steps=STEPS, **options):
    """Parameters after each step, the losses, and whether every step returned the tensors it was given."""
    model = make_model("norm", DTYPE)
    tx = make_tx()
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params) if fused else None
    if fused:
        params = layout.flatten(params)
    state = (fb.fuse(tx, layout) if fused else tx).init(params)
    step = fb.make_train_step(model, loss_fn, tx, layout=layout, **options)
    trace, in_place = [], True
    for batch in batches(steps, DTYPE):
        given = {k: v.data_ptr() for k, v in params.items()}
        state_given = [t.data_ptr() for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor)]
        params, state, loss = step(params, state, batch)
        in_place &= given == {k: v.data_ptr() for k, v in params.items()}
        in_place &= state_given == [t.data_ptr() for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor)]
        trace.append(({k: v.clone() for k, v in params.items()}, loss))
    return trace, in_place


DONATED_ANY_TX = {
    "lion": lambda: fb.lion(1e-3, weight_decay=0.1),
    "adamw-cosine": lambda: fb.adamw(lr=fb.schedules.warmup_cosine_decay(0.0, 1e-2, 2, 10)),
    "adopt": lambda: fb.adopt(1e-2, weight_decay=0.1, decouple=True),  # its state computed in the given
}


@pytest.mark.parametrize("make_tx", DONATED_ANY_TX.values(), ids=DONATED_ANY_TX.keys())
def test_donated_eager_step_of_any_transform_writes_into_what_it_is_given(make_tx):
    """Without torch's kernel (no alias of it, or a schedule) the donated step computes the new
    state in the state it was given where the rules can (ownership module), and copies the rest
    and the parameters in: the pure step's numbers, bit for bit."""
    pure, moved = _run_step(make_tx, False, compile=False)
    donated, in_place = _run_step(make_tx, False, compile=False, donate=True)
    assert in_place and not moved
    for (p1, l1), (p2, l2) in zip(donated, pure):
        assert torch.equal(l1, l2)
        for name in p2:
            assert torch.equal(p1[name], p2[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["tree", "flat"])
def test_donated_compiled_step_writes_into_what_it_is_given(fused):
    """compile=True, donate=True: the graph stores its results into the given parameters and
    state; the compiled pure step's numbers (on flat buffers that one calls torch's kernel, the
    donated one inductor's: within float64 rounding)."""
    make_tx = lambda: fb.adamw(1e-2, weight_decay=0.1)  # noqa: E731
    pure, moved = _run_step(make_tx, fused, compile=True)
    donated, in_place = _run_step(make_tx, fused, compile=True, donate=True)
    assert in_place and not moved
    for (p1, l1), (p2, l2) in zip(donated, pure):
        torch.testing.assert_close(l1, l2, rtol=1e-13, atol=0)
        for name in p2:
            torch.testing.assert_close(p1[name], p2[name], rtol=1e-13, atol=1e-15, msg=lambda m: f"{name}: {m}")


def test_cuda_graph_refuses_what_it_cannot_capture():
    model = make_model("norm", DTYPE)
    with pytest.raises(ValueError, match="graph_warmup must be at least 1"):
        fb.make_train_step(model, loss_fn, fb.adamw(), cuda_graph=True, graph_warmup=0)
    with pytest.raises(ValueError, match="does not capture a distributed tx"):
        fb.make_train_step(model, loss_fn, fb.chain(fbd.allreduce_gradients(), fb.adamw()), cuda_graph=True)
    if torch.get_default_device().type == "cpu":
        step = fb.make_train_step(model, loss_fn, fb.adamw(), compile=False, cuda_graph=True)
        params = fb.params_of(model)
        with pytest.raises(ValueError, match="needs parameters on a CUDA device"):
            step(params, fb.adamw().init(params), batches(1, DTYPE)[0])


def test_eager_train_step_over_capped_flat_buffers_equals_torch_optim():
    """A layout cut into buffers of at most 64 float64 elements: the step (torch's fused kernel
    over every buffer) is torch.optim.AdamW(fused=True)'s on the module, within an ulp."""
    model, params, _, _ = train_step_fn(compile=False, fused=True, max_buffer_mb=64 * 8 / 2**20)
    assert len(fb.FlatLayout.of(fb.params_of(make_model("norm", DTYPE)), max_buffer_mb=64 * 8 / 2**20).keys) > 1
    reference = trained_with_torch_fused_adamw("norm")
    assert_model_matches(model, params, reference, tol=1e-15)


def test_a_dozen_compiled_steps_of_different_configurations_in_one_process():
    """Each built step compiles on its own (functional_bagua.compiling): before, all shared one
    code object, and the ninth failed with dynamo's FailOnRecompileLimitHit. Reference: the same
    steps eager."""
    makers = [fb.adamw, lambda lr: fb.sgd(lr, momentum=0.9), fb.lion, fb.adam, fb.rmsprop, fb.adagrad]
    for i in range(12):
        results = []
        for compile in ({"backend": "eager"}, False):
            torch.manual_seed(i)
            model = torch.nn.Sequential(torch.nn.Linear(3, 2 + i), torch.nn.Tanh(), torch.nn.Linear(2 + i, 1)).double()
            tx = makers[i % len(makers)](1e-2)
            params = fb.params_of(model)
            layout = fb.FlatLayout.of(params) if i % 2 else None
            if layout is not None:
                params = layout.flatten(params)
            state = (fb.fuse(tx, layout) if layout is not None else tx).init(params)
            step = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, layout=layout, compile=compile)
            gen = seeded(i)
            for _ in range(2):
                batch = (torch.randn(4, 3, generator=gen).double(), torch.randn(4, 1, generator=gen).double())
                params, state, loss = step(params, state, batch)
            results.append(params)
        for name in results[1]:
            torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-12, atol=1e-14)


def test_own_code_gives_each_copy_a_code_object_and_the_same_behaviour():
    from functional_bagua.compiling import own_code

    def scaled(x, *, by=2):
        return x * by

    a, b = own_code(scaled), own_code(scaled)
    assert a.__code__ is not b.__code__ and a.__code__ is not scaled.__code__
    assert a(3) == b(3) == scaled(3) == 6 and a(3, by=4) == 12


def test_parameters_given_for_the_model_are_refused_when_the_step_is_built():
    model = make_model("norm", DTYPE)
    with pytest.raises(TypeError, match="model must be the torch.nn.Module whose forward the step runs, got generator"):
        fb.make_train_step(model.parameters(), loss_fn, fb.adamw())
