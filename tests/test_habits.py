"""Habits of torch.optim and optax users: each works as they expect or fails naming the fix."""

from __future__ import annotations

import importlib.resources
import math
import re
import subprocess
import sys
import warnings

import pytest
import torch
from devices import seeded

import functional_bagua as fb
from functional_bagua import schedules as S


def test_subpackages_are_attributes_imported_when_first_used():
    script = (
        "import sys, functional_bagua as fb\n"
        "assert 'functional_bagua.distributed' not in sys.modules\n"
        "assert 'torch.distributed.nn.functional' not in sys.modules\n"
        "print(fb.distributed.allreduce_gradients.__name__, fb.compat.fuse_optimizer.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["allreduce_gradients", "fuse_optimizer"]
    with pytest.raises(AttributeError, match="has no attribute 'distributd'"):
        fb.distributd  # noqa: B018


def test_the_package_says_it_is_typed():
    assert importlib.resources.files("functional_bagua").joinpath("py.typed").is_file()


# --- what init and update are given -----------------------------------------------------------------


@pytest.mark.parametrize(
    "given, says",
    [
        (lambda m: m, "is a Linear, not a tensor; pass fb.params_of(model), the dict of the module's trainable"),
        (
            lambda m: m.parameters(),
            "is a generator, not a tensor; pass fb.params_of(model), a dict by name, not model.parameters()",
        ),
    ],
)
def test_init_given_a_module_or_its_parameters_names_the_fix(given, says):
    """These gave "'Linear' object has no attribute 'device'"."""
    model = torch.nn.Linear(3, 2)
    for tx in (fb.adamw(), fb.scale_by_adam(), fb.scale_by_schedule(S.constant(1.0))):
        with pytest.raises(TypeError, match=re.escape(says)):
            tx.init(given(model))


def test_a_state_of_another_transform_is_named_as_such():
    """Another transform's state blamed the gradients ("missing from grads: '<root>'")."""
    params = {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match="trace: got a state of type EmptyState, expected TraceState"):
        fb.sgd(0.1, momentum=0.9).update(params, fb.adamw().init(params), params)
    with pytest.raises(ValueError, match="scale_by_adam: got a state of type tuple, expected ScaleByAdamState"):
        fb.scale_by_adam().update(params, fb.adamw().init(params), params)


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x, scale=1.0):
        return self.linear(x) * scale


def test_make_train_step_takes_keyword_inputs_and_names_a_wrong_batch():
    """A dict batch failed inside linear(); inputs may now be a dict of keyword arguments."""
    model = TwoInputs()
    tx = fb.sgd(0.1)
    step = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, compile=False)
    params = fb.params_of(model)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    with pytest.raises(TypeError, match=r"batch is a dict with keys \['x', 'y'\]; pass \(inputs, targets\)"):
        step(params, tx.init(params), {"x": x, "y": y})
    with pytest.raises(TypeError, match="batch is a tuple of 3 items"):
        step(params, tx.init(params), (x, y, 2.0))
    by_keyword, _, loss = step(params, tx.init(params), ({"x": x, "scale": 2.0}, y))
    by_position, _, same_loss = step(params, tx.init(params), ((x, 2.0), y))
    assert loss == same_loss and loss == torch.nn.functional.mse_loss(model(x, 2.0), y)
    assert all(torch.equal(by_keyword[k], by_position[k]) for k in params)


# --- hyperparameters and schedules under torch.compile ----------------------------------------------


def warmup_written_for_lambda_lr(step):
    return 0.1 if step < 3 else 0.01 * math.cos(0.0)


def test_schedules_that_read_the_count_as_a_number_are_found():
    assert S.reads_count_as_number(warmup_written_for_lambda_lr)
    assert S.reads_count_as_number(lambda t: 0.1 * float(t))
    assert not S.reads_count_as_number(lambda t: torch.where(t < 3, 0.1, 0.01))
    for schedule in (
        S.constant(1.0),
        S.linear(1.0, 0.0, 5),
        S.polynomial(1.0, 0.0, 2.0, 5),
        S.cosine_decay(1.0, 5),
        S.exponential_decay(1.0, 2, 0.5, staircase=True, end_value=0.1),
        S.piecewise_constant(1.0, {2: 0.5}),
        S.warmup_cosine_decay(0.0, 1.0, 2, 10),
        S.one_cycle(10, 1.0),
        S.join_schedules([S.constant(1.0)] * 2, [3]),
    ):
        assert not S.reads_count_as_number(schedule)


def test_a_lambda_lr_style_schedule_works_eagerly_as_torchs_lambda_lr():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    optimizer = torch.optim.SGD([p], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_written_for_lambda_lr)
    tx = fb.sgd(lr=warmup_written_for_lambda_lr)
    params = {"p": torch.ones(3, dtype=torch.float64)}
    state = tx.init(params)
    for _ in range(5):
        p.grad = torch.ones(3, dtype=torch.float64)
        optimizer.step()
        scheduler.step()
        updates, state = tx.update({"p": torch.ones(3, dtype=torch.float64)}, state, params)
        params = fb.apply_updates(params, updates)
    torch.testing.assert_close(params["p"], p.detach(), rtol=1e-15, atol=0)


def _compiled_error(fn, *args) -> str:
    with pytest.raises(Exception) as caught:  # dynamo wraps the TypeError raised while tracing
        torch.compile(fn, fullgraph=True)(*args)
    return "\n".join(str(e) for e in (caught.value, caught.value.__cause__) if e is not None)


@pytest.mark.slow
def test_compiled_steps_name_an_untraceable_schedule_and_a_float_assigned_hyperparameter():
    """A LambdaLR-style schedule failed with dynamo's data-dependent error; a float assigned to
    state.hyperparams recompiled every step until the recompile limit."""
    params, grads = {"w": torch.ones(3)}, {"w": torch.ones(3)}
    for tx in (
        fb.adamw(lr=warmup_written_for_lambda_lr),
        fb.chain(fb.scale_by_adam(), fb.scale_by_learning_rate(warmup_written_for_lambda_lr)),
    ):
        message = _compiled_error(tx.update, grads, tx.init(params), params)
        assert "the schedule 'warmup_written_for_lambda_lr'" in message and "torch.where" in message
    tx = fb.inject_hyperparams(fb.adamw)(lr=1e-3)
    state = tx.init(params)
    state.hyperparams["lr"] = 9e-4
    message = _compiled_error(tx.update, grads, state, params)
    assert "state.hyperparams['lr'] holds a float" in message and ".fill_(value)" in message


def test_where_the_library_compiles_an_untraceable_schedule_raises_its_type_error():
    """make_train_step(compile=...) and fuse_inplace(kernel="compiled") raise the library's
    TypeError itself (dynamo reports it as "Observed exception" with the message buried in its
    context); a user's own torch.compile gets dynamo's error, whose message
    functional_bagua.compiling.raised_while_tracing recovers."""
    from functional_bagua.compiling import raised_while_tracing

    model = torch.nn.Linear(3, 1)
    tx = fb.adamw(lr=warmup_written_for_lambda_lr)
    params = fb.params_of(model)
    step = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, compile={"backend": "eager"})
    with pytest.raises(TypeError, match="the schedule 'warmup_written_for_lambda_lr' for the hyperparameter 'lr'"):
        step(params, tx.init(params), (torch.randn(4, 3), torch.randn(4, 1)))
    layout = fb.FlatLayout.of(params)
    flat = layout.flatten(params)
    step_ = fb.fuse_inplace(tx, layout, kernel="compiled")
    with pytest.raises(TypeError, match="uses the step count as a Python number"):
        step_({k: torch.ones_like(v) for k, v in flat.items()}, step_.init(flat), flat)
    with pytest.raises(Exception) as caught:
        torch.compile(tx.update, fullgraph=True, backend="eager")(
            {"weight": torch.ones(1, 3), "bias": torch.ones(1)}, tx.init(params), params
        )
    assert not isinstance(caught.value, TypeError)
    recovered = raised_while_tracing(caught.value)
    assert isinstance(recovered, TypeError) and "warmup_written_for_lambda_lr" in str(recovered)


@pytest.mark.parametrize(
    ("kind", "literal", "message"),
    [
        (
            TypeError,
            "\"the schedule 'w' reads t as a number: torch.where(t < 3, a, b)\"",
            "the schedule 'w' reads t as a number: torch.where(t < 3, a, b)",
        ),
        (ValueError, "'lr must be positive, got \\'-1\\' ([0])'", "lr must be positive, got '-1' ([0])"),
    ],
)
def test_the_error_in_the_debug_context_of_older_torch_is_recovered(kind, literal, message):
    """torch 2.11 (the GPU machine's) reports the traced code's error only inside the debug
    context of its whole message, as a ConstantVariable's repr (this text as it printed it)."""
    from functional_bagua.compiling import raised_while_tracing

    text = (
        "Observed exception\n  Explanation: Dynamo found no exception handler at the top-level compiled function"
        f"\n\n  Developer debug context: raised exception {kind.__name__}([ConstantVariable(str: {literal})])\n\n"
        " For more details about this graph break, please visit: https://meta-pytorch.github.io/..."
    )
    recovered = raised_while_tracing(RuntimeError(text))
    assert type(recovered) is kind and str(recovered) == message


# --- checkpoints across a change of hyperparameters ----------------------------------------------------


def test_a_constant_lr_checkpoint_loads_into_a_scheduled_optimizer():
    """Saved with a constant lr, loaded after switching lr to a schedule: "key 'count' is missing".
    Now the error says what changed, and strict=False loads the optimizer's own state."""
    params, grads = {"w": torch.randn(4, dtype=torch.float64)}, {"w": torch.randn(4, dtype=torch.float64)}
    constant = fb.adamw(1e-2)
    state = constant.init(params)
    for _ in range(3):
        _, state = constant.update(grads, state, params)
    saved = fb.state_dict(state)
    scheduled = fb.adamw(lr=S.constant(1e-2))
    with pytest.raises(
        ValueError,
        match=r"the checkpoint is the state of this optimizer's 'inner_state/' part .* "
        r"key 'count' is missing .* pass strict=False",
    ):
        fb.load_state_dict(scheduled.init(params), saved)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = fb.load_state_dict(scheduled.init(params), saved, strict=False)
    assert len(seen) == 1 and "loaded the rest" in str(seen[0].message)
    assert loaded.count.item() == 0
    for a, b in zip(fb.tree.flatten(loaded.inner_state)[0], fb.tree.flatten(state)[0]):
        assert torch.equal(a, b)
    expected, _ = constant.update(grads, state, params)
    actual, _ = scheduled.update(grads, loaded, params)
    torch.testing.assert_close(actual["w"], expected["w"], rtol=1e-15, atol=0)
    back = fb.load_state_dict(constant.init(params), fb.state_dict(loaded), strict=False)
    assert all(torch.equal(a, b) for a, b in zip(fb.tree.flatten(back)[0], fb.tree.flatten(state)[0]))


def test_one_element_tensor_hyperparameters_of_any_shape_step_as_torchs():
    """torch.optim takes betas as tensors of shape (1, 1, 1) and (1, 1) (its own catalog does);
    the alias takes them too (as 0-dim views), on parameters of fewer dimensions as well.
    Reference: torch.optim.Adam with the same tensors, float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    reference.load_state_dict(model.state_dict())
    betas = (torch.tensor([[[0.8]]], dtype=torch.float64), torch.tensor([[0.95]], dtype=torch.float64))
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2, betas=betas, foreach=False)
    tx = fb.adam(lr=1e-2, betas=betas)
    params = fb.params_of(model)
    state = tx.init(params)
    gen = seeded(1)
    for _ in range(4):
        x, y = (
            torch.randn(5, 3, generator=gen, dtype=torch.float64),
            torch.randn(5, 1, generator=gen, dtype=torch.float64),
        )
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        loss_of = lambda p: torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)  # noqa: E731
        updates, state = tx.update(torch.func.grad(loss_of)(params), state, params)
        params = fb.apply_updates(params, updates)
    for name, p in reference.named_parameters():
        assert params[name].shape == p.shape
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "build, error, says",
    [
        (lambda: fb.adamw(lr="1e-3"), TypeError, r"adamw: lr must be a number.*got str '1e-3'; pass lr=0.001"),
        (lambda: fb.sgd("0.1"), TypeError, r"sgd: lr must be a number.*pass lr=0.1"),
        (lambda: fb.adamw(betas=(0.9,)), ValueError, r"adamw: betas takes 2 values, as its default \(0.9, 0.999\)"),
        (lambda: fb.lion(betas=0.9), ValueError, r"lion: betas takes 2 values"),
        (
            lambda: fb.adam(lr=torch.tensor([1e-3, 2e-3])),
            ValueError,
            r"adam: lr must be one number; got a tensor of shape \(2,\)",
        ),
        (lambda: fb.adam(betas=(0.9, "0.99")), TypeError, r"adam: betas\[1\] must be a number.*pass 0.99"),
        (lambda: fb.rmsprop(alpha=[0.9]), TypeError, r"rmsprop: alpha must be a number.*got list"),
    ],
)
def test_hyperparameters_of_the_wrong_kind_are_refused_when_the_alias_is_built(build, error, says):
    with pytest.raises(error, match=says):
        build()


def test_numpy_numbers_and_arrays_are_hyperparameters_as_in_torch():
    import numpy as np

    params, grads = {"w": torch.ones(3)}, {"w": torch.full((3,), 0.5)}
    expected, _ = fb.adamw(lr=1e-2, betas=(0.8, 0.9)).update(grads, fb.adamw().init(params), params)
    tx = fb.adamw(lr=np.float32(1e-2), betas=np.array([0.8, 0.9]))
    actual, _ = tx.update(grads, tx.init(params), params)
    torch.testing.assert_close(actual["w"], expected["w"])
