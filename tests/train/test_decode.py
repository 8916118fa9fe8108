"""twophase-decode on a custom task: lines the task cannot read or collate are one line naming FILE:LINE, a
plug-in task decodes from any directory (the checkpoint records its folder, or the error says where to run),
and --nbest K --scores writes the beam's K best with their log-probabilities."""
import shutil
import sys
from pathlib import Path

import pytest
import torch

from twophase.train import cli, decode
from twophase.train.checkpoint import load

from test_cli import _fails_with_one_line
from test_start import VERIFIER

PLUGIN = "mytask"  # a copy of verifier_task under a module name nothing else imports
HERE = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A verifier task trained (RL only, 2 steps) from its own folder, as a user would; then that folder is off
    sys.path again and the module forgotten."""
    root = tmp_path_factory.mktemp("decode")
    plug = root / "plug"
    plug.mkdir()
    source = (HERE / "verifier_task.py").read_text().replace("verifier_task:", f"{PLUGIN}:")
    (plug / f"{PLUGIN}.py").write_text(source)
    path = list(sys.path)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(plug)
        argv = [*VERIFIER, "--mle-steps", "0", "--rl-steps", "2", "--save-dir", str(root / "run")]
        argv[1] = f"{PLUGIN}:Verifier"
        assert cli.main(argv) == 0
    sys.path[:] = path
    sys.modules.pop(PLUGIN, None)
    (root / "in.txt").write_text("1 2\n\n3\n")
    return root


def test_a_plugin_task_decodes_from_any_directory(run, monkeypatch, capsys):
    monkeypatch.chdir(run)  # not the plug-in's folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    state = load(run / "run" / "checkpoint_last.pt")
    assert state["task"]["origin"] == str(run / "plug")
    assert decode.main(["--checkpoint", str(run / "run" / "checkpoint_last.pt"), "--input", "in.txt"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 4 and out[1] == "" and all(set(line.split()) <= set("0123") for line in out)
    sys.modules.pop(PLUGIN, None)


def test_a_moved_plugin_is_an_error_that_says_where_to_run(run, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    shutil.copy(run / "run" / "checkpoint_last.pt", tmp_path / "c.pt")
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    state["task"]["origin"] = str(tmp_path / "gone")
    torch.save(state, tmp_path / "c.pt")
    _fails_with_one_line(["--checkpoint", "c.pt", "--input", str(run / "in.txt")], capsys,
                         f"it was trained from {tmp_path / 'gone'}: run twophase-decode there", entry=decode.main)


def test_lines_the_task_cannot_collate_name_their_line(run, monkeypatch, capsys):
    """The task's collate raises on a letter (int('x')): the failing line is found and named."""
    monkeypatch.syspath_prepend(str(run / "plug"))
    (run / "bad.txt").write_text("1 2\n3\n1 x\n")
    _fails_with_one_line(["--checkpoint", str(run / "run" / "checkpoint_last.pt"), "--input", str(run / "bad.txt")],
                         capsys, "bad.txt:3: task 'mytask:Verifier' cannot decode this source (ValueError: invalid "
                         "literal for int()", entry=decode.main)
    sys.modules.pop(PLUGIN, None)


def test_nbest_with_scores(run, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(run / "plug"))
    ckpt = str(run / "run" / "checkpoint_last.pt")
    assert decode.main(["--checkpoint", ckpt, "--input", str(run / "in.txt"), "--beam-size", "3", "--nbest", "3",
                        "--scores"]) == 0
    lines = capsys.readouterr().out.split("\n")[:-1]
    assert len(lines) == 9 and lines[3:6] == [""] * 3  # 3 per input line; the blank line's are empty, no score
    for block in (lines[0:3], lines[6:9]):
        scores = [float(line.split("\t")[0]) for line in block]
        assert scores == sorted(scores, reverse=True) and all(s <= 0 for s in scores)
    assert decode.main(["--checkpoint", ckpt, "--input", str(run / "in.txt"), "--beam-size", "3"]) == 0
    best = capsys.readouterr().out.split("\n")
    assert [best[0], best[2]] == [lines[0].split("\t")[1], lines[6].split("\t")[1]]  # --nbest 1's lines
    assert decode.main(["--checkpoint", ckpt, "--input", str(run / "in.txt"), "--beam-size", "3", "--scores"]) == 0
    scored = capsys.readouterr().out.split("\n")
    assert scored[1] == "" and scored[0] == lines[0] and scored[2] == lines[6]  # a blank line is not decoded
    _fails_with_one_line(["--checkpoint", ckpt, "--nbest", "4", "--beam-size", "3"], capsys,
                         "--nbest 4: the beam holds --beam-size 3", entry=decode.main)
    sys.modules.pop(PLUGIN, None)


def test_tsv_lines_longer_than_training_allowed_are_refused():
    from twophase import tasks
    from twophase.config import Config
    task = tasks.build(Config(train="t.tsv", valid="v.tsv", max_src_len=3))
    assert task.source_problem("a b c", 8) is None
    assert task.source_problem("a b c d", 8) == "source has 4 tokens, more than the training limit of --max-src-len 3"


def test_init_from_a_plugin_run_finds_its_module_from_any_directory(run, monkeypatch, tmp_path, capsys):
    """--init-from (and --resume) import the task's module from the folder training found it in, as decoding."""
    monkeypatch.chdir(tmp_path)  # not the plug-in's folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop(PLUGIN, None)
    assert cli.main(["--init-from", str(run / "run" / "checkpoint_last.pt"), "--save-dir", str(tmp_path / "next"),
                     "--mle-steps", "0", "--rl-steps", "1"]) == 0
    assert load(tmp_path / "next" / "checkpoint_last.pt")["config"]["task"] == f"{PLUGIN}:Verifier"
    sys.modules.pop(PLUGIN, None)
