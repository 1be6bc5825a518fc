"""Optimizer state checkpoints: a flat dict of tensors, clear errors, bitwise resume."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from resume_cases import FIRST_STEPS, all_cases, data, initial_params, train

import functional_bagua as fb

HERE = pathlib.Path(__file__).parent


def test_state_dict_is_keyed_by_position_field_and_parameter():
    params = {"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)}
    state = fb.adamw().init(params)
    flat = fb.state_dict(state)
    assert set(flat) == {f"1/{field}/{name}" for field in ("count", "mu", "nu") for name in params}
    assert flat["1/mu/fc.weight"] is state[1].mu["fc.weight"]


def test_load_state_dict_round_trips_and_reports_the_first_mismatch():
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    tx = fb.adam(amsgrad=True)
    state = tx.init(params)
    _, state = tx.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
    flat = {k: v.clone() for k, v in fb.state_dict(state).items()}
    restored = fb.load_state_dict(tx.init(params), flat)
    assert all(torch.equal(a, b) for a, b in zip(fb.state_dict(restored).values(), fb.state_dict(state).values()))

    missing = dict(flat)
    del missing["2/nu_max/w"]
    with pytest.raises(ValueError, match="'2/nu_max/w' is missing"):
        fb.load_state_dict(tx.init(params), missing)
    with pytest.raises(ValueError, match="'2/extra/w' is not in this optimizer's state"):
        fb.load_state_dict(tx.init(params), dict(flat, **{"2/extra/w": torch.zeros(1)}))
    with pytest.raises(
        ValueError, match=r"'2/mu/b' is torch.float32 \(3,\) in the checkpoint, the state expects torch.float32 \(2,\)"
    ):
        fb.load_state_dict(tx.init(params), dict(flat, **{"2/mu/b": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"'2/mu/b' is torch.float64"):
        fb.load_state_dict(tx.init(params), dict(flat, **{"2/mu/b": torch.zeros(2, dtype=torch.float64)}))
    with pytest.raises(ValueError, match="'2/nu_max/b' is missing"):  # an optimizer of another kind
        fb.load_state_dict(tx.init(params), fb.state_dict(fb.adam().init(params)))


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bitwise_identical(tmp_path):
    """Train N steps, save, load in a new Python process, train M more == N+M steps straight."""
    batches = data()
    cases = all_cases()
    straight = []
    for i, (_case_id, make_tx, kind) in enumerate(cases):
        tx = make_tx()
        params, state = train(tx, kind, initial_params(kind), tx.init(initial_params(kind)), batches[:FIRST_STEPS])
        torch.save({"params": params, "state": fb.state_dict(state)}, tmp_path / f"{i}.pt")
        straight.append(train(tx, kind, params, state, batches[FIRST_STEPS:])[0])

    result = subprocess.run(
        [sys.executable, str(HERE / "resume_worker.py"), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]

    for i, (case_id, _, _) in enumerate(cases):
        resumed = torch.load(tmp_path / f"{i}.resumed.pt")
        for name, value in straight[i].items():
            assert torch.equal(resumed[name], value), f"{case_id}: {name} differs after resume"


def test_state_dict_saves_and_loads_with_torch_distributed_checkpoint(tmp_path):
    """fb.state_dict's tensors are the state's own, so DCP (one process, no process group) loads
    into a fresh state in place: the same tensors as the saved state's."""
    import torch.distributed.checkpoint as dcp

    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    tx = fb.chain(fb.clip_by_global_norm(1.0), fb.adamw(1e-2))
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
    dcp.save(fb.state_dict(state), checkpoint_id=str(tmp_path))
    fresh = tx.init(params)
    dcp.load(fb.state_dict(fresh), checkpoint_id=str(tmp_path))
    saved, loaded = fb.state_dict(state), fb.state_dict(fresh)
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
