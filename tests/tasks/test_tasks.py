"""--task resolution: module:callable (from the working directory too), entry points, built-ins, and one-line
errors for tasks that cannot be found, raise, or lack the Task methods."""
import importlib.metadata

import pytest

from twophase import tasks
from twophase.tasks.countdown.task import Countdown
from twophase.tasks.text import G2P, TSV
from twophase.train import cli
from twophase.config import Config


def test_builtins_and_defaults():
    assert tasks.default_name(Config()) == "countdown" and tasks.default_name(Config(train="a", valid="b")) == "tsv"
    assert isinstance(tasks.build(Config()), Countdown) and isinstance(tasks.build(Config(task="g2p")), G2P)
    assert isinstance(tasks.build(Config(train="a", valid="b")), TSV)
    assert {"countdown", "g2p", "tsv"} <= set(tasks.available())


def test_a_module_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mytask_mod.py").write_text(
        "from twophase.tasks.text import G2P\n\nclass Mine(G2P):\n    name = 'mine'\n")
    monkeypatch.chdir(tmp_path)
    task = tasks.build(Config(task="mytask_mod:Mine"))
    assert task.name == "mine" and task.spec == "mytask_mod:Mine"


def test_an_entry_point(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="g2p-again", value="twophase.tasks.text:G2P", group=tasks.GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [ep] if group == tasks.GROUP else [])
    assert isinstance(tasks.build(Config(task="g2p-again")), G2P)


@pytest.mark.parametrize("spec, message", [
    ("nosuchtask", "unknown task 'nosuchtask'; available: "),
    ("no_such_module_xyz:Task", "task 'no_such_module_xyz:Task': cannot import module"),
    ("twophase.tasks.text:Nope", "has no attribute 'Nope'"),
    ("twophase.tasks.text:G2P.name", "str object is not callable"),
    ("builtins:dict", "task 'builtins:dict' raised TypeError"),
    ("builtins:vars", "returned a dict without load_data, state_dict"),
])
def test_bad_tasks_fail_in_one_line(spec, message, capsys, tmp_path):
    assert cli.main(["--task", spec, "--save-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("train.py: error: ")


def test_g2p_refuses_files(capsys, tmp_path):
    assert cli.main(["--task", "g2p", "--train", "a.tsv", "--valid", "b.tsv", "--save-dir", str(tmp_path)]) == 2
    assert "--task g2p has its own data" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", ["tsv", "jsonl"])
def test_a_reference_longer_than_max_len_names_the_flag_and_its_eos(tmp_path, suffix):
    from twophase.tasks.data import DataError

    for split in ("train", "valid"):
        (tmp_path / f"{split}.{suffix}").write_text(
            "a b\tx\n" if suffix == "tsv" else '{"prompt": "a b", "completion": "x"}\n', encoding="utf-8")
    task = tasks.build(Config(train=str(tmp_path / f"train.{suffix}"), valid=str(tmp_path / f"valid.{suffix}"),
                              max_len=1))
    with pytest.raises(DataError, match=r"train\.\w+:1: target has 1 tokens, more than --max-len 1 allows \(0 "
                                        r"tokens and the EOS\)$"):
        task.load_data()
    task = tasks.build(Config(train=str(tmp_path / f"train.{suffix}"), valid=str(tmp_path / f"valid.{suffix}"),
                              max_src_len=1))
    with pytest.raises(DataError, match=r"train\.\w+:1: source has 2 tokens, more than --max-src-len 1$"):
        task.load_data()
