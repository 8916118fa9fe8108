"""twophase.system (where and how the computation runs) sits below the trainer: no module of it imports
twophase.train, lazily (inside a function) or not, so the trainer's parts can be read and tested without it."""
import ast
from pathlib import Path

SYSTEM = Path(__file__).resolve().parents[2] / "twophase" / "system"


def _imported(path: Path) -> set[str]:
    """The absolute names of the modules `path` imports anywhere in it (relative imports resolved)."""
    package = "twophase.system"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def test_the_system_layer_imports_nothing_of_the_trainer():
    files = sorted(SYSTEM.glob("*.py"))
    assert {p.stem for p in files} >= {"devices", "amp", "memory", "profiling", "distributed", "fsdp"}
    upward = {p.name: sorted(n for n in _imported(p) if n == "twophase.train" or n.startswith("twophase.train."))
              for p in files}
    assert not any(upward.values()), upward


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself: a lazy relative import of the trainer is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..train import cli\n    from ..train.checkpoint import load\n")
    assert {"twophase.train", "twophase.train.cli", "twophase.train.checkpoint"} <= _imported(probe)
