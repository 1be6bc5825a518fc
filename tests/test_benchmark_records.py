"""A benchmark's recorded run reaches the docs: ``common.record`` writes the tables with the
machine, date and command; ``plots.draw`` draws the charted tables; the benchmark's page shows
the run's numbers and figure. And every public name has its place in the API reference."""

from __future__ import annotations

import datetime
import json
import pathlib
import sys

import pytest

pytestmark = pytest.mark.cpu_only("checks files written for the docs, not tensors")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "docs")]


def test_a_recorded_run_is_drawn_and_shown_on_its_page(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the figures need matplotlib (pip install -e '.[docs]')")
    import benchmark_pages
    import common
    import plots

    monkeypatch.setattr(
        sys, "argv", ["benchmarks/first_order.py", "--config", "mlp", "--skip", "fuse_inplace eager", "--record"]
    )
    rows = [
        {"optimizer": "adopt", "variant": "fb.Optimizer", "ms": 1.25},
        {"optimizer": "adopt", "variant": "ref", "ms": 2.5},
        {"optimizer": "adopt", "variant": "broken", "error": "ImportError: not installed"},  # a failed variant
    ]
    tables = [
        dict(
            title="step time",
            columns=["optimizer", "variant", "ms"],
            rows=rows,
            chart=dict(value="ms", label=["variant"]),
        ),
        dict(
            title="loss",
            columns=["optimizer", "final_loss"],
            rows=[
                {"optimizer": "adamw", "final_loss": 1.5, "curve": [3.0, 2.0, 1.5]},
                {"optimizer": "lion", "error": "nan"},
            ],
            chart=dict(kind="curves", value="curve", label=["optimizer"]),
        ),
    ]
    path = common.record("first_order-mlp", "cpu", tables, into=tmp_path / "results")

    run = json.loads(path.read_text())
    assert path.parent.name == common.machine_slug("cpu") and path.name == "first_order-mlp.json"
    assert run["date"] == datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert run["command"] == "python benchmarks/first_order.py --config mlp --skip 'fuse_inplace eager' --record"
    assert run["tables"][0]["rows"] == rows

    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "cpu-2-cores-gone-0.png").write_bytes(b"stale")  # a figure of a table no longer charted
    drawn, curves = plots.draw(figures, tmp_path / "results")
    assert sorted(figures.iterdir()) == sorted([drawn, curves])
    assert [drawn.name, curves.name] == [plots.figure_name(path, 0), plots.figure_name(path, 1)]
    assert drawn.read_bytes().startswith(b"\x89PNG") and curves.read_bytes().startswith(b"\x89PNG")

    page = benchmark_pages._page(ROOT / "benchmarks" / "first_order.py", tmp_path / "results", figures, plots)
    assert f"## {run['machine']}, {run['date']}" in page
    assert f"`{run['command']}`" in page
    assert "| adopt | fb.Optimizer | 1.25 |" in page and "| adopt | ref | 2.5 |" in page
    assert "| adamw | 1.5 |" in page
    assert f"](figures/{drawn.name})" in page and f"](figures/{curves.name})" in page


def test_every_kept_run_has_what_its_page_shows():
    """Each file of ``benchmarks/results/`` (recorded, or kept by hand from the results history
    with a note saying so) is a run of an existing benchmark script, with its machine, date and
    command, and tables whose charts name columns that rows hold."""
    kept = sorted((ROOT / "benchmarks" / "results").glob("*/*.json"))
    assert kept, "no recorded runs: the benchmark pages would show none"
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    for path in kept:
        run = json.loads(path.read_text())
        assert run["benchmark"] == path.stem, path
        assert run["benchmark"].split("-")[0] in scripts, path
        assert run["machine"] and run["command"].split()[:2] == ["python", f"benchmarks/{path.stem.split('-')[0]}.py"]
        datetime.date.fromisoformat(run["date"])
        for tab in run["tables"]:
            assert tab["title"] and tab["rows"], path
            assert all(tab["columns"][0] in row for row in tab["rows"]), path  # each row names what it is
            chart = tab.get("chart")
            if chart:
                assert any(isinstance(row.get(chart["value"]), (int, float, list)) for row in tab["rows"]), path
                assert all(c in tab["columns"] for c in chart["label"]), path


def test_every_benchmark_keeps_its_runs_for_the_docs():
    """Each benchmark script records its tables (``--record``) and has a kept run, but the
    prepared GPU run (whose benchmarks record their own) and the A/B tools (each run compares two
    checkouts, which the page says instead)."""
    import benchmark_pages

    kept = {p.stem.split("-")[0] for p in (ROOT / "benchmarks" / "results").glob("*/*.json")}
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        name = script.stem
        if name in benchmark_pages.NOT_BENCHMARKS or name in benchmark_pages.COMPARES_CHECKOUTS or name == "gpu_check":
            continue
        assert "record(" in script.read_text() and name in kept, f"benchmarks/{name}.py keeps no run for the docs"


def test_every_public_name_has_one_place_in_the_api_reference():
    import api_pages

    api_pages.check_every_name_is_placed()  # raises naming what is missing or placed twice
