"""The README's main example runs and its loss goes down."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_loss_goes_down():
    losses = load_example("quickstart").main(steps=150)
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:10]) / 10


def test_quickstart_runs_as_a_script():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "full-data loss" in result.stdout


@pytest.mark.parametrize("optimizer,amp", [("adadelta", False), ("adamw", True)])
def test_fused_optimizer_example_learns(optimizer, amp):
    losses = load_example("fused_optimizer").main(optimizer, steps=60, amp=amp)
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10


def test_distributed_example_runs_under_torchrun_on_two_ranks():
    from dist_harness import free_port

    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(ROOT / "examples" / "distributed_train.py"),
         "--steps", "30", "--compression", "bf16"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "parameters agree across ranks" in result.stdout
