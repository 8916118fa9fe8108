"""The examples run as a user runs them: a fresh interpreter (forked from one that imported torch and twophase:
tests/forks.py), the script's command line, its printed output."""
import json
import re
import sys
from pathlib import Path

import torch

import forks

from twophase.train.decode import main as decode_main

ROOT = Path(__file__).resolve().parents[2]


def test_custom_model_example_trains_the_reward_up():
    done = forks.run(argv=[ROOT / "examples" / "custom_model.py", "--mle-steps", "5", "--steps", "30"], timeout=120)
    assert done.returncode == 0, done.stderr
    rewards = [float(x) for x in re.findall(r"^reward .*: (\d\.\d+)$", done.stdout, flags=re.M)]
    assert len(rewards) == 3, done.stdout  # before, after the MLE warm start, after RL
    before, warm, trained = rewards
    # About 0.07, 0.19, 0.38 with the default seed: the warm start and RL each raise the reward clearly.
    assert warm > before + 0.05 and trained > warm + 0.05, done.stdout


def test_task_plugin_trains_with_train_py_and_decodes(tmp_path, monkeypatch, capsys):
    """`--task module:Class` from the working directory (no PYTHONPATH for the example's own modules), a
    source-aware default reward, checkpoints, then twophase-decode rebuilding the task from the checkpoint."""
    run = forks.run(argv=[ROOT / "train.py", "--task", "reverse_task:ReverseDigits", "--mle-steps", "30",
                          "--rl-steps", "10", "--eval-every", "20",  # its recipe: the rest
                          "--save-dir", tmp_path / "run"], cwd=ROOT / "examples", timeout=300)
    assert run.returncode == 0, run.stderr
    assert "task reverse_task:ReverseDigits: 2000 train / 200 valid / 200 test" in run.stdout
    config = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=False)["config"]
    assert (config["hidden_size"], config["beam_size"], config["max_len"]) == (32, 4, 7)  # its flag_defaults
    assert "reversed exactly" in run.stdout and "reward reverse_task:reversal" in run.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] == "eval"]
    assert evals and all({"exact", "reward"} <= set(r) for r in evals)
    decode = forks.run(argv=["-m", "twophase.train.decode", "--checkpoint", tmp_path / "run" / "checkpoint_last.pt"],
                       input="1 2 3\n\n4 5\n", cwd=ROOT / "examples", timeout=120)
    assert decode.returncode == 0, decode.stderr
    lines = decode.stdout.split("\n")
    assert len(lines) == 4 and lines[1] == "" and all(set(x) <= set("01234567 ") for x in lines)
    # In this process, from another directory (the checkpoint records the task's folder): digits 8 and 9, which
    # the model has no token for, are refused naming their line.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("reverse_task", "custom_model"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "in.txt").write_text("1 2\n3 8\n")
    assert decode_main(["--checkpoint", str(tmp_path / "run" / "checkpoint_last.pt"), "--input", "in.txt"]) == 2
    assert capsys.readouterr().err == (
        "twophase-decode: error: in.txt:2: task 'reverse_task:ReverseDigits' cannot read this line (ValueError: "
        "expected digits 0-7 separated by spaces, got '8')\n")
    for name in ("reverse_task", "custom_model"):
        sys.modules.pop(name, None)


def test_forum_model_example_checks_and_trains():
    done = forks.run(argv=[ROOT / "examples" / "forum_model.py", "--steps", "10"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^step (\d+): mean reward \d\.\d+$", done.stdout, flags=re.M) == ["0", "10"], done.stdout
