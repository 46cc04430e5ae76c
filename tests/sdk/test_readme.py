"""The Python examples of README.md and of the pages under docs/ run against a live stack, so they
cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Stack

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), block)
    for page in PAGES
    for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
]


def test_readme_has_python_examples() -> None:
    assert sum(page == "README.md" for page, _ in BLOCKS) >= 2


@pytest.mark.parametrize("page, block", BLOCKS, ids=[f"{page}-{i}" for i, (page, _) in enumerate(BLOCKS)])
def test_docs_python_block_runs(page: str, block: str, stack: Stack, api_key: str, tmp_path: Path) -> None:
    (tmp_path / "trainers").symlink_to(ROOT / "trainers")  # the examples use repo-relative paths
    env = {**os.environ, "TUNEHOUSE_BASE_URL": stack.url, "TUNEHOUSE_API_KEY": api_key}
    result = subprocess.run(
        [sys.executable, "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{page}: {result.stderr}"
