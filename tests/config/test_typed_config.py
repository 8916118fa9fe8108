"""`twophase.Config` is a dataclass a type checker reads, as the README installs it: mypy flags a misspelt field (in
the constructor and as an attribute) and a choice that is none of a field's, and passes the right ones; an invalid
Config cannot be made (a one-line ValueError naming the field, or the flags of a contradiction), nor made invalid
by an assignment; the fields passed to the constructor or assigned are remembered, outside equality and the
record."""
import argparse
import configparser
import dataclasses
import os
import subprocess
import venv
from pathlib import Path

import pytest

import twophase
from twophase.config import Config

ROOT = Path(__file__).resolve().parents[2]

# Everything but twophase, its configuration and Result is skipped (torch, the trainer): the check takes seconds.
MYPY_INI = """[mypy]
follow_imports = skip
ignore_missing_imports = True
[mypy-twophase,twophase.config,twophase.config.*,twophase.train,twophase.train.report]
follow_imports = silent
"""

# One file, one mypy run: the right fields' lines pass, each wrong one is flagged on its line.
SNIPPET = """from pathlib import Path
import twophase
good = twophase.Config(beam_size=3, objective="policy", sampler="sbs", baseline=None)
width: int = good.beam_size
other = twophase.Config(beam_size=8)
bad = twophase.Config(beam_sise=3)
width = good.beam_sise
typo = twophase.Config(objective="reinforse")
def run_dir(result: twophase.Result) -> Path:
    return result.run_dir
def best(result: twophase.Result) -> Path | None:
    return result.best_checkpoint
"""
FLAGGED = {6: 'Unexpected keyword argument "beam_sise" for "Config"',
           7: '"Config" has no attribute "beam_sise"',
           8: 'Argument "objective" to "Config" has incompatible type "Literal[\'reinforse\']"'}


def _installed(tmp_path) -> Path:
    """A virtual environment holding twophase as the README's install line leaves it: pip's editable_mode=compat
    writes this .pth, the checkout's folder, into site-packages (an import hook, the default mode's, mypy does
    not run). mypy reads such a folder as an installed package: only with the package's py.typed."""
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(tmp_path / "venv")
    python = tmp_path / "venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "__editable__.twophase-0.1.0.pth").write_text(f"{ROOT}\n")
    return python


def _mypy(tmp_path) -> tuple[str, int]:
    api = pytest.importorskip("mypy.api")
    python = _installed(tmp_path)
    work = tmp_path / "work"  # no twophase beside the snippet, nor on MYPYPATH: only the installed one
    work.mkdir()
    (work / "mypy.ini").write_text(MYPY_INI)
    (work / "snippet.py").write_text(SNIPPET)
    old = os.environ.pop("MYPYPATH", None)
    cwd = os.getcwd()
    try:
        os.chdir(work)
        out, err, status = api.run(["--config-file", "mypy.ini", "--no-incremental", "--cache-dir", os.devnull,
                                    "--python-executable", str(python), "snippet.py"])
    finally:
        os.chdir(cwd)
        if old is not None:
            os.environ["MYPYPATH"] = old
    return out + err, status


def test_mypy_on_the_installed_package_flags_wrong_fields_and_passes_the_right_ones(tmp_path):
    out, status = _mypy(tmp_path)
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert status == 1 and len(errors) == len(FLAGGED), out
    for error, (line, text) in zip(errors, FLAGGED.items()):
        assert error.startswith(f"snippet.py:{line}: ") and text in error, out


def test_the_readme_installs_what_mypy_follows_and_ships_py_typed():
    """The install line the test above stands for is the README's and CI's, and a regular install ships
    py.typed (setup.cfg's package_data)."""
    line = 'pip install "torch==2.13.0" -e ".[test,hf,bench]" --config-settings editable_mode=compat'
    assert line in (ROOT / "README.md").read_text()
    assert line.replace("pip install", "pip install --quiet") in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "twophase" / "py.typed").is_file()
    options = configparser.ConfigParser()
    options.read(ROOT / "setup.cfg")
    assert options["options.package_data"]["twophase"].split() == ["py.typed"]


def test_every_fields_help_is_the_docstring_editors_show():
    """An editor shows a field's help on hover from the docstring written after it (as pyright and Pylance read
    attribute docstrings); --help prints that very text."""
    import ast
    import inspect
    from twophase.config import SECTIONS, add_config_flags
    helps = {}
    for cls in SECTIONS.values():
        body = ast.parse(inspect.getsource(inspect.getmodule(cls))).body
        [node] = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
        for field, after in zip(node.body, node.body[1:] + [None]):
            if isinstance(field, ast.AnnAssign):
                assert isinstance(after, ast.Expr) and isinstance(after.value.value, str), field.target.id
                helps[field.target.id] = " ".join(after.value.value.split())
    assert set(helps) == {f.name for f in dataclasses.fields(Config)}
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    for action in parser._actions[1:]:
        name = action.dest
        assert action.help.replace("%%", "%").startswith(helps[name]), name


@pytest.mark.parametrize("values, line", [
    (dict(lr=-1.0), "Config.lr: must be >= 0.0, got -1.0"),
    (dict(top_p=1.5), "--top-p must be in (0, 1], got 1.5"),
    (dict(dropout=2.0), "Config.dropout: must be in [0, 1), got 2"),
    (dict(dropout=1.0), "Config.dropout: must be in [0, 1), got 1"),  # every unit dropped: nothing learns
    (dict(beam_size="8"), 'Config.beam_size: expected an integer, got "8"'),
    (dict(sampler="greedy"), 'Config.sampler: expected one of beam, sample, sbs, got "greedy"'),
    (dict(train="t.tsv"), "--train and --valid go together"),  # a contradiction across fields
    (dict(kl_beta=0.1), "--kl-beta applies to --objective policy only, not --objective beam"),
])
def test_an_invalid_config_cannot_be_made(values, line):
    with pytest.raises(ValueError) as info:
        Config(**values)
    assert str(info.value) == line and "\n" not in str(info.value)


def test_a_valid_config_is_made_as_given():
    cfg = Config(lr=1, dropout=0.5, train=Path("t.tsv"), valid="v.tsv")
    assert (cfg.lr, type(cfg.lr), cfg.dropout, cfg.train) == (1.0, float, 0.5, "t.tsv")


def test_the_fields_passed_are_remembered_outside_equality_and_the_record():
    a, b = Config(lr_decay=1.0, beam_size=8), Config()
    assert a.given() == {"lr_decay", "beam_size"} and b.given() == frozenset()
    assert a == b and dataclasses.asdict(a) == dataclasses.asdict(b)  # both are the defaults
    assert "given" not in repr(a) and "_given" not in dataclasses.asdict(a)
    assert dataclasses.replace(a, lr=0.1).given() == {f.name for f in dataclasses.fields(Config)}


def test_an_assigned_field_is_checked_and_counts_as_given():
    """`cfg.beam_size = 4` after construction is the user's, as a constructor keyword is: fit runs with it, even
    where it equals Config's default and the task's recipe says otherwise (countdown's, the default task's, 2,000 MLE steps)."""
    from twophase.train.fit import resolved
    cfg = Config(beam_size=3)
    cfg.beam_size, cfg.lr, cfg.mle_steps = 4, 0.05, Config().mle_steps
    assert cfg.given() == {"beam_size", "lr", "mle_steps"}
    run, _, _ = resolved(cfg)
    assert (run.beam_size, run.lr, run.mle_steps) == (4, 0.05, 4000)
    assert resolved(Config())[0].mle_steps == 2000  # the recipe's, where the field was not set
    cfg.beam_size = 1  # valid alone; the checks across fields run where the Config is used
    with pytest.raises(ValueError, match="--beam-size 1 with --objective beam trains nothing"):
        resolved(cfg)


@pytest.mark.parametrize("name, value, line", [
    ("lr", float("nan"), "Config.lr: expected a finite number, got nan"),
    ("beam_size", 0, "Config.beam_size: must be >= 1, got 0"),
    ("beam_size", 4.0, "Config.beam_size: expected an integer, got 4.0"),
    ("sampler", "greedy", 'Config.sampler: expected one of beam, sample, sbs, got "greedy"'),
])
def test_an_invalid_assignment_is_refused_and_changes_nothing(name, value, line):
    cfg = Config()
    with pytest.raises(ValueError) as info:
        setattr(cfg, name, value)
    assert str(info.value) == line
    assert cfg == Config() and cfg.given() == frozenset()


def test_a_misspelt_assignment_is_refused():
    cfg = Config()
    with pytest.raises(AttributeError, match="Config has no field 'beam_sise'"):
        cfg.beam_sise = 4


def test_twophase_config_is_the_config():
    assert twophase.Config is Config
