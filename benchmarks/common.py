"""Shared benchmark helpers: timing, peak memory, copy bandwidth, tables, charts, and the
results kept for the docs (``record``: ``benchmarks/results/<machine>/<benchmark>.json``)."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import shlex
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_times_ms(fn: Callable[[], object], device: str, steps: int, warmup: int = 3) -> list[float]:
    """The time of each of ``steps`` calls of ``fn()`` in milliseconds, after ``warmup`` untimed
    calls. On CUDA, CUDA events around each call, synchronized once at the end (a host sync per
    step would add its own latency to steps of tens of microseconds); the GPU's time between the
    events includes any wait for the host to launch the step's kernels. Elsewhere, wall time."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.startswith("cuda"):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median_ms(fn: Callable[[], object], device: str, steps: int, warmup: int = 3) -> float:
    """Median time of ``fn()`` in milliseconds (:func:`step_times_ms`)."""
    return statistics.median(step_times_ms(fn, device, steps, warmup))


def spread(times: list[float]) -> str:
    """The range of ``times`` as ``"min-max"``, for the reports' medians."""
    return f"{min(times):.3g}-{max(times):.3g}"


def steady_malloc(mmap_threshold: int = 32 << 20) -> str:
    """Pin glibc's allocator so that CPU timings of large tensors stop depending on its history.

    By default glibc moves its mmap threshold as blocks are freed, so a temporary of a few MB
    comes either from the heap (no cost) or from a fresh ``mmap`` (a page fault per 4 KiB, about
    10 ms per 100 MB here) depending on what was allocated before: identical optimizer steps on
    BERT-size tensors then differ by up to 2x. With a fixed threshold (32 MiB, glibc's largest)
    and no trimming, every block below it is reused from the heap and every block above it is
    always mapped afresh, for every variant alike. Returns what was done, for the report."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "default allocator (no glibc mallopt)"
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if not (mallopt(M_MMAP_THRESHOLD, mmap_threshold) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1)):
        return "default allocator (mallopt refused)"
    return f"glibc malloc pinned: mmap threshold {mmap_threshold >> 20} MiB, no trimming"


def first_call_s(fn: Callable[[], object], device: str) -> float:
    """Seconds taken by the first call (the compile, for a compiled function)."""
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class PeakMemory:
    """Peak memory above the start, in MiB: CUDA's allocator statistics on GPU; on CPU the
    process's peak resident set (VmHWM, reset through /proc/self/clear_refs)."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            _reset_peak_rss()
            self.start = _rss_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _rss_kib("VmHWM") * 1024
        self.mib = max(0, peak - self.start) / 2**20


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def copy_bandwidth_gbs(device: str, mib: int = 0) -> float:
    """The machine's copy bandwidth (read + write bytes per second) on a ``mib`` MiB buffer
    (default: 1 GiB on a GPU, well beyond its L2 cache; 256 MiB on the CPU)."""
    mib = mib or (1024 if device.startswith("cuda") else 256)
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, steps=10)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` (dicts) with the given columns."""

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def machine(device: str = "cpu") -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


# where record() keeps runs: benchmarks/results, or FB_RESULTS_DIR (the prepared GPU run points it
# into its output folder, whose results/<machine>/ then go into benchmarks/results)
RESULTS = pathlib.Path(os.environ.get("FB_RESULTS_DIR") or pathlib.Path(__file__).resolve().parent / "results")


def machine_slug(device: str = "cpu") -> str:
    """A folder name for the machine: ``cpu-2-cores``, ``nvidia-h200``."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
    else:
        name = f"cpu {os.cpu_count()} cores"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def record(
    benchmark: str, device: str, tables: list[dict], *, note: str = "", into: pathlib.Path = RESULTS
) -> pathlib.Path:
    """The run's tables as ``into/<machine>/<benchmark>.json``, the latest run per machine,
    which ``benchmarks/plots.py`` draws and the docs show.

    Args:
        benchmark: the benchmark's name (its script's stem, or the script's and a section's).
        device: where it ran (``"cpu"``, ``"cuda"``).
        tables: each ``{"title", "columns", "rows"}`` as printed (rows are dicts, keyed by the
            columns and possibly more), and optionally ``"chart": {"value", "label", "log"}``:
            a bar per row, its length ``row[value]`` (a number), named by the ``label`` columns
            (with ``"kind": "curves"``, a line per row through the list ``row[value]``).
        note: what a reader of the tables should know about the run (its page shows it under the
            command); none by default.
    """
    path = into / machine_slug(device) / f"{benchmark}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": benchmark,
        "machine": machine(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "benchmarks/" + pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]),
        **({"note": note} if note else {}),
        "tables": tables,
    }
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"recorded: {path}")
    return path


def write_json(path: str, payload: object) -> None:
    """``payload`` as JSON at ``path`` (nothing when ``path`` is empty): the machine-readable
    copy of a benchmark's tables, for benchmarks/gpu_check.py's report."""
    if not path:
        return

    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def bar_chart(path: str, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> bool:
    """A grouped bar chart (group -> variant -> value) written to ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    variants = sorted({v for g in groups.values() for v in g}, key=lambda v: (not v.startswith("torch"), v))
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.5))
    for i, variant in enumerate(variants):
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, [g.get(variant, 0.0) for g in groups.values()], width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], list(groups), rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def on_gloo_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0) -> list:
    """``fn(*args)`` on ``world`` spawned processes in one gloo group on 127.0.0.1 (one thread
    each): each rank's return value (through ``torch.save``), in rank order. ``fn`` must be a
    function of a module (spawn pickles it by name)."""
    with tempfile.TemporaryDirectory() as out_dir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.start_processes(
            _gloo_rank, args=(world, port, out_dir, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        while not context.join(timeout=timeout_s):
            pass
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]


def _gloo_rank(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(fn(*args), os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
