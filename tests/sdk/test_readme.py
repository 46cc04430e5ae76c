"""README's Python examples run against a live stack, so they cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Stack

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index: int, stack: Stack, api_key: str, tmp_path: Path) -> None:
    (tmp_path / "trainers").symlink_to(ROOT / "trainers")  # the examples use repo-relative paths
    env = {**os.environ, "TUNEHOUSE_BASE_URL": stack.url, "TUNEHOUSE_API_KEY": api_key}
    result = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
