"""Wrong input works as torch would or fails loudly, naming the fix: never a broadcast, a truncation,
a silently dropped write or a key shared by two tensors. Each case was a silent wrong result once."""

from __future__ import annotations

import math
import re

import pytest
import torch
from devices import ON_CUDA, at, seeded
from helpers import ALL_ALIASES
from models import batches, loss_fn, make_model
from torch.overrides import TorchFunctionMode

import functional_bagua as fb
from functional_bagua import schedules as S

# --- gradients and updates that do not fit their parameter --------------------------------------------

STATELESS_CHAINS = {
    "sgd(0.1)": lambda: fb.sgd(0.1),
    "scale": lambda: fb.chain(fb.scale(-0.1)),
    "decay+scale": lambda: fb.chain(fb.add_decayed_weights(0.1), fb.scale(-0.1)),
    "clip+lr": lambda: fb.chain(fb.clip(1.0), fb.scale_by_learning_rate(0.1)),
}
EVERY_TX = {**STATELESS_CHAINS, **{a.__name__: a for a in ALL_ALIASES}}
W = torch.randn(4, 8)
WRONG_GRADIENTS = {
    "row (8,)": (lambda: torch.ones(8), ValueError, r"gradient of 'w' has shape \(8,\), parameter has \(4, 8\)"),
    "column (4, 1)": (
        lambda: torch.ones(4, 1),
        ValueError,
        r"gradient of 'w' has shape \(4, 1\), parameter has \(4, 8\)",
    ),
    "int64": (
        lambda: torch.ones(4, 8, dtype=torch.int64),
        TypeError,
        r"gradient of 'w' is torch.int64, parameter is torch.float32",
    ),
    "float64": (
        lambda: torch.ones(4, 8, dtype=torch.float64),
        TypeError,
        r"gradient of 'w' is torch.float64, parameter is torch.float32",
    ),
    "sparse coo": (
        lambda: torch.ones(4, 8).to_sparse(),
        TypeError,
        r"gradient of 'w' is sparse coo; sparse gradients are not supported",
    ),
    "sparse csr": (
        lambda: torch.ones(4, 8).to_sparse_csr(),
        TypeError,
        r"gradient of 'w' is sparse csr; sparse gradients are not supported",
    ),
}


@pytest.mark.parametrize("wrong", list(WRONG_GRADIENTS))
@pytest.mark.parametrize("name", list(EVERY_TX))
def test_a_gradient_that_does_not_fit_its_parameter_is_refused_by_every_optimizer(name, wrong):
    """A (8,) or (4, 1) gradient for a (4, 8) parameter used to be broadcast by the stateless
    chains (every row got the same update); integer, other-dtype and sparse gradients went through."""
    make_grad, error, message = WRONG_GRADIENTS[wrong]
    params = {"w": W.clone(), "b": torch.zeros(4, 8)}
    tx = EVERY_TX[name]()
    state = tx.init(params)
    with pytest.raises(error, match=message):
        updates, _ = tx.update({"w": make_grad(), "b": torch.ones(4, 8)}, state, params)
        fb.apply_updates(params, updates)


@pytest.mark.parametrize("wrong", ["row (8,)", "column (4, 1)"])
def test_without_params_a_wrong_shape_is_refused_by_apply_updates(wrong):
    """Without params an update cannot tell the gradient's shape is wrong; apply_updates can."""
    make_grad, error, _ = WRONG_GRADIENTS[wrong]
    params = {"w": W.clone()}
    tx = fb.sgd(0.1)
    updates, _ = tx.update({"w": make_grad()}, tx.init(params))
    with pytest.raises(error, match=r"apply_updates: update of 'w' has shape"):
        fb.apply_updates(params, updates)


def test_without_params_integer_and_sparse_gradients_are_refused():
    tx = fb.sgd(0.1)
    state = tx.init({"w": W.clone()})
    with pytest.raises(TypeError, match=r"gradient of 'w' is torch.int64; gradients are floating-point or complex"):
        tx.update({"w": torch.ones(4, 8, dtype=torch.int64)}, state)
    with pytest.raises(TypeError, match=r"gradient of 'w' is sparse coo"):
        tx.update({"w": torch.ones(4, 8).to_sparse()}, state)


@pytest.mark.parametrize("with_params", [True, False])
def test_gradient_accumulation_never_broadcasts_a_gradient(with_params):
    """multi_steps summed a (8,) gradient into a (4, 8) accumulator, every row the same."""
    params = {"w": torch.zeros(4, 8)}
    tx = fb.multi_steps(fb.sgd(0.1), 2)
    with pytest.raises(ValueError, match=r"multi_steps: gradient of 'w' has shape \(8,\), parameter has \(4, 8\)"):
        tx.update({"w": torch.ones(8)}, tx.init(params), *([params] if with_params else []))


def test_apply_updates_never_broadcasts_an_update():
    with pytest.raises(ValueError, match=r"update of 'b' has shape \(3, 4\), parameter has \(4,\)"):
        fb.apply_updates({"b": torch.zeros(4)}, {"b": torch.ones(3, 4)})
    with pytest.raises(TypeError, match=r"update of 'b' is torch.complex64 for a torch.float32 parameter"):
        fb.apply_updates({"b": torch.zeros(4)}, {"b": torch.ones(4, dtype=torch.complex64)})
    with pytest.raises(TypeError, match=r"update of 'b' is torch.int64 for a torch.float32 parameter"):
        fb.apply_updates({"b": torch.zeros(4)}, {"b": torch.ones(4, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"update of 'b' is sparse csr"):
        fb.apply_updates({"b": torch.zeros(2, 2)}, {"b": torch.ones(2, 2).to_sparse_csr()})
    with pytest.raises(ValueError, match=r"update of 'b' has shape \(3, 4\), parameter has \(4,\)"):
        fb.apply_updates({"b": torch.zeros(4)}, {"b": torch.ones(3, 4).to_sparse()})
    # a sparse COO update of the parameter's shape (fb.sparse_adam's) is added to the dense parameter
    out = fb.apply_updates({"b": torch.zeros(4)}, {"b": torch.tensor([0.0, 2.0, 0.0, 1.0]).to_sparse()})
    assert out["b"].layout == torch.strided and out["b"].tolist() == [0.0, 2.0, 0.0, 1.0]
    # a float update of another precision is rounded into the parameter's dtype once (mixed precision)
    out = fb.apply_updates({"b": torch.zeros(4, dtype=torch.bfloat16)}, {"b": torch.full((4,), 1 / 3)})
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], torch.full((4,), 1 / 3).bfloat16())


@pytest.mark.parametrize("alias", ALL_ALIASES, ids=lambda a: a.__name__)
def test_integer_and_non_tensor_parameters_are_refused_at_init(alias):
    """fb.sgd(0.1) on an int64 parameter returned zero updates forever; a float leaf failed with
    an AttributeError about '.device'."""
    with pytest.raises(TypeError, match=r"parameter 'k' is torch.int64; only floating-point and complex parameters"):
        alias().init({"w": torch.zeros(3, 3), "k": torch.zeros(3, 3, dtype=torch.int64)})
    for leaf in (1.0, "x"):
        with pytest.raises(TypeError, match=rf"parameter 'k' is a {type(leaf).__name__}, not a tensor"):
            alias().init({"w": torch.zeros(3, 3), "k": leaf})


def test_a_leaf_that_is_no_tensor_is_named_by_every_init():
    for tx in (fb.scale_by_adam(), fb.scale_by_schedule(S.constant(1.0)), fb.apply_if_finite(fb.sgd(), 1)):
        with pytest.raises(TypeError, match=r"'k' is a float, not a tensor"):
            tx.init({"k": 1.0})


def test_flatten_refuses_a_tree_whose_shapes_differ_from_the_layout():
    """Two leaves with swapped shapes (same sizes) used to fill each other's elements."""
    layout = fb.FlatLayout.of({"a": torch.zeros(2, 3), "b": torch.zeros(3, 2)})
    here = torch.empty(0).device
    with pytest.raises(
        ValueError, match=re.escape(f"leaf 'a' is (3, 2) torch.float32 on {here}, the layout holds (2, 3)")
    ):
        layout.flatten({"a": torch.zeros(3, 2), "b": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"leaf 'a' is \(2, 3\) torch.float64"):
        layout.flatten({"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(3, 2)})


# --- complex parameters, as torch.optim updates them ----------------------------------------------------

COMPLEX_TABLE = [
    (fb.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True)),
    (fb.adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (fb.adamw, torch.optim.AdamW, dict(lr=1e-2)),
    (fb.adamax, torch.optim.Adamax, dict()),
    (fb.nadam, torch.optim.NAdam, dict()),
    (fb.radam, torch.optim.RAdam, dict()),
    (fb.adagrad, torch.optim.Adagrad, dict(lr_decay=0.1)),
    (fb.adadelta, torch.optim.Adadelta, dict(weight_decay=0.1)),
    (fb.rmsprop, torch.optim.RMSprop, dict(centered=True, momentum=0.5)),
    (fb.rprop, torch.optim.Rprop, dict()),
    (fb.asgd, torch.optim.ASGD, dict(t0=2)),
]
# float64: NAdam's and ASGD's scalar factors are computed in another order than torch's (the real
# float64 runs of this data differ from torch by as much, 5e-11); the bug this guards against was 1e-1
COMPLEX_TOL = {torch.complex64: dict(rtol=2e-5, atol=2e-6), torch.complex128: dict(rtol=1e-9, atol=1e-10)}


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=["c64", "c128"])
@pytest.mark.parametrize("alias, torch_cls, kwargs", COMPLEX_TABLE, ids=[a.__name__ for a, _, _ in COMPLEX_TABLE])
def test_complex_parameters_match_torch_optim(alias, torch_cls, kwargs, dtype):
    """torch.optim updates a complex parameter as the pair of its real and imaginary parts; Adam,
    AdamW, RMSprop and Adagrad here used to square the complex gradient (0.1 off after one step)."""
    gen = seeded(0)
    start = torch.randn(5, 3, generator=gen, dtype=dtype)
    grads = [torch.randn(5, 3, generator=gen, dtype=dtype) * 0.1 for _ in range(4)]
    reference = torch.nn.Parameter(start.clone())
    optimizer = torch_cls([reference], **kwargs)
    tx = alias(**kwargs)
    params, real_params = {"w": start.clone()}, {"w": torch.view_as_real(start.clone())}
    state, real_state = tx.init(params), tx.init(real_params)
    for g in grads:
        reference.grad = g.clone()
        optimizer.step()
        updates, state = tx.update({"w": g}, state, params)
        params = fb.apply_updates(params, updates)
        real_updates, real_state = tx.update({"w": torch.view_as_real(g)}, real_state, real_params)
        real_params = fb.apply_updates(real_params, real_updates)
    assert params["w"].dtype == dtype and not torch.equal(params["w"], start)
    torch.testing.assert_close(params["w"], reference.detach(), **COMPLEX_TOL[dtype])
    assert torch.equal(torch.view_as_real(params["w"]), real_params["w"])  # the same math, bit for bit


@pytest.mark.parametrize(
    "alias, torch_cls, kwargs",
    [
        (fb.adamw, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
        (fb.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ],
    ids=["adamw", "sgd"],
)
def test_fuse_inplace_steps_complex_buffers_with_torchs_kernel_on_their_real_views(alias, torch_cls, kwargs):
    """torch's fused kernels refuse complex tensors: kernel="auto" failed inside them."""
    gen = seeded(0)
    params = {
        "w": torch.randn(4, 3, generator=gen, dtype=torch.complex64),
        "b": torch.randn(3, generator=gen, dtype=torch.complex64),
    }
    references = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    optimizer = torch_cls(references.values(), **kwargs)
    layout = fb.FlatLayout.of(params)
    flat = layout.flatten(params)
    tx = alias(**kwargs)
    state = fb.fuse(tx, layout).init(flat)
    step_ = fb.fuse_inplace(tx, layout)  # "auto": torch's kernel
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
        for k, p in references.items():
            p.grad = grads[k].clone()
        optimizer.step()
        step_(layout.flatten(grads), state, flat)
    result = layout.unflatten(flat)
    for k, p in references.items():
        torch.testing.assert_close(result[k], p.detach(), **COMPLEX_TOL[torch.complex64])


@pytest.mark.parametrize("make", [fb.adafactor, fb.lamb, fb.lars, fb.muon], ids=lambda m: m.__name__)
def test_per_tensor_rules_refuse_complex_parameters(make):
    params = {"w": torch.ones(3, 3, dtype=torch.complex64)}
    with pytest.raises(TypeError, match=r"parameter 'w' is torch.complex64; this transform computes per-tensor norms"):
        tx = make()
        tx.update(params, tx.init(params), params)


# --- hyperparameters ---------------------------------------------------------------------------------------

BAD_HYPERPARAMETERS = [
    (lambda: fb.adamw(lr=torch.tensor(-1.0)), "Invalid learning rate"),
    (lambda: fb.adamw(betas=(torch.tensor(1.5), 0.999)), "Invalid beta parameter at index 0"),
    (lambda: fb.sgd(0.1, momentum=torch.tensor(-0.5)), "Invalid momentum value"),
    (lambda: fb.rmsprop(eps=torch.tensor(-1e-8)), "Invalid epsilon value"),
    (lambda: fb.muon(eps=-1e-8), "Invalid epsilon value"),  # torch's Muon takes it: a zero gradient gives NaN
    (lambda: fb.muon(eps=0.0), "Invalid epsilon value"),
    (lambda: fb.clip(-1.0), "clip: max_delta must be a number >= 0"),
    (lambda: fb.clip_by_global_norm(float("nan")), "clip_by_global_norm: max_norm must be a number >= 0"),
    (lambda: fb.clip_by_global_norm(torch.tensor(-1.0)), "clip_by_global_norm: max_norm must be a number >= 0"),
    (lambda: fb.apply_if_finite(fb.sgd(), -1), "max_consecutive_errors must be an int >= 0"),
    (lambda: fb.lookahead(fb.sgd(), alpha=torch.tensor(2.0)), "Invalid alpha"),
    (lambda: fb.ema(torch.tensor(1.5)), "Invalid decay value"),
]


@pytest.mark.parametrize("build, message", BAD_HYPERPARAMETERS)
def test_invalid_hyperparameters_raise_also_as_tensors(build, message):
    """torch.optim raises for lr=tensor(-1.) and betas=(tensor(1.5), ...); so do the aliases."""
    with pytest.raises(ValueError, match=message):
        build()


class _ItemCalls(TorchFunctionMode):
    """Counts the ``.item()`` calls that wait for a device (on a tensor that is not on the CPU) or
    read one of the ``watched`` tensors (a 0-dim CPU tensor computed in the step, read as a
    number for torch's multi-tensor ops, is neither)."""

    def __init__(self, watched=()):
        super().__init__()
        self.count = 0
        self.watched = {id(t) for t in watched}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.item:
            self.count += args[0].device.type != "cpu" or id(args[0]) in self.watched
        return func(*args, **(kwargs or {}))


def test_injected_hyperparameters_are_not_read_back_where_that_waits_for_a_device():
    """Validation of tensors happens when they are given; the tensors inject_hyperparams holds
    were checked at construction. Held on a device they are never read back (``.item()`` would
    wait for it); held on the host, each update reads each once, as the Python number it builds
    the factory with (no wait)."""
    params = {"w": torch.ones(3)}
    tx = fb.inject_hyperparams(fb.adamw)(lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    state = tx.init(params)
    held = [t for t in fb.tree.flatten(state.hyperparams)[0] if isinstance(t, torch.Tensor)]
    with _ItemCalls(watched=held) as calls:
        for _ in range(3):
            _, state = tx.update({"w": torch.ones(3)}, state, params)
            held = [t for t in fb.tree.flatten(state.hyperparams)[0] if isinstance(t, torch.Tensor)]
            calls.watched |= {id(t) for t in held}
    assert calls.count == (0 if ON_CUDA else 3 * len(held))  # lr, b1, b2, weight_decay
    lr = torch.tensor(0.1)
    with _ItemCalls(watched=[lr]) as calls:
        fb.adamw(lr=lr)
    assert calls.count == 1  # a tensor given directly is read once, to validate it


# --- clipping ---------------------------------------------------------------------------------------------


def test_clip_by_global_norm_of_no_gradient_changes_nothing():
    """clip_grad_norm_ of parameters without gradients returns 0 and changes nothing; this raised
    'stack expects a non-empty TensorList'."""
    p = torch.nn.Parameter(torch.ones(3))
    assert torch.nn.utils.clip_grad_norm_([p], 1.0).item() == 0.0
    tx = fb.clip_by_global_norm(1.0)
    updates, _ = tx.update({"a": None, "b": None}, tx.init({"a": torch.ones(3), "b": torch.ones(2)}))
    assert updates == {"a": None, "b": None}
    assert fb.global_norm({"a": None}).item() == 0.0


def test_clip_by_global_norm_of_mixed_dtypes_equals_clip_grad_norm_bitwise():
    """The factor multiplies each gradient in the gradient's precision with one rounding: it was
    rounded to bfloat16 first, and bfloat16 gradients differed from clip_grad_norm_'s."""
    gen = seeded(0)
    grads = {
        "a": torch.randn(100, generator=gen) * 3,
        "b": (torch.randn(50, generator=gen) * 3).bfloat16(),
        "c": torch.randn(7, generator=gen, dtype=torch.float64),
    }
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    tx = fb.clip_by_global_norm(1.0)
    updates, _ = tx.update(grads, tx.init(grads))
    for p, name in zip(params, grads):
        assert updates[name].dtype == p.grad.dtype and torch.equal(updates[name], p.grad), name


# --- schedules ----------------------------------------------------------------------------------------------


def test_one_cycle_with_a_zero_step_phase_raises_instead_of_nan():
    with pytest.raises(ValueError, match="phase 0 of the schedule is zero steps long"):
        S.one_cycle(10, 1.0, pct_start=0.1)
    with pytest.raises(ValueError, match="pct_start must be a float between 0 and 1"):
        S.one_cycle(10, 1.0, pct_start=1.5)


@pytest.mark.parametrize("anneal_strategy", ["cos", "linear"])
def test_one_cycle_holds_its_final_value_after_the_last_step(anneal_strategy):
    """Linear annealing went negative past T (SGD then climbed the gradient) and cosine climbed back."""
    schedule = S.one_cycle(20, 0.5, anneal_strategy=anneal_strategy)
    final = 0.5 / 25.0 / 1e4
    assert schedule(19).item() == pytest.approx(final, rel=1e-12)
    for t in (20, 21, 30, 200):
        assert schedule(t).item() == schedule(19).item(), t


def test_linear_and_polynomial_without_a_transition_hold_the_initial_value():
    """optax holds init_value when transition_steps <= 0; these jumped to end_value after step 0."""
    for schedule in (S.linear(1.0, 0.0, 0), S.polynomial(1.0, 0.0, 2.0, 0), S.linear(1.0, 0.0, -3)):
        assert [schedule(t).item() for t in range(4)] == [1.0] * 4


def test_join_schedules_refuses_boundaries_out_of_order():
    """Out of order, a later schedule silently took over from an earlier boundary."""
    with pytest.raises(ValueError, match=r"boundaries must not decrease, got \[10, 5\]"):
        S.join_schedules([S.constant(1.0), S.constant(2.0), S.constant(3.0)], [10, 5])


def test_warmup_cosine_decay_needs_decay_steps_beyond_the_warmup():
    """With decay_steps <= warmup_steps it silently decayed in one step (optax raises)."""
    for decay_steps in (10, 5):
        with pytest.raises(ValueError, match=r"decay_steps \(\d+\) must be greater than warmup_steps \(10\)"):
            S.warmup_cosine_decay(0.0, 1.0, 10, decay_steps)
    schedule = S.warmup_cosine_decay(0.0, 1.0, 10, 11)
    assert schedule(10).item() == 1.0 and schedule(11).item() == 0.0


# --- flat modules and the torch habit of zero_grad() -------------------------------------------------------


def test_flatten_module_keeps_training_after_model_zero_grad():
    """model.zero_grad() sets every .grad to None; backward then wrote fresh tensors, the flat
    gradient buffer stayed zero and a step on it trained nothing."""
    model, reference = make_model("shapes", torch.float64), make_model("shapes", torch.float64)
    flat = fb.flatten_module(model)
    data = batches(4, torch.float64)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, foreach=False)  # add_ per tensor, as below
    for x, y in data:
        model.zero_grad()
        loss_fn(model(x), y).backward()
        flat.check(model)
        with torch.no_grad():  # one SGD step on the flat buffers
            for key in flat.params:
                flat.params[key].add_(flat.grads[key], alpha=-0.1)
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()
        ref_opt.step()
    # on CUDA the model's parameters are views into the flat buffer, at addresses that make cuDNN
    # pick other kernels than for the reference's own tensors: equal to float64 rounding there
    tol = dict(rtol=1e-12, atol=1e-15) if ON_CUDA else dict(rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{name}: {m}")


def test_flatten_module_zeroes_parameters_that_got_no_gradient_after_zero_grad():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
    flat = fb.flatten_module(model)
    x = torch.randn(4, 3)
    model["used"](x).sum().backward()
    model["unused"](x).sum().backward()  # both have gradients in the buffer now
    model.zero_grad()
    model["used"](x).sum().backward()  # only one of them gets a new gradient
    grads = flat.layout.unflatten(flat.grads)
    assert not grads["unused.weight"].any() and not grads["unused.bias"].any()
    assert torch.equal(grads["used.bias"], torch.full((2,), 4.0))
    flat.check(model)


def test_flatten_module_fails_loudly_when_a_parameter_left_its_buffer():
    model = torch.nn.Linear(3, 2)
    fb.flatten_module(model)
    model.weight.data = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match=r"parameter 'weight' no longer views its flat buffer"):
        model(torch.ones(1, 3)).sum().backward()


# --- checkpoints ---------------------------------------------------------------------------------------------

COLLIDING_TREES = {
    "slash in a name": lambda x, y: {"a/b": x, "a": {"b": y}},
    "index vs slash": lambda x, y: {"l": [x], "l/0": y},
}


@pytest.mark.parametrize("name", list(COLLIDING_TREES))
def test_checkpoint_keys_stay_apart_and_restore_each_tensor(name):
    """Names joined with '/' gave 2 keys for 4 tensors, and loading restored the wrong momentum."""
    x, y = torch.zeros(3), torch.zeros(3)
    params = COLLIDING_TREES[name](x, y)
    grads = COLLIDING_TREES[name](torch.ones(3), torch.full((3,), 2.0))
    tx = fb.sgd(0.1, momentum=0.9)
    _, state = tx.update(grads, tx.init(params), params)
    saved = fb.state_dict(state)
    assert len(saved) == 4
    restored = fb.load_state_dict(tx.init(params), saved)
    for a, b in zip(fb.tree.flatten(restored)[0], fb.tree.flatten(state)[0]):
        assert torch.equal(a, b)


def test_checkpoint_keys_that_would_coincide_are_refused():
    state = fb.sgd(0.1, momentum=0.9).init({1: torch.zeros(2), "1": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"would share the key '2/count/1'"):
        fb.state_dict(state)


def test_a_shard_state_refuses_a_checkpoint_of_another_world_size():
    """The rank and world size a shard state records must match on load (another rank's file is
    tested on two ranks in test_distributed.py)."""
    import functional_bagua.distributed as fbd

    def shard_state(rank, world_size):
        return fbd.ShardState(torch.tensor(rank), torch.tensor(world_size), (fb.EmptyState(), {"m": torch.zeros(3)}))

    saved = fb.state_dict(shard_state(0, 4))
    assert set(saved) == {"rank", "world_size", "inner/1/m"}
    with pytest.raises(ValueError, match=r"'world_size' is 4 in the checkpoint, 2 in this state"):
        fb.load_state_dict(shard_state(0, 2), saved)
    restored = fb.load_state_dict(shard_state(0, 4), dict(saved, **{"inner/1/m": torch.ones(3)}))
    assert torch.equal(restored.inner[1]["m"], torch.ones(3))


def test_a_loaded_state_does_not_share_storage_with_the_checkpoint():
    """An in-place step on a loaded state rewrote the checkpoint dict; loading it again resumed at
    the wrong count."""
    params = {"w": torch.randn(10, dtype=torch.float64)}
    layout = fb.FlatLayout.of(params)
    flat = layout.flatten(params)
    tx = fb.adamw(1e-2)
    checkpoint = {k: v.clone() for k, v in fb.state_dict(fb.fuse(tx, layout).init(flat)).items()}
    before = {k: v.clone() for k, v in checkpoint.items()}
    state = fb.load_state_dict(fb.fuse(tx, layout).init(flat), checkpoint)
    fb.fuse_inplace(tx, layout, kernel="eager")({k: torch.ones_like(v) for k, v in flat.items()}, state, flat)
    assert all(torch.equal(checkpoint[k], before[k]) for k in before)


# --- compiled in-place steps ------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_fuse_inplace_writes_back_every_state_tensor():
    """torch 2.13's compiled graphs drop in-place writes to 0-dim float64 inputs: the scheduled lr
    stayed at its step-0 value and NAdam's momentum product at 1, so compiled NAdam diverged from
    eager (2e-2 after 5 steps)."""
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    layout = fb.FlatLayout.of(params)
    tx = fb.nadam(lr=S.linear(1e-2, 1e-3, 10))
    results = {}
    for kernel in ("eager", "compiled"):
        flat = layout.flatten(params)
        state = fb.fuse(tx, layout).init(flat)
        step_ = fb.fuse_inplace(tx, layout, kernel=kernel)
        for i in range(5):
            step_({k: torch.full_like(v, 0.1 * (i + 1)) for k, v in flat.items()}, state, flat)
        results[kernel] = flat, state
    (eager, eager_state), (compiled, compiled_state) = results["eager"], results["compiled"]
    assert compiled_state.hyperparams["lr"].item() == pytest.approx(1e-2 - 9e-3 * 0.4, rel=1e-12)
    for a, b in zip(fb.tree.flatten(compiled_state)[0], fb.tree.flatten(eager_state)[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-15)
    assert math.isfinite(compiled[at("float64")].sum().item())


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: fb.adam(1e-3), "mu"),
        (lambda: fb.adamw(1e-3), "mu"),
        (lambda: fb.sgd(0.1, momentum=0.9), "trace"),
        (lambda: fb.adafactor(), "row_var"),
        (lambda: fb.lion(1e-4), "mu"),
    ],
    ids=["adam", "adamw", "sgd-momentum", "adafactor", "lion"],
)
def test_a_state_made_for_other_shapes_is_refused_naming_the_leaf(make, field):
    """Before, adam's state of shape (1, 3) was broadcast against a (2, 3) parameter and grew to
    (2, 3) without a word; SGD's momentum failed with a bare broadcast error."""
    tx = make()
    state = tx.init({"w": torch.zeros(1, 3)})
    with pytest.raises(ValueError, match=rf"the state's '{field}' for 'w' has shape \(1, (3|1)\).*tx.init\(params\)"):
        tx.update({"w": torch.ones(2, 3)}, state, {"w": torch.zeros(2, 3)})
