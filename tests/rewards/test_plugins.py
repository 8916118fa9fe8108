"""`module:callable` specs are found on sys.path and, failing that, in the working directory (as `python -m` does),
which is appended after installed packages so it never shadows them."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from twophase import plugins, rewards
from twophase.plugins import PluginError


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory that is not on sys.path (as in `twophase-train` run from a project folder);
    sys.path and the modules imported from it are restored afterwards."""
    cwd = tmp_path / "project"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    # '' and '.' would put the new working directory on sys.path already, which is what the fallback supplies.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != cwd])
    before = set(sys.modules)
    yield cwd
    for name in set(sys.modules) - before:
        if name.startswith("tp_cwd"):
            del sys.modules[name]


def test_reward_module_in_the_working_directory(workdir: Path, tmp_path: Path) -> None:
    (workdir / "tp_cwd_reward.py").write_text(
        "def fn(hyps, refs):\n"
        "    import tp_cwd_helper  # a neighbour imported at call time, after the working directory changed\n"
        "    return [tp_cwd_helper.VALUE] * len(hyps)\n")
    (workdir / "tp_cwd_helper.py").write_text("VALUE = 0.25\n")
    reward = rewards.get("tp_cwd_reward:fn")
    assert sys.path[-1] == str(workdir)  # appended: installed modules come first
    os.chdir(tmp_path)
    assert reward(["a", "b"], [["a"], ["b"]]) == [0.25, 0.25]


def test_package_in_the_working_directory(workdir: Path) -> None:
    (workdir / "tp_cwd_pkg").mkdir()
    (workdir / "tp_cwd_pkg" / "__init__.py").write_text("")
    (workdir / "tp_cwd_pkg" / "scores.py").write_text("class Holder:\n    VALUE = 7\n")
    assert plugins.load_spec("tp_cwd_pkg.scores:Holder.VALUE", "task") == 7


def test_installed_module_wins_over_the_working_directory(workdir: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "tp_cwd_both.py").write_text("WHERE = 'site'\n")
    (workdir / "tp_cwd_both.py").write_text("WHERE = 'cwd'\n")
    sys.path.insert(0, str(site))
    path = list(sys.path)
    assert plugins.load_spec("tp_cwd_both:WHERE", "reward") == "site"
    assert sys.path == path  # found without the fallback: sys.path untouched


def test_missing_everywhere_leaves_sys_path_alone(workdir: Path) -> None:
    path = list(sys.path)
    with pytest.raises(PluginError) as info:
        plugins.load_spec("tp_cwd_nowhere:fn", "task")
    assert str(info.value) == ("task 'tp_cwd_nowhere:fn': cannot import module 'tp_cwd_nowhere' "
                               "(ModuleNotFoundError: No module named 'tp_cwd_nowhere')")
    assert sys.path == path


def test_a_missing_dependency_is_named(workdir: Path) -> None:
    """The module is found in the working directory; what it imports is not: that is the error to report."""
    (workdir / "tp_cwd_dep.py").write_text("import tp_cwd_not_installed\n")
    with pytest.raises(rewards.RewardError) as info:
        rewards.get("tp_cwd_dep:fn")
    assert str(info.value) == ("reward 'tp_cwd_dep:fn': cannot import module 'tp_cwd_dep' "
                               f"({workdir / 'tp_cwd_dep.py'}:1: ModuleNotFoundError: No module named "
                               "'tp_cwd_not_installed')")


@pytest.mark.parametrize("text, line, error", [
    ("X = 1\ndef broken(:\n", 2, "SyntaxError"),
    ("import os\n\nVALUE = 1 / 0\n", 3, "ZeroDivisionError: division by zero"),
    ("import json\nDATA = json.loads('{oops')\n", 2, "JSONDecodeError"),  # raised inside the library: the user's line
])
def test_an_import_error_of_a_plugin_names_its_file_and_line(workdir: Path, text, line, error) -> None:
    (workdir / "tp_cwd_bad.py").write_text(text)
    with pytest.raises(PluginError) as info:
        plugins.load_spec("tp_cwd_bad:fn", "task")
    assert f"({workdir / 'tp_cwd_bad.py'}:{line}: {error}" in str(info.value)


@pytest.mark.parametrize("spec", ["no_colon", ":fn", "mod:"])
def test_malformed_spec_names_the_kind(spec: str) -> None:
    with pytest.raises(PluginError, match=rf"^task '{spec}': expected 'package.module:callable'$"):
        plugins.load_spec(spec, "task")
