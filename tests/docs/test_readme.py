"""Every Python snippet in README.md runs as written (each in a fresh interpreter, from an empty directory: a fork
of one that imported torch and twophase only, tests/forks.py)."""
import re
from pathlib import Path

import pytest

import forks

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index, tmp_path):
    proc = forks.run(SNIPPETS[index], cwd=tmp_path, timeout=120)  # this checkout, one thread
    assert proc.returncode == 0, f"README snippet {index + 1}:\n{SNIPPETS[index]}\n{proc.stderr[-2000:]}"
