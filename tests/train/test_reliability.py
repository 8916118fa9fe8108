"""Exact resume, clean stops on signals, non-finite steps, and plug-in failures named in one line."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from twophase.train import cli, recipe
from twophase.train.steps import parts as parts_module
from twophase.config import Config
from twophase.train.runstate import Interrupted

import forks
import guards
from taskfiles import task_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size", "3",
        "--rescore-chunk", "5", "--max-len", "8", "--eval-every", "4", "--dropout", "0.1", "--save-every", "3"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 200, 12)


def _train(task, save, *flags, popen=False):
    cmd = [sys.executable, str(ROOT / "train.py"), "--train", str(task / "train.tsv"), "--valid",
           str(task / "valid.tsv"), "--save-dir", str(save), *TINY, *flags]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = forks.run(argv=cmd[1:], timeout=120)  # a fresh interpreter, forked from one that imported torch
    assert proc.returncode == 0, proc.stderr
    return proc


def _train_here(task, save, *flags):
    """_train's run in this process (train.py's main; `--deterministic`'s global mode restored after): a run that
    goes on from, or is compared with, one in a fresh process saves that process's start-up each time."""
    argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(save), *TINY,
            *flags]
    with guards.deterministic_algorithms():
        assert cli.main(argv) == 0


def _params(path):
    return torch.load(path, weights_only=True)["model"]


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_is_bit_identical_with_sampling(task, tmp_path, one_thread):
    # under deterministic algorithms (--deterministic): no op of a whole run refuses to run, resumed or not
    flags = ["--sampler", "sample", "--objective", "reinforce", "--baseline", "loo", "--mle-weight", "0.2",
             "--deterministic", "--compare-mle"]
    # the whole run in a fresh process, its pieces in this one: the resumed run is the same in another process
    # (both on one thread, as the fork server's children run: another count sums in another order)
    _train(task, tmp_path / "full", "--mle-steps", "6", "--rl-steps", "6", *flags)
    part = tmp_path / "part"
    _train_here(task, part, "--mle-steps", "3", "--rl-steps", "0", *flags)  # stopped inside the warm start
    _train_here(task, part, "--mle-steps", "6", "--rl-steps", "2", "--resume", *flags)  # ... and inside RL
    _train_here(task, part, "--mle-steps", "6", "--rl-steps", "6", "--resume", *flags)
    _assert_identical(_params(part / "checkpoint_last.pt"), _params(tmp_path / "full" / "checkpoint_last.pt"))
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] in ("mle", "rl")] == list(range(1, 13))
    # the comparison after the shorter RL phase went with it; the one after the full RL phase is numbered from
    # its branch point, the end of MLE at step 6
    continued = [r["step"] for r in rows if r["phase"] == "mle-continued"]
    assert continued == list(range(7, 7 + len(continued))) and continued


def test_resume_is_bit_identical_with_beam(task, tmp_path, one_thread):
    _train(task, tmp_path / "full", "--mle-steps", "4", "--rl-steps", "5")  # in a fresh process, as above
    _train_here(task, tmp_path / "part", "--mle-steps", "4", "--rl-steps", "2")
    _train_here(task, tmp_path / "part", "--mle-steps", "4", "--rl-steps", "5", "--resume")
    _assert_identical(_params(tmp_path / "part" / "checkpoint_last.pt"),
                      _params(tmp_path / "full" / "checkpoint_last.pt"))


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_finishes_the_step_saves_and_exits(task, tmp_path, capsys, signum, code):
    save = tmp_path / "run"
    proc = _train(task, save, "--mle-steps", "100000", "--rl-steps", "0", popen=True)
    metrics = save / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.1)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    last = [json.loads(x) for x in metrics.read_text().splitlines()][-1]
    assert state["step"] == last["step"] >= 2  # the step in flight was finished and saved
    capsys.readouterr()
    _train_here(task, save, "--mle-steps", str(state["step"] + 2), "--rl-steps", "1", "--resume", "--compare-mle")
    resumed = capsys.readouterr().out
    assert "end of MLE" in resumed and "MLE continued" in resumed


def _tiny_trainer(task, tmp_path, **overrides):
    cfg = Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=16, embed_dim=8,
                 batch_size=4, mle_batch_size=8, beam_size=3, rescore_chunk=5, max_len=8, save_dir=str(tmp_path),
                 **overrides)
    return recipe.setup(cfg)


def test_non_finite_steps_are_skipped_then_stop_the_run(task, tmp_path, monkeypatch):
    tr = _tiny_trainer(task, tmp_path, mle_steps=10, rl_steps=0, max_bad_steps=2)
    real = parts_module.rescore_backward
    poisoned = {"on": False}

    def rescore(*args, **kwargs):
        loss = real(*args, **kwargs)
        if poisoned["on"]:
            next(tr.trainer.model.parameters()).grad.view(-1)[0] = float("inf")
        return loss

    monkeypatch.setattr(parts_module, "rescore_backward", rescore)
    tr.train_step("mle")
    tr.state.step += 1
    before = {k: v.clone() for k, v in tr.trainer.model.state_dict().items()}
    poisoned["on"] = True
    for _ in range(2):
        row = tr.train_step("mle")
        tr.state.step += 1
        assert row["skipped"] == 1
    _assert_identical(tr.trainer.model.state_dict(), before)  # skipped steps leave the parameters alone
    with pytest.raises(Interrupted) as stop:
        tr.train_step("mle")
    assert stop.value.code == 3 and "checkpoint_crash.pt" in str(stop.value)
    _assert_identical(torch.load(tmp_path / "checkpoint_crash.pt", weights_only=True)["model"], before)


def _plugin(tmp_path, monkeypatch, body: str) -> str:
    """A reward module written into tmp_path: `module:score`, with `calls` counting its calls."""
    module = f"myreward_{abs(hash(body))}"  # a fresh module per case: imports are cached
    (tmp_path / f"{module}.py").write_text(f"calls = 0\n\ndef score(h, r):\n    global calls\n    calls += 1\n"
                                           f"    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}:score"


@pytest.mark.parametrize("body,match", [
    ("raise RuntimeError('boom')", "raised RuntimeError: boom"),
    ("return [0.5]", "returned 1 values for"),
    ("return [float('nan')] * len(h)", "non-finite"),
])
def test_bad_reward_plugin_stops_the_run_at_start_up(task, tmp_path, monkeypatch, capsys, body, match):
    spec = _plugin(tmp_path, monkeypatch, body)
    argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(tmp_path / "r"),
            "--reward", spec, *TINY, "--mle-steps", "3", "--rl-steps", "1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert spec in err and match in err and "start-up check" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()  # before any step: nothing written


# Calls: 1 the start-up check, 2 validation after the warm start (step 2), 3-5 RL steps 3-5, 6 the last validation.
@pytest.mark.parametrize("fails_at,step", [(3, 2), (6, 5)])
def test_reward_failing_later_saves_the_steps_taken(task, tmp_path, monkeypatch, capsys, fails_at, step):
    spec = _plugin(tmp_path, monkeypatch, f"if calls >= {fails_at}:\n        raise ValueError('worn out')\n"
                                          "    return [0.5] * len(h)")
    argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(tmp_path / "r"),
            "--reward", spec, *TINY, "--mle-steps", "2", "--rl-steps", "3", "--save-every", "100",
            "--eval-every", "100"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "raised ValueError: worn out" in err and f"after step {step}; saved" in err, err
    assert len(err.strip().splitlines()) == 1
    assert torch.load(tmp_path / "r" / "checkpoint_last.pt", weights_only=True)["step"] == step


@pytest.mark.parametrize("content,match", [(b"", "no data"), (b"a b\t\xff\xfe\n", ":1: not valid UTF-8"),
                                           (b"a\tb\n\tc\n", ":2: empty source")])
def test_bad_files_exit_2_naming_the_file(tmp_path, capsys, content, match):
    (tmp_path / "t.tsv").write_bytes(content)
    argv = ["--train", str(tmp_path / "t.tsv"), "--valid", str(tmp_path / "t.tsv"), "--save-dir", str(tmp_path / "r")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 't.tsv'}" in err and match in err and len(err.strip().splitlines()) == 1


def test_resume_without_checkpoint_or_with_other_model_is_refused(task, tmp_path, capsys):
    argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(tmp_path)]
    assert cli.main(argv + ["--resume"]) == 2
    assert "--resume" in capsys.readouterr().err
    _train_here(task, tmp_path, "--mle-steps", "1", "--rl-steps", "0")
    capsys.readouterr()
    assert cli.main(argv + [*TINY, "--resume", "--hidden-size", "32"]) == 2
    assert "--hidden-size 16" in capsys.readouterr().err


def test_out_of_memory_outside_phase_two_skips_the_batch(task, tmp_path, monkeypatch, capsys):
    tr = _tiny_trainer(task, tmp_path, mle_steps=2, rl_steps=3)
    real = tr.trainer.rl_step
    calls = {"n": 0}

    def rl_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.cuda.OutOfMemoryError("injected")
        return real()

    monkeypatch.setattr(tr.trainer, "rl_step", rl_step)
    summary = tr.train()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r.get("out_of_memory", 0) for r in rl] == [0, 1, 0] and rl[1]["skipped"] == 1 and rl[1]["loss"] is None
    assert summary["rl"]["skipped"] == 1 and summary["rl"]["reward_mean"] == pytest.approx(
        (rl[0]["reward_mean"] + rl[2]["reward_mean"]) / 2)
    assert "step 4 [rl]: out of memory, batch skipped" in capsys.readouterr().err


def test_second_signal_exits_at_once():
    code = ("import os, signal, time\nfrom twophase.train.runstate import GracefulStop\nwith GracefulStop():\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(0.2)\n    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\nprint('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, cwd=ROOT)
    assert proc.returncode == 130 and "not reached" not in proc.stdout
    assert "exiting now without saving" in proc.stderr


def _long_step_two(signals: int) -> str:
    """Code for a child: MLE step 2 runs 0.6 s (then waits, if it is still alive, as a very long step would),
    and the process sends itself SIGTERM `signals` times during it, 0.3 s into the step and then 0.1 s apart."""
    return ("import os, signal, sys, time\nfrom twophase.train import cli\nfrom twophase.train.trainer import Trainer\n"
            "real, calls = Trainer.mle_step, []\n"
            "def slow(self):\n    calls.append(1)\n    if len(calls) == 2:\n"
            "        time.sleep(0.3)\n"
            f"        for _ in range({signals}):\n            os.kill(os.getpid(), signal.SIGTERM)\n"
            "            time.sleep(0.1)\n"
            "        time.sleep(0.2 if %d == 1 else 30)\n    return real(self)\n"
            "Trainer.mle_step = slow\n"
            "sys.exit(cli.main(sys.argv[1:]))\n") % signals


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_during_a_long_step_says_how_long_it_has_run_and_a_second_exits_at_once(task, tmp_path, signals):
    """The first SIGTERM names the step and how long it has run, then the step ends and the run saves it (exit
    143). A second exits 143 at once without saving the step: checkpoint_last.pt stays step 1's, whole, and
    --resume continues from it."""
    save = tmp_path / "run"
    script = tmp_path / "slow.py"
    script.write_text(_long_step_two(signals))
    argv = [script, "--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"),
            "--save-dir", str(save), *TINY, "--mle-steps", "3", "--rl-steps", "0", "--save-every", "1",
            "--no-compare-mle"]
    proc = forks.run(argv=argv, timeout=60)
    assert proc.returncode == 143, proc.stderr
    first = [line for line in proc.stderr.splitlines() if line.startswith("signal 15")][0]
    seconds = float(first.split("which has run ")[1].split(" s")[0])
    assert first.startswith("signal 15 during step 2, which has run") and 0.3 <= seconds < 1.5, first
    assert "the step finishes, then the run saves and exits 143" in first
    saved = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert saved["step"] == (2 if signals == 1 else 1)
    if signals == 2:
        assert "signal 15 again: exiting now without saving" in proc.stderr
        _train_here(task, save, "--resume", "--mle-steps", "3", "--rl-steps", "0", "--save-every", "1",
                    "--no-compare-mle")
        assert torch.load(save / "checkpoint_last.pt", weights_only=True)["step"] == 3
