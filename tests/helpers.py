"""Shared by the core-contract tests and the test files that run the same checks on every alias
(test_core.py, test_compile.py, test_wrappers.py, test_bad_input.py): the table of every alias
with the non-default settings that switch on their stateful code paths, a small problem
(parameters and gradients) per alias, and helpers that list, clone and compare the tensors of a
pytree bit for bit."""

from __future__ import annotations

import optree
import torch

import functional_bagua as fb

ALL_ALIASES = [
    fb.sgd,
    fb.adam,
    fb.adamw,
    fb.adamax,
    fb.nadam,
    fb.radam,
    fb.adagrad,
    fb.adadelta,
    fb.rmsprop,
    fb.rprop,
    fb.asgd,
    fb.adafactor,
    fb.muon,
    fb.lamb,
    fb.lars,
    fb.lion,
    fb.adabelief,
]
# non-default settings that switch on every code path with state (momentum, amsgrad, centered...)
RICH_SETTINGS = {
    fb.sgd: dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1),
    fb.adam: dict(amsgrad=True, weight_decay=0.1),
    fb.rmsprop: dict(centered=True, momentum=0.9),
    fb.adagrad: dict(lr_decay=0.1),
    fb.lars: dict(nesterov=True, weight_decay=0.1),
    fb.asgd: dict(t0=1, lambd=0.1),
    fb.lion: dict(lr=1e-2),  # 1e-4 steps vanish under bfloat16 rounding
}


# the newer first-order aliases, with their stateful paths on
NEWER_FIRST_ORDER = {
    fb.schedule_free_adamw: dict(lr=1e-2, warmup_steps=2, weight_decay=0.1),
    fb.schedule_free_sgd: dict(lr=1e-2, weight_decay=0.1),
    fb.adopt: dict(lr=1e-2, weight_decay=0.1, decouple=True),
    fb.ademamix: dict(lr=1e-2, t_alpha_beta3=3.0),
    fb.laprop: dict(lr=1e-2, weight_decay=0.1),
    fb.mars_adamw: dict(lr=1e-2),
}


def problem(alias, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)  # the same numbers on every device
    shapes = {"w": (4, 3), "v": (3, 5)} if alias is fb.muon else {"w": (4, 3), "b": (3,), "s": (), "k": (2, 1, 3, 3)}
    draw = lambda s: torch.randn(s, generator=gen, device="cpu").to(dtype).to(torch.get_default_device())  # noqa: E731
    params = {k: draw(s) for k, s in shapes.items()}
    grads = {k: draw(s) for k, s in shapes.items()}
    return params, grads


def tensor_leaves(tree):
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def clone_tree(tree):
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True)


def assert_trees_equal(a, b):
    la, lb = optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def run_updates(tx, params, grads):
    """``params`` after ``tx``'s update on each gradient tree of ``grads`` in turn, and the last state."""
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = fb.apply_updates(params, updates)
    return params, state


def run_steps(tensors, opt, grads):
    """``opt.step()`` once per step of ``grads`` (one gradient per tensor), each step's
    gradients set as copies on ``tensors``' ``.grad`` first."""
    for step in grads:
        for p, g in zip(tensors, step):
            p.grad = g.clone()
        opt.step()


def run_resumed(tx, params, grads, at):
    """``params`` after ``tx``'s updates on ``grads`` as :func:`run_updates`, its state saved
    (``fb.state_dict``, copied) after ``at`` steps and loaded into a new ``init`` to go on; and
    the checkpoint."""
    state = tx.init(params)
    saved = None
    for step, g in enumerate(grads):
        if step == at:
            saved = {k: v.clone() for k, v in fb.state_dict(state).items()}
            state = fb.load_state_dict(tx.init(params), saved)
        updates, state = tx.update(g, state, params)
        params = fb.apply_updates(params, updates)
    return params, saved


def assert_trees_close(got, want, tol=1e-13):
    """Each tensor of ``want`` (a dict) and the same key of ``got`` within ``tol``, relative and absolute."""
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


def errors_of(calls: dict) -> dict:
    """``{name: (exception type name, message)}`` of each call that raised (``None`` if it did not):
    for scenarios that try bad input on a rank and hand the errors back to the test."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # the test reads type and message
            out[name] = (type(e).__name__, str(e))
    return out


# the aliases fb.Optimizer writes into the parameters as their references write them, each with
# its reference: id -> (reference module, class, its keyword arguments, our alias built, or a
# factory and its keyword arguments)
IN_PLACE = {
    "prodigy-decoupled": ("prodigyopt", "Prodigy", dict(weight_decay=0.01), lambda: fb.prodigy(weight_decay=0.01)),
    "prodigy-no-momentum": ("prodigyopt", "Prodigy", dict(betas=(0.0, 0.99)), lambda: fb.prodigy(betas=(0.0, 0.99))),
    "dadapt-adam-decoupled": (
        "dadaptation",
        "DAdaptAdam",
        dict(weight_decay=0.01, decouple=True),
        lambda: fb.dadapt_adam(weight_decay=0.01, decouple=True),
    ),
    "ademamix": ("pytorch_optimizer", "AdEMAMix", dict(lr=1e-2, foreach=False), lambda: fb.ademamix(1e-2)),
    "laprop": ("pytorch_optimizer", "LaProp", dict(lr=1e-2, foreach=False), lambda: fb.laprop(1e-2)),
    "laprop-decayed": (
        "pytorch_optimizer",
        "LaProp",
        dict(lr=1e-2, weight_decay=0.1, foreach=False),
        lambda: fb.laprop(1e-2, weight_decay=0.1),
    ),
    "ademamix-warmup": (
        "pytorch_optimizer",
        "AdEMAMix",
        dict(lr=1e-2, t_alpha_beta3=4, foreach=False),
        lambda: fb.ademamix(1e-2, t_alpha_beta3=4),
    ),
    "ademamix-decoupled": (
        "pytorch_optimizer",
        "AdEMAMix",
        dict(lr=1e-2, weight_decay=0.1, weight_decouple=True, foreach=False),
        lambda: fb.ademamix(1e-2, weight_decay=0.1, weight_decouple=True),
    ),
    "ademamix-decoupled-0": (
        "pytorch_optimizer",
        "AdEMAMix",
        dict(lr=1e-2, weight_decay=0.0, weight_decouple=True, foreach=False),
        lambda: fb.ademamix(1e-2, weight_decay=0.0, weight_decouple=True),
    ),
    "ademamix-decoupled-factory": (
        "pytorch_optimizer",
        "AdEMAMix",
        dict(lr=1e-2, weight_decay=0.1, weight_decouple=True, foreach=False),
        lambda: (fb.ademamix, dict(lr=1e-2, weight_decay=0.1, weight_decouple=True)),
    ),
    "adopt": ("adopt", "ADOPT", dict(lr=1e-2, foreach=False), lambda: fb.adopt(1e-2)),
    "adopt-decoupled": (
        "adopt",
        "ADOPT",
        dict(lr=1e-2, weight_decay=0.1, decouple=True, foreach=False),
        lambda: fb.adopt(1e-2, weight_decay=0.1, decouple=True),
    ),
    "adopt-decoupled-factory": (
        "adopt",
        "ADOPT",
        dict(lr=1e-2, weight_decay=0.1, decouple=True, foreach=False),
        lambda: (fb.adopt, dict(lr=1e-2, weight_decay=0.1, decouple=True)),
    ),
    "adopt-l2-factory": (
        "adopt",
        "ADOPT",
        dict(lr=1e-2, weight_decay=0.1, foreach=False),
        lambda: (fb.adopt, dict(lr=1e-2, weight_decay=0.1)),
    ),
}
