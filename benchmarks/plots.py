"""Figures from the recorded benchmark results: for each ``benchmarks/results/<machine>/*.json``
(written by a benchmark run with ``--record``), a chart of each table that names one: a
horizontal bar per row (``{"value", "label", "log"}``: the bar ``row[value]``, named by the
``label`` columns), or with ``"kind": "curves"`` a line per row (``row[value]`` a list, one
value per step; ``"ylabel"`` names the axis). The docs build calls :func:`draw`; by hand::

    python benchmarks/plots.py docs/benchmarks/figures
"""

from __future__ import annotations

import json
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def figure_name(result: pathlib.Path, index: int) -> str:
    """The figure's file name for table ``index`` of ``result``: ``<machine>-<benchmark>-<index>.png``."""
    return f"{result.parent.name}-{result.stem}-{index}.png"


def draw(out_dir: pathlib.Path, results: pathlib.Path = RESULTS) -> list[pathlib.Path]:
    """Draws every charted table of every result into ``out_dir``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.png"):  # a table that lost its chart keeps no old figure
        stale.unlink()
    written = []
    for result in sorted(results.glob("*/*.json")):
        run = json.loads(result.read_text())
        for index, tab in enumerate(run["tables"]):
            chart = tab.get("chart")
            if not chart:
                continue
            labels = [" / ".join(str(r.get(c, "")) for c in chart["label"]) for r in tab["rows"]]
            if chart.get("kind") == "curves":  # a line per row: row[value] is a list, one value per step
                lines = [(label, r.get(chart["value"])) for label, r in zip(labels, tab["rows"])]
                lines = [(label, ys) for label, ys in lines if isinstance(ys, list) and ys]
                if not lines:  # rows of failed variants hold an error and no values
                    continue
                fig, ax = plt.subplots(figsize=(8, 4))
                for label, ys in lines:
                    ax.plot(range(1, len(ys) + 1), ys, label=label)
                ax.set_xlabel("step")
                ax.set_ylabel(chart.get("ylabel", chart["value"]))
                ax.legend(fontsize=7)
            else:  # a bar per row whose row[value] is a number
                bars = [(label, r.get(chart["value"])) for label, r in zip(labels, tab["rows"])]
                bars = [(label, v) for label, v in bars if isinstance(v, (int, float))]
                if not bars:
                    continue
                fig, ax = plt.subplots(figsize=(8, 0.28 * len(bars) + 1.2))
                ax.barh(range(len(bars)), [v for _, v in bars], color="#4c72b0")
                ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
                ax.invert_yaxis()
                if chart.get("log"):
                    ax.set_xscale("log")
                ax.set_xlabel(f"{chart['value']} (median)")
            ax.set_title(f"{tab['title']}\n{run['machine']}, {run['date']}", fontsize=8)
            fig.tight_layout()
            path = out_dir / figure_name(result, index)
            fig.savefig(path, dpi=110, bbox_inches="tight")  # long labels stay whole
            plt.close(fig)
            written.append(path)
    return written


if __name__ == "__main__":
    for path in draw(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/figures")):
        print(path)
