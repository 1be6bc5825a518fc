"""The benchmark pages, written by ``conf.py`` before each build: one page per script of
``benchmarks/`` with its description and commands (the script's docstring) and, per machine,
the latest run recorded in ``benchmarks/results/<machine>/`` (``--record``): the date, the
machine, the command, its tables, and the figures ``benchmarks/plots.py`` draws from them."""

from __future__ import annotations

import ast
import json
import pathlib
import sys

NOT_BENCHMARKS = {"common", "plots"}  # helpers, not benchmarks
# A/B tools: each run compares this tree with another checkout, a question of one change, not of a machine
COMPARES_CHECKOUTS = {"ab_eager_update", "ab_fused_step"}


def _cell(value) -> str:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(tab: dict) -> str:
    columns = tab["columns"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in tab["rows"]]
    return "\n".join(lines)


def _runs_of(stem: str, results: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in results.glob("*/*.json") if p.stem == stem or p.stem.startswith(stem + "-"))


def _page(script: pathlib.Path, results: pathlib.Path, figures: pathlib.Path, plots) -> str:
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    summary, _, rest = doc.partition("\n\n")
    title, _, what = summary.replace("\n", " ").partition(": ")
    lines = [f"# {title.rstrip('.')}", ""]
    if what:
        lines += [what[0].upper() + what[1:], ""]
    lines += [f"Script: `benchmarks/{script.name}`.", ""]
    if rest:
        lines += ["```text", rest.rstrip(), "```", ""]
    runs = _runs_of(script.stem, results)
    if "record(" in script.read_text():  # it calls common.record (its --record flag)
        lines += ["Run it with `--record` to keep its tables in `benchmarks/results/<machine>/` for this page.", ""]
    if script.stem in COMPARES_CHECKOUTS:
        lines += [
            "It compares this tree with another checkout, so no run is kept per machine: its runs, and "
            "what they decided, are in the {doc}`history`.",
            "",
        ]
    elif script.stem == "gpu_check":
        lines += [
            "It keeps no run of its own: the benchmarks it runs record theirs into `OUTDIR/results/<machine>/`, "
            "and copied into `benchmarks/results/` they appear on their own pages.",
            "",
        ]
    elif not runs:
        lines += ["No run recorded yet; earlier runs are in the {doc}`history`.", ""]
    for machine_dir in sorted({r.parent for r in runs}):
        for run_path in [r for r in runs if r.parent == machine_dir]:
            run = json.loads(run_path.read_text())
            part = "" if run_path.stem == script.stem else f" ({run_path.stem[len(script.stem) + 1 :]})"
            lines += [f"## {run['machine']}, {run['date']}{part}", "", f"Command: `{run['command']}`", ""]
            if run.get("note"):
                lines += [run["note"], ""]
            for index, tab in enumerate(run["tables"]):
                lines += [f"### {tab['title']}", "", _table(tab), ""]
                figure = figures / plots.figure_name(run_path, index)
                if figure.exists():
                    lines += [f"![{tab['title']}](figures/{figure.name})", ""]
    return "\n".join(lines)


def write(docs: pathlib.Path) -> None:
    """Draws the figures and writes ``docs/benchmarks/<script>.md`` for every benchmark script."""
    root = docs.parent / "benchmarks"
    sys.path.insert(0, str(root))
    import plots

    figures = docs / "benchmarks" / "figures"
    plots.draw(figures, root / "results")
    for script in sorted(root.glob("*.py")):
        if script.stem in NOT_BENCHMARKS:
            continue
        path = docs / "benchmarks" / f"{script.stem}.md"
        text = _page(script, root / "results", figures, plots)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
