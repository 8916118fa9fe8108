"""Every Python block of every docs page runs as written, as README.md's do (tests/docs/test_readme.py): each in a
fresh interpreter (a fork of one that imported torch and twophase only: tests/forks.py), from an empty directory.
A block that goes on from the one before it on its page says so with `<!-- continues the block above -->` on the
line before it, and runs after it, in the same interpreter. Three pages
have tests of their own that run their blocks and check what they print (OWN_TESTS); every other page's blocks
run here."""
import re
from pathlib import Path

import pytest

import forks

ROOT = Path(__file__).resolve().parents[2]
OWN_TESTS = {"byom.md": "tests/docs/test_byom_doc.py", "trl.md": "tests/docs/test_docs_trl.py",
             "constraints.md": "tests/core/test_constraints.py"}
BLOCK = re.compile(r"^(<!-- continues the block above -->\n)?```python\n(.*?)^```", flags=re.S | re.M)


def blocks(page: Path) -> list[str]:
    """The page's programs: each block, with the blocks it continues before it."""
    out = []
    for match in BLOCK.finditer(page.read_text(encoding="utf-8")):
        continues, code = match.groups()
        if continues and not out:
            raise AssertionError(f"{page.name}: its first Python block continues no block")
        out.append((out[-1] + "\n" if continues else "") + code)
    return out


PAGES = sorted(p.name for p in (ROOT / "docs").glob("*.md") if "```python" in p.read_text(encoding="utf-8"))
SNIPPETS = [(page, i, code) for page in PAGES if page not in OWN_TESTS for i, code in enumerate(blocks(ROOT / "docs"
                                                                                                       / page))]


def test_every_page_with_python_is_run_here_or_by_its_own_test():
    assert {page for page, _, _ in SNIPPETS} | set(OWN_TESTS) == set(PAGES)
    for test in OWN_TESTS.values():
        assert (ROOT / test).is_file()
    assert {"library.md", "plugins.md", "hf.md", "python.md", "policy.md", "compile.md"} <= set(PAGES)


@pytest.mark.parametrize("page, index, code", SNIPPETS, ids=[f"{p}:{i + 1}" for p, i, _ in SNIPPETS])
def test_snippet_runs(page, index, code, tmp_path):
    proc = forks.run(code, cwd=tmp_path, timeout=120)  # this checkout, one thread, the hub offline
    assert proc.returncode == 0, f"docs/{page} snippet {index + 1}:\n{code}\n{proc.stderr[-2000:]}"
