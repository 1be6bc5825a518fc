"""Every Python block of README.md and of the docs' pages (guides, migration guides) runs as
written, each on its own (its imports and setup are in the block), in a fresh namespace; every
shell command they show that runs an example runs too (briefly: ``--steps 2``), and every other
shell command is one this suite or CI stands for, said where."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu_only("runs the README's and the guides' code blocks as a CPU user would")

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATED = ("docs/_build", "docs/api", "docs/benchmarks")  # written by the docs build: no code blocks
PAGES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if not str(p.relative_to(ROOT)).startswith(GENERATED)
)


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


BLOCKS = [(page.relative_to(ROOT), i, block) for page in PAGES for i, block in enumerate(python_blocks(page))]


def test_the_readme_and_the_guides_have_python_blocks():
    assert len(python_blocks(ROOT / "README.md")) >= 3
    assert len({page for page, _, _ in BLOCKS}) >= 10


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{page}:block{i}" for page, i, _ in BLOCKS])
def test_the_block_runs(page, index, block):
    exec(compile(block, f"{page} python block {index}:\n{block[:60]}", "exec"), {"__name__": "doc_block"})


def shell_commands(page: pathlib.Path) -> list[str]:
    """The commands of the page's bash blocks: each line without its comment, split at ``&&``."""
    blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [part.strip() for line in lines if line and not line.startswith("#") for part in line.split("&&")]


COMMANDS = sorted({command for page in PAGES for command in shell_commands(page)})
# the commands that run no example, and who runs them instead
STOOD_FOR = {
    r"pip install .*": "installs: .ci/run's first step, on a fresh virtual environment",
    r"(FB_TEST_DEVICE=cuda )?python -m pytest.*": "this suite (on CUDA: the GPU run)",
    r"bash benchmarks/gpu_check\.sh .*": "needs a GPU; tests/test_gpu_check.py runs its plan without one",
    r"sphinx-build .*": ".ci/run builds the docs in strict mode",
}
EXAMPLE = re.compile(r"(torchrun --standalone|python -m functional_bagua\.compat\.launch|python) .*examples/\w+\.py")


def test_every_shell_command_of_the_docs_runs_here_or_is_stood_for():
    assert any(EXAMPLE.match(c) for c in COMMANDS)
    for command in COMMANDS:
        assert EXAMPLE.match(command) or any(re.fullmatch(p, command) for p in STOOD_FOR), (
            f"the docs show {command!r}, which no test runs: run it in test_every_documented_example_runs "
            "or say in STOOD_FOR what stands for it"
        )


def local_launch(command: str, port: int) -> list[str]:
    """``command`` as this machine runs it: torchrun and Bagua's launcher on 127.0.0.1 at ``port``."""
    words = shlex.split(command)
    if words[0] == "torchrun":
        rest = [w for w in words[1:] if w != "--standalone"]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            *rest,
        ]
    if words[:3] == ["python", "-m", "functional_bagua.compat.launch"]:
        return [sys.executable, *words[1:3], "--master_addr", "127.0.0.1", "--master_port", str(port), *words[3:]]
    return [sys.executable, *words[1:]]


def test_every_documented_example_runs():
    """Each as written, from the repository's root, for 2 steps (every example takes ``--steps``),
    two at a time (most of each run is starting Python and torch)."""
    from concurrent.futures import ThreadPoolExecutor

    from dist_harness import free_port

    integrations = {"hf_trainer": "transformers", "lightning_train": "lightning"}
    examples = [c for c in COMMANDS if EXAMPLE.match(c)]
    missing = [c for c in examples for name, package in integrations.items() if name in c and not importable(package)]
    commands = [c for c in examples if c not in missing]

    def run(command: str) -> tuple[str, subprocess.CompletedProcess]:
        argv = local_launch(command, free_port()) + ["--steps", "2"]
        return command, subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)

    with ThreadPoolExecutor(2) as pool:
        failed = [
            f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
            for command, done in pool.map(run, commands)
            if done.returncode != 0
        ]
    assert len(examples) >= 8 and not failed, "\n\n".join(failed)
    if missing:
        pytest.skip(
            f"ran the other {len(commands)}; these need the integrations (pip install -e '.[integrations]'): {missing}"
        )


def importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None
