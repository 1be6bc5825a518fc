"""Every Python block of README.md runs as written, each on its own (its imports and setup are in
the block), in a fresh namespace."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.cpu_only("runs the README's code blocks as a CPU user would")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(block):
    exec(compile(block, f"README.md python block:\n{block[:60]}", "exec"), {"__name__": "readme_block"})
