"""The house's layout: the import graph of twophase and of the checkout's benchmarks/ and tools/ (lazy,
function-level imports included) has no circle and no import back up a layer; the package installs no import
hook, and what it installs is twophase/ alone.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
ROOT = CHECKOUT / "twophase"
OUTSIDE = ("benchmarks", "tools")  # run from a checkout, above the package; never installed

# The layers, lowest first. Each entry is a group: a folder of twophase, a single module named here, or the core
# (CORE: every other module directly in twophase/). A module may import its own group and any group of a lower
# layer; the groups of one layer never import each other (phase one and phase two meet only in the core, through
# the protocol and `Samples`). The package's own __init__ (FRONT) re-exports from every layer: it sits above them
# all, so no module imports it.
CORE, FRONT = "core", "twophase"
LAYERS = (
    (CORE,),  # errors, protocol, samples, nested, owners, blocks, oom, vocab, plugins, constraints, compiling, plot
    ("twophase.phase1", "twophase.phase2", "twophase.rewards"),
    ("twophase.objectives", "twophase.modelcheck"),  # estimators read phase one's SBS; check_model runs a search
    ("twophase.system",),
    ("twophase.config",),  # the run's sections and flags: imports only the core's errors
    ("twophase.models",),
    ("twophase.tasks",),
    ("twophase.train",),
    (FRONT,),
    ("benchmarks",),  # the benchmarks and the GPU check use the package as a user does
    ("tools",),  # the developer's tools (tools.beforeafter times benchmarks' steps)
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(CHECKOUT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, tuple[str, bool]]:
    """Every module of twophase, benchmarks and tools: its source and whether it is a package's __init__."""
    paths = [p for top in ("twophase", *OUTSIDE) for p in (CHECKOUT / top).rglob("*.py")]
    return {_module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in paths}


def _imports(name: str, source: str, is_package: bool, modules: set[str]) -> dict[str, int]:
    """The modules of `modules` that `name` imports anywhere in it, each with a line that imports it (a name
    imported from a package that is a module of its own counts as that module)."""
    package = name if is_package else name.rpartition(".")[0]
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names]
            targets = [t if t in modules else base for t in targets]
        else:
            continue
        for target in targets:
            found.setdefault(target, node.lineno)
    return {m: line for m, line in found.items() if m in modules and m != name}


def _graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    modules = set(sources)
    return {name: _imports(name, text, is_package, modules) for name, (text, is_package) in sources.items()}


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle of `graph`, or None (depth-first search for a back edge)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _group(module: str, packages: set[str]) -> str:
    """The group `module` belongs to (see LAYERS)."""
    if module in {g for layer in LAYERS for g in layer}:
        return module
    parts = module.split(".")
    if parts[0] in OUTSIDE:
        return parts[0]
    if len(parts) > 2 or module in packages:
        return ".".join(parts[:2])
    return CORE


def _layer(group: str) -> int:
    for i, layer in enumerate(LAYERS):
        if group in layer:
            return i
    raise AssertionError(f"{group} is in no layer: add it to LAYERS in tests/core/test_layout.py")


def _wrong_way(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import that goes up a layer, or sideways to another group of its own layer, one line each."""
    packages = {name for name, (_, is_package) in sources.items() if is_package}
    found = []
    for module, imported in sorted(_graph(sources).items()):
        mine = _group(module, packages)
        for target, line in sorted(imported.items()):
            theirs = _group(target, packages)
            if theirs != mine and _layer(theirs) >= _layer(mine):
                way = "up" if _layer(theirs) > _layer(mine) else "sideways"
                found.append(f"{module}:{line} imports {target} ({way}: {mine} -> {theirs})")
    return found


def test_no_import_circles():
    graph = _graph(_sources())
    assert "twophase.tasks.text" in graph["twophase.tasks.hf"]  # the graph sees imports at all
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_import_goes_back_up_a_layer():
    assert "twophase.phase1.search" in _graph(_sources())["twophase.modelcheck"]  # imports across folders seen
    assert _wrong_way(_sources()) == []


@pytest.mark.parametrize("module, source, expected", [
    ("twophase.phase1.probe", "from ..train import cli\n", "1 imports twophase.train.cli (up: twophase.phase1 -> "
                                                           "twophase.train)"),
    ("twophase.probe", "import torch\n\n\ndef f():\n    from .phase2.rescoring import rescore_backward\n",
     "5 imports twophase.phase2.rescoring (up: core -> twophase.phase2)"),
    ("twophase.train.probe", "from benchmarks import hostsyncs\n",
     "1 imports benchmarks.hostsyncs (up: twophase.train -> benchmarks)"),
    ("benchmarks.probe", "from tools import beforeafter\n", "1 imports tools.beforeafter (up: benchmarks -> tools)"),
    ("twophase.phase2.probe", "from ..phase1 import search\n",
     "1 imports twophase.phase1.search (sideways: twophase.phase2 -> twophase.phase1)"),
    ("twophase.models.probe", "from twophase import Samples\n", "1 imports twophase (up: twophase.models -> twophase)"),
])
def test_an_import_the_wrong_way_is_found(module, source, expected):
    sources = dict(_sources(), **{module: (source, False)})
    assert _wrong_way(sources) == [f"{module}:{expected}"]


def test_a_circle_is_found():
    sources = _sources()
    sources["twophase.nested"] = (sources["twophase.nested"][0] + "\nfrom . import protocol\n", False)
    cycle = _cycle(_graph(sources))  # the circle, from whichever of its modules the search met first
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["twophase.nested", "twophase.protocol"], cycle


def test_the_package_installs_no_import_hook_and_the_old_paths_are_gone():
    """`import twophase` leaves sys.meta_path as it was, and a module path of an earlier layout is an ImportError
    (nothing answers for it), whatever was imported before."""
    code = ("import importlib, sys\n"
            # an editable install's finder (of this checkout or another) answers for its own files: set aside
            "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
            "before = list(sys.meta_path)\n"
            "import twophase, twophase.config, twophase.train.cli\n"
            "assert sys.meta_path == before, sys.meta_path\n"
            "for old in ('twophase.search', 'twophase.rescoring', 'twophase.policy', 'twophase.train.amp',\n"
            "            'twophase.bench', 'twophase.bench.gpu'):\n"
            "    try:\n"
            "        importlib.import_module(old)\n"
            "    except ImportError:\n"
            "        continue\n"
            "    raise AssertionError(old)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=CHECKOUT.parent,
                         env=dict(os.environ, PYTHONPATH=str(CHECKOUT)))
    assert run.returncode == 0, run.stderr


def test_the_package_finds_twophase_alone():
    """setup.cfg's `packages = find:` with `include = twophase*`: the wheel and the sdist's package list carry
    twophase and its subpackages, never benchmarks/ or tools/ (what setuptools itself finds, from setup.cfg)."""
    import configparser

    from setuptools import find_packages
    cfg = configparser.ConfigParser()
    cfg.read(CHECKOUT / "setup.cfg")
    assert cfg["options"]["packages"].strip() == "find:"
    include = cfg["options.packages.find"]["include"].split()
    found = find_packages(str(CHECKOUT), include=include)
    assert "twophase" in found and "twophase.phase1" in found and "twophase.models.hf" in found
    assert not [p for p in found if not p.startswith("twophase")], found
    assert not [p for p in found if p.startswith("twophase.bench")], found
    for top in OUTSIDE:
        assert (CHECKOUT / top / "__init__.py").exists()  # importable from a checkout, yet not found above


def test_the_layout_page_names_every_core_module():
    page = (ROOT.parent / "docs" / "layout.md").read_text(encoding="utf-8")
    core = [p for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    core += [p for d in ("phase1", "phase2", "objectives", "rewards") for p in (ROOT / d).glob("*.py")
             if p.name != "__init__.py"]
    for path in core:
        assert f"| `{path.relative_to(ROOT).as_posix()}` |" in page, path
