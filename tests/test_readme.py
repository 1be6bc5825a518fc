"""Every Python block of README.md and of the docs' pages (guides, migration guides) runs as
written, each on its own (its imports and setup are in the block), in a fresh namespace."""

from __future__ import annotations

import pathlib
import re

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
