"""Every alias and wrapper traces into one torch.compile graph (fullgraph, no recompiles over
several steps) and the compiled steps equal the eager ones."""

from __future__ import annotations

import pytest
import torch
from devices import ON_CUDA, seeded
from helpers import ALL_ALIASES, RICH_SETTINGS, problem
from torch._dynamo.testing import CompileCounter

import functional_bagua as fb

STEPS = 4


def is_matrix(params):
    return {k: v.dim() > 1 for k, v in params.items()}


WRAPPERS = {
    "masked": lambda: fb.chain(fb.masked(fb.add_decayed_weights(0.1), is_matrix), fb.adam(1e-2)),
    "partition": lambda: fb.partition({True: fb.adamw(1e-2), False: fb.sgd(0.1, momentum=0.9)}, is_matrix),
    "freeze": lambda: fb.chain(fb.freeze({"w": True, "b": False, "s": False, "k": True}), fb.adam(1e-2)),
    "apply_if_finite": lambda: fb.apply_if_finite(fb.adam(1e-2), 2),
    "clip_by_global_norm": lambda: fb.chain(fb.clip_by_global_norm(1.0), fb.sgd(0.1)),
    "multi_steps": lambda: fb.multi_steps(fb.adam(1e-2), 2),
    "ema": lambda: fb.chain(fb.adam(1e-2), fb.ema(0.9)),
    "lookahead": lambda: fb.lookahead(fb.adam(1e-2), sync_period=3),
}
CASES = [
    pytest.param(lambda a=a: a(**RICH_SETTINGS.get(a, {})), fb.muon if a is fb.muon else None, id=a.__name__)
    for a in ALL_ALIASES
]
CASES += [pytest.param(make, None, id=name) for name, make in WRAPPERS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("make, shapes_of", CASES)
def test_compiles_once_and_equals_eager(make, shapes_of):
    torch._dynamo.reset()
    tx = make()
    params, _ = problem(shapes_of or fb.sgd)
    gen = seeded(1)
    counter = CompileCounter()
    compiled = torch.compile(tx.update, backend=counter, fullgraph=True)
    state, eager_state, eager_params = tx.init(params), tx.init(params), dict(params)
    for _ in range(STEPS):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        updates, state = compiled(grads, state, params)
        params = fb.apply_updates(params, updates)
        eager_updates, eager_state = tx.update(grads, eager_state, eager_params)
        eager_params = fb.apply_updates(eager_params, eager_updates)
        for k in params:
            torch.testing.assert_close(params[k], eager_params[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    assert counter.frame_count == 1


def test_many_optimizers_compiled_in_one_process_each_compile_once():
    """torch.compile(tx.update) of ten chains (and of second-order transforms) that differ in
    their numbers: dynamo keeps compiled code per code object, and its recompile limit (8) once
    failed the ninth configuration under fullgraph; each chain has a code object of its own."""
    params, grads = problem(fb.sgd, torch.float64)
    params, grads = {"w": params["w"]}, {"w": grads["w"]}
    steps = [grads, {k: -0.5 * g for k, g in grads.items()}]
    # CUDA's eigh rounds a matrix by itself otherwise than in the batch the traced update builds
    # (H200: 1.1e-16 apart in float64 after one step, 5.2e-15 after two, the roots amplifying what
    # the eigenvalues differ); on the CPU both are bit for bit
    tolerance = dict(rtol=1e-9, atol=1e-12) if ON_CUDA else dict(rtol=0, atol=0)
    for k in range(10):
        for tx in (fb.sgd(0.1 * (k + 1), momentum=0.5), fb.scale_by_shampoo(epsilon=10.0 ** -(k + 1))):
            counter = CompileCounter()
            compiled = torch.compile(tx.update, backend=counter, fullgraph=True)
            state_c = state_e = tx.init(params)
            for g in steps:
                got, state_c = compiled(g, state_c, params)
                expected, state_e = tx.update(g, state_e, params)
                torch.testing.assert_close(got, expected, **tolerance)
            assert counter.frame_count == 1, (k, counter.frame_count)
