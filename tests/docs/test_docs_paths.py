"""Every dotted `twophase.…` path README.md and docs/ teach, in code blocks and inline code, names what it says:
a module of the package (its file exists) and then attributes of it, never an alias of a module that moved."""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"^```[^\n]*\n(.*?)^```|`([^`\n]+)`", flags=re.S | re.M)
DOTTED = re.compile(r"(?<![\w.])twophase(?:\.[A-Za-z_]\w*)+")


# A table of old paths and their new ones (docs/layout.md) teaches the new ones; the old ones are history.
OLD_PATHS = re.compile(r"^\| old path \|.*\n(?:\|.*\n)*", flags=re.M)
ALIASES = re.compile(r"^\| `_moved\.py` \|.*\n", flags=re.M)  # the row of the module that keeps old paths alive


def taught(page: Path) -> list[str]:
    text = ALIASES.sub("", OLD_PATHS.sub("", page.read_text(encoding="utf-8")))
    return sorted({path for block in CODE.finditer(text) for path in DOTTED.findall(block.group(1) or block.group(2))})


PATHS = [(page.relative_to(ROOT).as_posix(), path) for page in PAGES for path in taught(page)
         if len(path.rpartition(".")[2]) > 1]  # `module.x`: a placeholder for any attribute


def module_file(parts: list[str]) -> bool:
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def resolves(path: str) -> bool:
    parts = path.split(".")
    k = max(n for n in range(1, len(parts) + 1) if module_file(parts[:n]))  # the longest module with a file
    obj = importlib.import_module(".".join(parts[:k]))
    for depth, name in enumerate(parts[k:], start=k + 1):
        obj = getattr(obj, name, None)
        if obj is None:
            return False
        if hasattr(obj, "__spec__") and type(obj).__name__ == "module" and obj.__name__ != ".".join(parts[:depth]):
            return False  # an alias of a module kept under its old name
    return True


def test_the_pages_teach_module_paths():
    assert len(PATHS) > 20


@pytest.mark.parametrize("page, path", PATHS, ids=[f"{p}:{m}" for p, m in PATHS])
def test_a_taught_path_imports_as_written(page, path):
    assert resolves(path), f"{page} teaches {path}, which is no module of twophase (nor an attribute of one)"
