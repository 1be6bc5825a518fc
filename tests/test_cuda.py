"""CUDA as a user meets it: the default device stays the CPU and the model is moved to the GPU
(``model.cuda()``), so every tensor the library makes for itself must follow the parameters'
device. (``--device cuda`` runs the rest of the suite with CUDA as the default device.) Each
test compares against torch.optim on the same device, as the CPU tests do; CPU-only CI has no
GPU and skips them."""

from __future__ import annotations

import pytest
import torch
from helpers import ALL_ALIASES, NEWER_FIRST_ORDER, RICH_SETTINGS, problem, tensor_leaves
from models import batches, loss_fn, make_model

import functional_bagua as fb
from functional_bagua import foreach

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def cpu_default_device():
    """The user's setting, also under ``--device cuda``: CPU by default, the model moved."""
    with torch.device("cpu"):
        yield


def cuda_batches(n, dtype=torch.float32):
    return [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches(n, dtype)]


def torch_adamw_run(steps=5, fused=True):
    model = make_model("shapes", torch.float32).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    for x, y in cuda_batches(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


def test_flatten_module_gradients_land_in_the_cuda_buffer():
    reference = make_model("shapes", torch.float32).to(DEVICE)
    model = make_model("shapes", torch.float32).to(DEVICE)
    flat = fb.flatten_module(model)
    assert list(flat.grads) == ["float32@cuda:0"]
    x, y = cuda_batches(1)[0]
    loss_fn(reference(x), y).backward()
    loss_fn(model(x), y).backward()
    grads_in_buffer = flat.layout.unflatten(flat.grads)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads_in_buffer[name], p.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    flat.check(model)


@pytest.mark.parametrize(
    "make_tx",
    [lambda: fb.adamw(1e-2, weight_decay=0.1), lambda: fb.lamb(1e-2, weight_decay=0.1)],
    ids=["adamw", "lamb"],
)
def test_fused_equals_unfused_on_cuda(make_tx):
    model = make_model("shapes", torch.float32).to(DEVICE)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params)
    tx, fused = make_tx(), fb.fuse(make_tx(), layout)
    flat = layout.flatten(params)
    state, flat_state = tx.init(params), fused.init(flat)
    for x, y in cuda_batches(4):
        grads = torch.func.grad(lambda ps: loss_fn(torch.func.functional_call(model, ps, (x,)), y))(params)
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
        flat_updates, flat_state = fused.update(layout.flatten(grads), flat_state, flat)
        flat = fb.apply_updates(flat, flat_updates)
    for name, p in layout.unflatten(flat).items():
        torch.testing.assert_close(p, params[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_torch_kernel_in_place_on_cuda_equals_torch_fused_adamw():
    reference = torch_adamw_run()
    model = make_model("shapes", torch.float32).to(DEVICE)
    flat = fb.flatten_module(model)
    state = fb.fuse(fb.adamw(1e-2, weight_decay=0.1), flat.layout).init(flat.params)
    step_ = fb.fuse_inplace(fb.adamw(1e-2, weight_decay=0.1), flat.layout, kernel="torch")
    for x, y in cuda_batches(5):
        flat.zero_grad()
        loss_fn(model(x), y).backward()
        step_(flat.grads, state, flat.params)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, reference[name], rtol=2e-5, atol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fused", [False, True], ids=["tree", "flat"])
def test_compiled_train_step_on_cuda_equals_torch_adamw(fused):
    reference = torch_adamw_run(fused=False)
    model = make_model("shapes", torch.float32).to(DEVICE)
    tx = fb.adamw(1e-2, weight_decay=0.1)
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params) if fused else None
    if fused:
        params = layout.flatten(params)
    state = (fb.fuse(tx, layout) if fused else tx).init(params)
    step = fb.make_train_step(model, loss_fn, tx, compile=True, layout=layout)
    for batch in cuda_batches(5):
        params, state, _ = step(params, state, batch)
    params = layout.unflatten(params) if fused else params
    for name, p in reference.items():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("impl", ["for-loop", "foreach"])
def test_fuse_step_equals_step_on_cuda(impl):
    """compat.fuse_optimizer on CUDA: one flat view per run (no CPU chunking), the same bits as
    plain step() for an elementwise torch optimizer; 0-dim step tensors stay on the CPU."""
    from functional_bagua.compat import fuse_optimizer

    kwargs = dict(lr=1e-2, weight_decay=0.1, foreach=impl == "foreach")
    reference = make_model("shapes", torch.float32).to(DEVICE)
    model = make_model("shapes", torch.float32).to(DEVICE)
    ref_opt = torch.optim.AdamW(reference.parameters(), **kwargs)
    opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), **kwargs))
    for t, (x, y) in enumerate(cuda_batches(6)):
        for m, o in ((reference, ref_opt), (model, opt)):
            o.zero_grad()
            loss_fn(m(x), y).backward()
        ref_opt.step()
        (opt.fuse_step if t % 2 == 0 else opt.step)()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    assert opt._bagua_fused_count == 3


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_every_alias_keeps_its_state_and_updates_on_the_parameters_device(alias):
    """With the CPU as the default device, nothing the update makes may land there: a CPU state
    tensor would cost a host sync per step or fail to broadcast."""
    params, grads = problem(alias)
    params = {k: v.to(DEVICE) for k, v in params.items()}
    grads = {k: v.to(DEVICE) for k, v in grads.items()}
    tx = alias(**RICH_SETTINGS.get(alias, {}))
    state = tx.init(params)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
    misplaced = [x.device for x in tensor_leaves((state, updates, params)) if x.device.type != "cuda"]
    assert not misplaced, f"{alias.__name__}: {len(misplaced)} tensors on {set(misplaced)}"


TORCH_FUSED = {  # fb alias -> torch class and settings, for the classes torch has a CUDA fused kernel for
    "adamw": (fb.adamw, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (fb.adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "sgd": (fb.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
}


def train_on_cuda(make_optimizer, dtype, steps=5):
    model = make_model("shapes", torch.float32).to(DEVICE, dtype)
    opt = make_optimizer(model.parameters())
    for x, y in cuda_batches(steps, dtype):
        opt.zero_grad()
        loss_fn(model(x).float(), y.float()).backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", TORCH_FUSED)
def test_fb_optimizer_is_torchs_fused_class_on_cuda_and_close_to_its_foreach_default(name, dtype):
    """On CUDA torch.optim defaults to its foreach implementation and has fused kernels for these:
    fb.Optimizer (torch's kernel where one computes the alias) equals fused=True bit for bit, in
    float32 and bfloat16 parameters; the pure update (fused=False) stays within rounding of the
    foreach default."""
    alias, torch_cls, kwargs = TORCH_FUSED[name]
    fused = train_on_cuda(lambda ps: torch_cls(ps, fused=True, **kwargs), dtype)
    ours = train_on_cuda(lambda ps: fb.Optimizer(ps, alias, **kwargs), dtype)
    for key, p in fused.items():
        assert torch.equal(ours[key], p), key
    default = train_on_cuda(lambda ps: torch_cls(ps, **kwargs), dtype)
    pure = train_on_cuda(lambda ps: fb.Optimizer(ps, alias, fused=False, **kwargs), dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for key, p in default.items():
        assert pure[key].dtype == dtype
        torch.testing.assert_close(pure[key], p, **tol, msg=lambda m: f"{key}: {m}")


def cosine(count):
    """A schedule of tensor ops only: a graph replays it with the count in the state."""
    if not isinstance(count, torch.Tensor):  # the alias probes its schedules with a number when built
        count = torch.tensor(float(count))
    count = count.to(torch.float32)  # on the count's device (a CPU tensor could not enter a graph)
    return 1e-2 * 0.5 * (1 + torch.cos(torch.pi * torch.clamp(count / 10, 0.0, 1.0)))


GRAPHED = {
    "adamw": lambda: fb.adamw(1e-2, weight_decay=0.1),  # torch's kernel in place
    "adamw-cosine": lambda: fb.adamw(lr=cosine, weight_decay=0.1),  # the transform, copied in
    "sgd-momentum": lambda: fb.sgd(0.1, momentum=0.9, dampening=0.1),  # its first step decided on the host
    "lion": lambda: fb.lion(1e-3, weight_decay=0.1),
}


def graph_run(make_tx, flat, steps=7, **options):
    """Parameters and loss after each step of a train step on CUDA float32."""
    model = make_model("shapes", torch.float32).to(DEVICE)
    tx = make_tx()
    params = fb.params_of(model)
    layout = fb.FlatLayout.of(params) if flat else None
    if flat:
        params = layout.flatten(params)
    state = (fb.fuse(tx, layout) if flat else tx).init(params)
    step = fb.make_train_step(model, loss_fn, tx, layout=layout, **options)
    trace = []
    for batch in cuda_batches(steps):
        params, state, loss = step(params, state, batch)
        trace.append(({k: v.clone() for k, v in params.items()}, loss))
    return trace


@pytest.mark.parametrize("flat", [False, True], ids=["tree", "flat"])
@pytest.mark.parametrize("make_tx", GRAPHED.values(), ids=GRAPHED.keys())
def test_cuda_graphed_eager_step_replays_the_donated_step_bit_for_bit(make_tx, flat):
    """cuda_graph=True: 2 warm-up steps, the capture, then replays; every step (schedules
    included: the lr comes from the count in the state) equals the donated eager step's."""
    expected = graph_run(make_tx, flat, compile=False, donate=True)
    actual = graph_run(make_tx, flat, compile=False, cuda_graph=True, graph_warmup=2)
    for t, ((p1, l1), (p2, l2)) in enumerate(zip(actual, expected)):
        assert torch.equal(l1, l2), t
        for name in p2:
            assert torch.equal(p1[name], p2[name]), (t, name)


def test_cuda_graphed_compiled_step_replays_the_compiled_donated_step():
    expected = graph_run(GRAPHED["adamw-cosine"], True, compile=True, donate=True)
    actual = graph_run(GRAPHED["adamw-cosine"], True, compile=True, cuda_graph=True, graph_warmup=2)
    for (p1, l1), (p2, l2) in zip(actual, expected):
        torch.testing.assert_close(l1, l2, rtol=1e-6, atol=0)
        for name in p2:
            torch.testing.assert_close(p1[name], p2[name], rtol=1e-6, atol=1e-7)


def test_cuda_graphed_step_refuses_other_buffers_and_shapes():
    model = make_model("shapes", torch.float32).to(DEVICE)
    tx = fb.adamw(1e-2)
    params = fb.params_of(model)
    state = tx.init(params)
    step = fb.make_train_step(model, loss_fn, tx, compile=False, cuda_graph=True, graph_warmup=1)
    (x, y), _ = cuda_batches(2)
    params, state, _ = step(params, state, (x, y))  # warm-up
    params, state, _ = step(params, state, (x, y))  # captured
    with pytest.raises(ValueError, match="replays fixed shapes: batch leaf 0"):
        step(params, state, (x[:-1], y[:-1]))
    with pytest.raises(ValueError, match="pass the ones the previous call returned"):
        step(fb.tree.clone(params), state, (x, y))
    key = next(iter(params))
    original = params[key]
    params[key] = original.clone()  # the same dict, another tensor: the graph would not see it
    with pytest.raises(ValueError, match="change their values in place"):
        step(params, state, (x, y))
    params[key] = original
    params, state, loss = step(params, state, (x, y))
    assert torch.isfinite(loss)


EAGER_FIRST_ORDER = {
    **NEWER_FIRST_ORDER,
    fb.prodigy: dict(weight_decay=0.01),
    fb.dadapt_adam: {},
}
# their distance estimate d is computed from the tensors each step: their scalars stay on the device
KEEP_SCALARS_ON_THE_DEVICE = (fb.prodigy, fb.dadapt_adam)


@pytest.mark.parametrize("alias", list(EAGER_FIRST_ORDER), ids=lambda a: a.__name__)
def test_fb_optimizer_holds_its_scalars_on_the_cpu_and_steps_one_kernel_per_op_on_cuda(alias, monkeypatch):
    """As torch.optim keeps ``step`` on the CPU: fb.Optimizer's step counts and float64 scalars
    live on the CPU where no torch kernel computes the group (its tensors on the GPU; Prodigy's
    and D-Adaptation's stay with their tensors, whose sums give their estimate), so its
    factors reach torch's multi-tensor ops as numbers, and no elementwise op falls back to one
    kernel per tensor; the parameters stay within rounding of the pure update run on the GPU
    with its scalars there (the same numbers, multiplied in another order)."""
    kwargs = EAGER_FIRST_ORDER[alias]
    params, grads = problem(alias)
    shapes = {k: v.shape for k, v in params.items() if v.dim() > 0}  # a 0-dim parameter runs alone
    tensors = {k: torch.nn.Parameter(params[k].to(DEVICE)) for k in shapes}
    opt = fb.Optimizer(list(tensors.values()), alias(**kwargs))
    per_tensor = []
    original = foreach._map
    monkeypatch.setattr(
        foreach,
        "_map",
        lambda fn, args, kw: (
            (
                per_tensor.append(fn)
                if fn in foreach._ELEMENTWISE and any(isinstance(a, foreach.Leaves) and a.items[0].dim() for a in args)
                else None
            )
            or original(fn, args, kw)
        ),
    )
    tx = alias(**kwargs)
    pure = {k: params[k].to(DEVICE) for k in shapes}
    state = tx.init(pure)
    for _ in range(3):
        for k, p in tensors.items():
            p.grad = grads[k].to(DEVICE)
        opt.step()
        updates, state = tx.update({k: grads[k].to(DEVICE) for k in shapes}, state, pure)
        pure = fb.apply_updates(pure, updates)
    if alias is not fb.mars_adamw:  # MARS's first-step choice (torch.where on its count) runs per tensor
        assert not per_tensor, f"{alias.__name__}: elementwise ops one tensor at a time: {per_tensor}"
    saved = opt.state_dict()
    held = [t for entries in saved["state"].values() for t in entries.values()]
    held += list(saved["param_groups"][0]["shared_state"].values())
    assert all(t.device.type == "cuda" for t in held if t.dim() > 0)
    counts = [t for t in held if t.dim() == 0 and not t.is_floating_point()]
    where = "cuda" if alias in KEEP_SCALARS_ON_THE_DEVICE else "cpu"
    assert counts and all(t.device.type == where for t in counts), alias.__name__
    for k, p in tensors.items():
        torch.testing.assert_close(p.detach(), pure[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_0_dim_cpu_factor_of_gpu_tensors_runs_one_multi_tensor_op_with_the_single_tensor_bits(dtype, monkeypatch):
    """A factor computed on the CPU (a bias correction from a count held there) beside tensors on
    the GPU reaches torch's multi-tensor add, sub, mul, div, addcmul and reflected sub as a
    number: one call for the group, each tensor the single-tensor op's bits with the CPU
    scalar."""
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in ((1000,), (4, 5), (3,))]
    others = [torch.randn(t.shape, generator=gen).to(DEVICE, dtype) for t in tensors]
    calls = []
    original = foreach._map
    monkeypatch.setattr(foreach, "_map", lambda *a: calls.append(a[0]) or original(*a))
    leaves, other = foreach.Leaves(tensors), foreach.Leaves(others)
    for value in (1 / 3, 1 - 0.999**7, 2.5e-3):
        b = torch.tensor(value, dtype=torch.float64)
        cases = {
            "add": (leaves + b, [t + b for t in tensors]),
            "sub": (leaves - b, [t - b for t in tensors]),
            "mul": (leaves * b, [t * b for t in tensors]),
            "div": (leaves / b, [t / b for t in tensors]),
            "rsub": (b - leaves, [b - t for t in tensors]),
            "addcmul": (
                leaves.addcmul(other, other, value=b),
                [t.addcmul(o, o, value=b) for t, o in zip(tensors, others)],
            ),
        }
        for name, (got, expected) in cases.items():
            for g, e in zip(got.items, expected):
                assert g.dtype == e.dtype and torch.equal(g, e), (name, value)
    assert not calls, f"one tensor at a time: {calls}"
