"""Every Python snippet of the docs pages the README's sections moved to runs as written, as README.md's do
(tests/docs/test_readme.py): each in a fresh interpreter, from an empty directory. docs/byom.md, docs/trl.md and
docs/constraints.md have tests of their own (tests/docs/test_byom_doc.py, test_docs_trl.py, test_constraints.py);
docs/policy.md's snippet is a schematic call, not a program."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["library.md", "plugins.md", "hf.md", "python.md"]
SNIPPETS = [(page, i, code) for page in PAGES for i, code in enumerate(
    re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / page).read_text(), flags=re.S | re.M))]


def test_each_page_has_a_snippet():
    assert {page for page, _, _ in SNIPPETS} == set(PAGES)


@pytest.mark.parametrize("page, index, code", SNIPPETS, ids=[f"{p}:{i + 1}" for p, i, _ in SNIPPETS])
def test_snippet_runs(page, index, code, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"docs/{page} snippet {index + 1}:\n{code}\n{proc.stderr[-2000:]}"
