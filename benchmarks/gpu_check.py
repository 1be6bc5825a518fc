"""The prepared GPU run: the test suite on CUDA, the distributed paths on one GPU, and the GPU
benchmarks, in one time budget, written up as one Markdown report (plus JSON).

    bash benchmarks/gpu_check.sh OUTDIR [WHEELS_DIR]        # installs the wheels first, then this
    python benchmarks/gpu_check.py --out OUTDIR [--budget 480]
    python benchmarks/gpu_check.py --out /tmp/dry --device cpu   # the dry run: every section, small

Sections, run one after another as subprocesses, each given a share of ``--budget`` seconds (the
time a section leaves unused passes to the next) and stopped at its limit, so the report is
always written:

1. ``tests``: ``pytest --device cuda`` over the whole suite (tests/conftest.py), parallel where
   pytest-xdist is installed; the CUDA-only modules test_cuda.py and test_cuda_distributed.py
   (NCCL at world size 1, 2 ranks sharing the GPU through gloo) are part of it.
2. ``step``: the AdamW step on four configs against torch.optim (``torch.compile(opt.step)`` on
   the 200-tensor config), and the memory roofline (optimizer_step.py).
3. ``others``: the same for Adam, SGD, LAMB, Lion, Adafactor and Muon.
4. ``peers``: heavyball's AdamW and torchopt on the same configs, in a process of their own
   (heavyball compiles with max-autotune, whose workers would load the timings of the others).
5. ``compile``: first-compile time against tensor count (ours, heavyball's, torch.compile(opt.step)).
6. ``e2e``: a GPT-2-small-like model (2 of its 12 layers, to fit the budget) trained under bf16
   autocast (end_to_end.py).
7. ``bagua``: Bagua's headline case, ``fuse_step`` vs ``step`` on BERT-base (fused_optimizer.py).
8. ``second`` (only when named: ``--only second``): Shampoo (eigh and Newton roots), PSGD-Kron and SOAP, eager and
   compiled over flat buffers, against the references and heavyball on 200 x (50, 100) and GPT-2
   small's shapes (second_order.py).
9. ``first`` (only when named): the newer first-order optimizers against their reference
   packages on 200 tensors, with the operators of ``fb.Optimizer``'s steps (first_order.py).
10. ``lowprec`` (only when named): AdamW's state in float32, bfloat16 and 8 bits, and torchao's
    AdamW8bit: bytes from the allocator and step times (low_precision.py).

The report names the device, the date, torch, CUDA and the driver, which optional packages were
missing, each section's status and tables, and the GPU targets against what was measured. Each
benchmark also records its tables (``--record``) into ``OUTDIR/results/<machine>/``: copy that
folder into ``benchmarks/results/`` and the docs show the GPU's latest runs beside the CPU's.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPTIONAL = ("optree", "heavyball", "torchopt", "pytest", "xdist", "hypothesis", "transformers", "lightning")
FAILURES_FILE, PROGRESS_FILE = "test_failures.txt", "dist_progress.txt"
# shares of the budget, from the H200 runs: the suite takes about 150 s on 12 workers and its CUDA
# distributed module about as long beside it; end to end about 100 s for its rows
SHARES = {"tests": 0.40, "step": 0.14, "others": 0.10, "peers": 0.08, "compile": 0.08, "e2e": 0.16, "bagua": 0.04}
OPT_IN = {"second": 1.0, "first": 1.0, "lowprec": 1.0}  # run only when --only names them, with their share


def sections(out: str, device: str, quick: bool) -> list[tuple[str, list[str], str]]:
    """(name, command, JSON file it writes or "") of each section; ``quick`` for the CPU dry run."""
    py = sys.executable
    bench = lambda name: os.path.join(HERE, name)  # noqa: E731
    xdist = ["-n", "12", "--dist", "loadgroup"] if importlib.util.find_spec("xdist") and not quick else []
    # each test's result as it ends (a section stopped at its limit still tells which failed), and a
    # per-test limit where pytest-timeout is installed (a hung collective fails one test, not all)
    per_test = ["-v"] + (["--timeout", "90"] if importlib.util.find_spec("pytest_timeout") else [])
    tests = ["tests/test_core.py", "tests/test_cuda.py"] if quick else ["tests"]
    configs = "a" if quick else "a,b,d,c"
    others = "muon" if quick else "adam,sgd,lamb,lion,adafactor,muon"
    steps = "3" if quick else "20"
    step = (
        lambda name, optimizers, *more: (  # noqa: E731
            [py, bench("optimizer_step.py"), "--device", device, "--configs", configs, "--optimizers", optimizers]
            + ["--no-scaling", "--chart", "", "--steps", steps, "--json", os.path.join(out, name), *more]
            + ["--record", "--record-as", "optimizer_step" + ("" if name == "step.json" else "-" + name[:-5])]
        )
    )
    ours = [
        "--families",
        "torch,fb.Optimizer,fb",
        "--fb-variants",
        "fb tree eager,fb flat in-place (torch),fb flat compiled",
    ]
    return [
        (
            "tests",
            [py, "-m", "pytest", "-p", "no:cacheprovider", "--device", device, "-rfE", *per_test, *xdist, *tests],
            "",
        ),
        ("step", step("step.json", "adamw", *ours, "--torch-compile", "adamw:a", "--roofline"), "step.json"),
        ("others", step("others.json", others, *ours, "--torch-compile", "none"), "others.json"),
        ("peers", step("peers.json", "adamw,adam,sgd", "--families", "peers"), "peers.json"),
        (
            "compile",
            [py, bench("optimizer_step.py"), "--device", device, "--only-scaling", "--families", "fb,peers,torch"]
            + ["--json", os.path.join(out, "compile.json"), "--record", "--record-as", "optimizer_step-compile"],
            "compile.json",
        ),
        (
            "e2e",
            [
                py,
                bench("end_to_end.py"),
                "--device",
                device,
                "--size",
                "gpt2",
                "--autocast",
                "bf16" if device != "cpu" else "none",
            ]
            + (
                ["--layers", "1", "--batch", "2", "--seq", "16", "--steps", "3"]
                if quick
                else ["--layers", "2", "--seq", "512", "--steps", "15"]
            )
            + ["--json", os.path.join(out, "e2e.json"), "--record"],
            "e2e.json",
        ),
        (
            "bagua",
            [
                py,
                bench("fused_optimizer.py"),
                "--device",
                device,
                "--configs",
                "bert",
                "--optimizers",
                "AdamW,Adam,SGD momentum",
            ]
            + [
                "--no-compile",
                "--bert-train",
                "--bert-steps",
                "3" if quick else "10",
                "--train-steps",
                "3" if quick else "10",
                "--record",
            ],
            "",
        ),
        (
            "second",
            [py, bench("second_order.py"), "--device", device, "--optimizers", "soap" if quick else "shampoo,kron,soap"]
            + ["--configs", "a" if quick else "a,d", "--steps", "2" if quick else "10", "--record"],
            "",
        ),
        (
            "first",
            [py, bench("first_order.py"), "--device", device, "--config", "many", "--profile", "fb.Optimizer"]
            + (["--optimizers", "schedule_free_sgd", "--steps", "3"] if quick else ["--steps", "30"])
            + ["--record"],
            "",
        ),
        (
            "lowprec",
            [py, bench("low_precision.py"), "--device", device, "--skip-lm"]
            + (["--configs", "many", "--steps", "3"] if quick else ["--steps", "20"])
            + ["--record"],
            "",
        ),
    ]


def environment(device: str) -> dict:
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)",
        missing=[m for m in OPTIONAL if importlib.util.find_spec(m) is None],
    )
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["driver"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = "unknown (no nvidia-smi)"
    return env


def section_env(name: str, out: str) -> dict:
    """Environment variables of a section: the tests write each failure's traceback and each
    distributed scenario's progress into ``out`` as they happen (tests/conftest.py,
    tests/dist_harness.py), so a section stopped at its limit still tells why and where."""
    if name != "tests":  # the benchmarks record their tables into out/results/<machine>/
        return dict(FB_RESULTS_DIR=os.path.join(out, "results"))
    return dict(FB_TEST_FAILURES=os.path.join(out, FAILURES_FILE), FB_DIST_PROGRESS=os.path.join(out, PROGRESS_FILE))


def run_section(name: str, command: list[str], limit_s: float, log, extra_env: Optional[dict] = None) -> dict:
    """Run ``command`` from the repository root, its output to ``log`` and kept; stopped after ``limit_s``."""
    start = time.monotonic()
    log.write(f"\n===== {name}: {' '.join(command)} (limit {limit_s:.0f} s)\n")
    log.flush()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=limit_s)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        status = f"stopped at its limit of {limit_s:.0f} s"
    log.write(output)
    log.flush()
    return dict(name=name, status=status, seconds=round(time.monotonic() - start, 1), output=output)


def tests_summary(output: str) -> dict:
    """pytest's counts and the failed tests' ids with their one-line reasons."""
    last = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last)}
    failures = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if not failures:  # stopped before its summary: the verbose lines of each test's end
        failures = [line for line in output.splitlines() if re.search(r" (FAILED|ERROR) ", line)]
    return dict(counts=counts, failures=failures)


def tail_of(path: str, lines: int) -> list[str]:
    """The last ``lines`` lines of the file at ``path`` (none if it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return f.read().splitlines()[-lines:]


def markdown_of(result: dict, out: str = "") -> str:
    """The section's own tables (its lines from the first Markdown heading on), or its output's tail;
    for the tests, the failures with their tracebacks and where the distributed scenarios got to."""
    lines = result["output"].splitlines()
    if result["name"] == "tests":
        summary = tests_summary(result["output"])
        body = [f"counts: {summary['counts']}", ""] + [f"- {f[:300]}" for f in summary["failures"][:80]]
        if len(summary["failures"]) > 80:
            body.append(f"- ... and {len(summary['failures']) - 80} more (sections.log)")
        for title, name, n in (("tracebacks", FAILURES_FILE, 400), ("distributed scenarios", PROGRESS_FILE, 60)):
            kept = tail_of(os.path.join(out, name), n)
            if kept:
                body += ["", f"{title} (the last {n} lines of {name}):", "```", *kept, "```"]
        return "\n".join(body)
    first = next((i for i, line in enumerate(lines) if line.startswith("#")), None)
    kept = lines[first:] if first is not None else lines[-40:]
    if result["status"] != "ok":
        tail = [line for line in lines[-15:] if line not in kept]
        kept = kept + (["", "last lines of its output:", "```", *tail, "```"] if tail else [])
    return "\n".join(kept)


def load(out: str, name: str):
    path = os.path.join(out, name)
    if not name or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _ratio(text) -> float:
    return float(str(text).rstrip("x")) if text not in (None, "", "n/a") else float("nan")


def targets(data: dict) -> list[dict]:
    """The GPU targets against the measurements (each: target, measured, met: yes/no/not measured)."""
    rows = []
    step, peers, scaling, e2e = data.get("step"), data.get("peers"), data.get("compile"), data.get("e2e")

    def add(target, measured, met):
        rows.append(
            dict(target=target, measured=measured or "not measured", met=("yes" if met else "no") if measured else "-")
        )

    roof = [r for r in (step or {}).get("roofline", []) if "ms" in r]
    ours_in_place = {"fb flat in-place (torch)": "torch kernel", "fb flat compiled": "compiled"}

    def best_of_ours(rows: list, key: str, value) -> dict:
        """The fastest of our in-place variants per ``row[key]``: (value, kernel) by key."""
        best: dict = {}
        for r in rows:
            if r["variant"] in ours_in_place and (r[key] not in best or r["ms"] < best[r[key]][2]):
                best[r[key]] = (value(r), ours_in_place[r["variant"]], r["ms"])
        return {k: v[:2] for k, v in best.items()}

    shares = best_of_ours(
        [r for r in roof if float(r["elements"].rstrip("M")) >= 10],
        "elements",
        lambda r: float(r["roofline_share"].rstrip("%")),
    )
    add(
        "fused in-place AdamW >= 85% of the measured roofline from 10M elements",
        ", ".join(f"{e}: {s:.0f}% ({k})" for e, (s, k) in shares.items()),
        shares and all(s >= 85 for s, _ in shares.values()),
    )
    adamw = [
        r
        for c in (step or {}).get("configs", {}).values()
        for r in c["rows"]
        if r["optimizer"] == "adamw" and "ms" in r
    ]
    inplace = best_of_ours(adamw, "config", lambda r: _ratio(r.get("vs_torch")))
    inplace.update(
        {f"flat {e}": v for e, v in best_of_ours(roof, "elements", lambda r: _ratio(r.get("vs_torch_fused"))).items()}
    )
    add(
        "fused in-place AdamW <= 1.0x torch fused at every size",
        ", ".join(f"{c}: {x:.2f}x ({k})" for c, (x, k) in inplace.items()),
        inplace and all(x <= 1.0 for x, _ in inplace.values()),
    )
    compiled = [(r["config"], _ratio(r.get("vs_torch"))) for r in adamw if r["variant"] == "fb flat compiled"]
    add(
        "compiled flat AdamW (Triton) <= 1.1x torch fused",
        ", ".join(f"{c}: {x:.2f}x" for c, x in compiled),
        compiled and all(x <= 1.1 for _, x in compiled),
    )
    ours = [
        (r["tensors"], r["compile_s"])
        for r in (scaling or {}).get("compile_scaling", [])
        if r["variant"] == "fb flat compiled" and "ms" in r
    ]
    flat_enough = ours and max(s for _, s in ours) <= 2 * min(s for _, s in ours)
    add(
        "first compile <= 10 s and flat in tensor count",
        ", ".join(f"{n}: {s:.1f} s" for n, s in ours),
        ours and all(s <= 10 for _, s in ours) and flat_enough,
    )
    hb_steps = {
        r["config"]: r["ms"]
        for c in (peers or {}).get("configs", {}).values()
        for r in c["rows"]
        if r["variant"] == "heavyball" and r["optimizer"] == "adamw" and "ms" in r
    }
    best = {}
    for r in adamw:
        if r["variant"] in ("fb flat in-place (torch)", "fb.Optimizer", "fb flat compiled"):
            best[r["config"]] = min(best.get(r["config"], float("inf")), r["ms"])
    pairs = [(c, best[c], hb_steps[c]) for c in hb_steps if c in best]
    add(
        "AdamW step ahead of heavyball's on every shape",
        ", ".join(f"{c}: {a:.3g} vs {b:.3g} ms" for c, a, b in pairs),
        pairs and all(a < b for _, a, b in pairs),
    )
    hb_compile = {
        r["tensors"]: r["compile_s"]
        for r in (scaling or {}).get("compile_scaling", [])
        if r["variant"] == "heavyball" and "ms" in r
    }
    cpairs = [(n, s, hb_compile[n]) for n, s in ours if n in hb_compile]
    add(
        "first compile ahead of heavyball's",
        ", ".join(f"{n}: {a:.1f} vs {b:.1f} s" for n, a, b in cpairs),
        cpairs and all(a < b for _, a, b in cpairs),
    )
    e2e_rows = {r["variant"]: r for r in (e2e or {}).get("rows", []) if "ms" in r}
    tc = e2e_rows.get("torch.compile(model) + fused AdamW")
    fbc = [r for name, r in e2e_rows.items() if name.startswith("fb compiled step") and "cosine" not in name]
    if tc and fbc:
        fastest = min(fbc, key=lambda r: r["ms"])
        add(
            "end to end: our compiled step <= 0.9x torch.compile(model) + fused AdamW",
            f"{fastest['variant']}: {fastest['ms'] / tc['ms']:.2f}x",
            fastest["ms"] <= 0.9 * tc["ms"],
        )
    else:
        add("end to end: our compiled step <= 0.9x torch.compile(model) + fused AdamW", "", False)
    graphed = {name: r for name, r in e2e_rows.items() if name.startswith("fb") and "CUDA graph" in name}
    scheduled = [name for name in graphed if "lr" in name]
    if graphed:
        fastest_name = min(e2e_rows, key=lambda k: e2e_rows[k]["ms"])
        add(
            "the CUDA-graphed step works (lr schedule too) and is the fastest row",
            "; ".join(f"{name}: {r['ms']:.3g} ms" for name, r in graphed.items())
            + f"; schedule {'ran' if scheduled else 'did not run'}; fastest: {fastest_name}",
            bool(scheduled) and fastest_name in graphed,
        )
    else:
        add("the CUDA-graphed step works (lr schedule too) and is the fastest row", "", False)
    donated, eager = e2e_rows.get("fb eager step (tree, donated)"), e2e_rows.get("torch eager + fused AdamW")
    if donated and eager and donated.get("peak_gib") != "" and eager.get("peak_gib") != "":
        add(
            "peak memory of the donated step <= torch's eager step",
            f"{donated['peak_gib']:.2f} vs {eager['peak_gib']:.2f} GiB",
            donated["peak_gib"] <= eager["peak_gib"],
        )
    else:
        add("peak memory of the donated step <= torch's eager step", "", False)
    return rows


def report(env: dict, results: list[dict], data: dict, budget: float, out: str = "") -> str:
    from common import table

    lines = [
        f"# GPU check: {env['device']}, {env['date']}",
        "",
        f"torch {env['torch']}, CUDA {env['cuda']}, driver {env.get('driver', '-')}, Python {env['python']}; "
        f"budget {budget:.0f} s, used {sum(r['seconds'] for r in results):.0f} s",
        f"optional packages missing: {', '.join(env['missing']) or 'none'}",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
        *[f"| {r['name']} | {r['status']} | {r['seconds']} |" for r in results],
        "",
        "## Targets",
        "",
        table(targets(data), ["target", "measured", "met"]),
        "",
    ]
    for r in results:
        lines += [
            f"## Section {r['name']} ({r['status']}, {r['seconds']} s)",
            "",
            markdown_of(r, out).replace("\n# ", "\n### ").replace("\n## ", "\n### "),
            "",
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder for report.md, report.json and the logs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", type=float, default=480, help="seconds for all sections together")
    parser.add_argument("--only", default="", help="comma-separated section names to run (default: all)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (use --device cpu for the dry run)")
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, HERE)
    env = environment(args.device)
    print(f"gpu check on {env['device']}; optional packages missing: {', '.join(env['missing']) or 'none'}", flush=True)
    quick = args.device == "cpu"
    named = args.only.split(",") if args.only else [name for name in SHARES]
    chosen = [s for s in sections(args.out, args.device, quick) if s[0] in named]
    shares = {**SHARES, **OPT_IN}
    deadline = time.monotonic() + args.budget
    results, data = [], {}
    share_left = sum(shares[name] for name, _, _ in chosen)
    with open(os.path.join(args.out, "sections.log"), "w") as log:
        for name, command, json_name in chosen:
            left = deadline - time.monotonic()
            limit = max(10.0, left * shares[name] / share_left)
            share_left -= shares[name]
            if left < 10:
                results.append(dict(name=name, status="not run: budget spent", seconds=0, output=""))
                continue
            result = run_section(name, command, limit, log, section_env(name, args.out))
            results.append(result)
            data[name] = load(args.out, json_name)
            if name == "tests":
                data[name] = tests_summary(result["output"])
            print(f"{name}: {result['status']} in {result['seconds']} s", flush=True)
            with open(os.path.join(args.out, "report.md"), "w") as f:
                f.write(report(env, results, data, args.budget, args.out))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(
            dict(
                environment=env,
                sections=[{k: v for k, v in r.items() if k != "output"} for r in results],
                data=data,
                targets=targets(data),
            ),
            f,
            indent=1,
            default=str,
        )
    print(f"report: {os.path.join(args.out, 'report.md')}")


if __name__ == "__main__":
    main()
