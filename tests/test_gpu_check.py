"""The prepared GPU run's plumbing, through its CPU dry run (``--device cpu``): sections run as
subprocesses within their time limits, the report names each section's status and pytest's
counts, and the targets table says what was not measured instead of inventing numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "benchmarks", "gpu_check.py")

pytestmark = pytest.mark.cpu_only("runs the prepared GPU script's CPU dry run")


def dry_run(out, section: str) -> None:
    """The CPU dry run of one section into ``out``, which must end well."""
    result = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(out), "--device", "cpu", "--only", section, "--budget", "240"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_dry_run_writes_the_report_of_the_sections_it_ran(tmp_path):
    dry_run(tmp_path, "tests")
    report = (tmp_path / "report.md").read_text()
    assert "| tests | ok |" in report
    data = json.loads((tmp_path / "report.json").read_text())
    counts = data["data"]["tests"]["counts"]
    assert counts.get("passed", 0) > 0 and not counts.get("failed") and not data["data"]["tests"]["failures"]
    assert [s["name"] for s in data["sections"]] == ["tests"]
    assert all(t["met"] == "-" and t["measured"] == "not measured" for t in data["targets"])


def test_a_benchmark_section_records_its_tables_into_the_output_folder(tmp_path):
    """The benchmarks of the run keep their tables in ``OUTDIR/results/<machine>/`` (what the docs
    show once copied into benchmarks/results), with the command that made them."""
    dry_run(tmp_path, "first")
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import common

    run = json.loads((tmp_path / "results" / common.machine_slug("cpu") / "first_order-many.json").read_text())
    assert run["command"].startswith("python benchmarks/first_order.py --device cpu --config many")
    rows = run["tables"][0]["rows"]
    assert {r["variant"] for r in rows} >= {"reference", "fb.Optimizer"} and all(r["ms"] > 0 for r in rows)


def test_a_section_past_its_limit_is_stopped_and_reported(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import gpu_check

    with open(tmp_path / "log", "w") as log:
        result = gpu_check.run_section(
            "slow", [sys.executable, "-c", "import time; print('# begun', flush=True); time.sleep(60)"], 2, log
        )
    assert result["status"] == "stopped at its limit of 2 s" and result["seconds"] < 30
    assert "# begun" in gpu_check.markdown_of(result)
