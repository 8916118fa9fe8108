"""One run per --save-dir (--resume / --overwrite), one consistent metrics.jsonl, and checkpoint_best.pt chosen by
--best-metric at every validation."""
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from twophase.train import cli, recipe, rundir
from twophase.config import Config

import forks
from taskfiles import task_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size", "3",
        "--rescore-chunk", "5", "--max-len", "8"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 120, 12)


def _argv(task, save, *flags):
    return ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(save), *TINY,
            *flags]


def _rows(save):
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def test_a_directory_holding_a_run_is_refused_then_overwritten(task, tmp_path, capsys):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "4", "--rl-steps", "0", "--save-every", "2")) == 0
    (save / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in save.iterdir()}
    capsys.readouterr()
    assert cli.main(_argv(task, save, "--mle-steps", "3", "--rl-steps", "0")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(save) in err and "--resume" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in save.iterdir()} == before  # nothing touched

    assert cli.main(_argv(task, save, "--mle-steps", "3", "--rl-steps", "0", "--overwrite", "--save-every", "1",
                          "--keep-last", "1")) == 0
    assert [r["step"] for r in _rows(save) if r["phase"] == "mle"] == [1, 2, 3]  # the old rows are gone
    assert sorted(p.name for p in save.glob("checkpoint_*.pt")) == [
        "checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_step00000003.pt"]  # the old step 4 file too
    assert (save / "notes.txt").read_text() == "mine"  # what is not the run's stays
    assert cli.main(_argv(task, save, "--resume", "--overwrite")) == 2
    assert "give one of them" in capsys.readouterr().err


def test_resume_cuts_the_log_back_to_the_checkpoint(task, tmp_path):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "5", "--rl-steps", "0", "--save-every", "3",
                          "--eval-every", "2")) == 0
    # As if the process had died after step 5 with its last save at step 3: steps 4 and 5 are logged, not saved.
    shutil.copy(save / "checkpoint_step00000003.pt", save / "checkpoint_last.pt")
    (save / "checkpoint_step00000005.pt").unlink()  # never written (--resume would continue from it)
    saved_elapsed = torch.load(save / "checkpoint_last.pt", weights_only=True)["elapsed_s"]
    assert cli.main(_argv(task, save, "--mle-steps", "6", "--rl-steps", "0", "--save-every", "3",
                          "--eval-every", "2", "--resume")) == 0
    rows = _rows(save)
    assert [r["step"] for r in rows if r["phase"] == "mle"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [2, 4, 6]
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed) and elapsed[4] >= saved_elapsed  # step 4 continues the first clock


def test_cut_back_keeps_the_checkpoints_step_but_not_its_test_row(tmp_path):
    log = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "phase": "mle"}, {"step": 2, "phase": "mle"}, {"step": 2, "phase": "eval"},
            {"step": 2, "phase": "test"}, {"step": 3, "phase": "rl"}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "pha')  # torn by a kill
    assert rundir.cut_back(log, 2) == 3
    assert [json.loads(x) for x in log.read_text().splitlines()] == rows[:3]
    assert rundir.cut_back(log, 2) == 0 and not list(tmp_path.glob(".*.tmp"))


def test_best_checkpoint_follows_the_best_metric_at_every_validation(task, tmp_path):
    save = tmp_path / "run"
    flags = ["--best-metric", "reward", "--eval-every", "2", "--save-every", "100", "--reward", "edit",
             "--test", str(task / "valid.tsv")]
    assert cli.main(_argv(task, save, "--mle-steps", "6", "--rl-steps", "0", "--lr", "0.02", *flags)) == 0
    evals = [r for r in _rows(save) if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6]
    best = max(evals, key=lambda r: r["reward"])  # the first of equals: later ties do not replace it
    state = torch.load(save / "checkpoint_best.pt", weights_only=True)
    assert (state["step"], state["best_metric"], state["best_step"]) == (best["step"], best["reward"], best["step"])
    [test] = [r for r in _rows(save) if r["phase"] == "test"]  # --test: the final model, once
    assert test["step"] == 6 and test["n"] == evals[-1]["n"]

    tr = recipe.setup(cli.config_from_args(cli.build_parser().parse_args(
        _argv(task, save, "--mle-steps", "8", "--rl-steps", "0", "--lr", "0.02", *flags, "--resume"))))
    assert (tr.checkpoints.best, tr.state.best_step) == (best["reward"], best["step"])  # kept across --resume
    assert tr.checkpoints.higher_is_better and tr.best_key == "reward"
    assert cli.main(_argv(task, save, "--mle-steps", "8", "--rl-steps", "0", *flags, "--resume",
                          "--best-metric", "per")) == 2  # another criterion would make the kept best meaningless


def test_lower_is_better_metrics_and_auto():
    from twophase import tasks
    from twophase.errors import UsageError
    from twophase.train.recipe import resolve_best_metric

    g2p, tsv = tasks.build(Config(task="g2p")), tasks.build(Config(task="tsv", train="a", valid="b"))
    assert resolve_best_metric(Config(), g2p) == "word_acc" and resolve_best_metric(Config(), tsv) == "reward"
    assert resolve_best_metric(Config(best_metric="per"), g2p) == "per"
    assert [m.key for m in g2p.metrics if not m.higher_is_better] == ["wer", "per", "wer_nostress"]
    with pytest.raises(UsageError, match="--best-metric bleu"):
        resolve_best_metric(Config(best_metric="bleu"), g2p)


def test_the_final_model_folder_belongs_to_the_run(tmp_path):
    """--hf-model's <save-dir>/hf_final: a directory holding one holds a run; --overwrite deletes it, not other
    folders."""
    (tmp_path / "hf_final").mkdir()
    (tmp_path / "hf_final" / "config.json").write_text("{}")
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="already holds a run \\(hf_final\\)"):
        rundir.claim(tmp_path, resume=False, overwrite=False)
    rundir.remove(rundir.claim(tmp_path, resume=False, overwrite=True))
    assert not (tmp_path / "hf_final").exists() and (tmp_path / "mine").is_dir()


def test_metrics_log_is_strict_json(tmp_path):
    """NaN and infinities (nested too) are written as null: every line parses under a strict JSON reader."""
    log = rundir.MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "loss": float("nan"), "scores": {"per": float("inf")}, "xs": [1.0, float("-inf")]})

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert row["loss"] is None and row["scores"] == {"per": None} and row["xs"] == [1.0, None]


def test_cut_back_keeps_a_comparison_only_when_it_is_done(tmp_path):
    """Continued-MLE rows are numbered from their branch point (below RL's steps): a checkpoint without a finished
    comparison drops them (the resumed run redoes it), one with it keeps them; test rows always go."""
    log = tmp_path / "metrics.jsonl"
    rows = [{"step": 4, "phase": "eval", "after": "mle"}, {"step": 7, "phase": "rl"},
            {"step": 5, "phase": "mle-continued", "continued": 1},
            {"step": 5, "phase": "eval", "after": "mle-continued", "continued": 1}, {"step": 4, "phase": "test"}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    log.write_text(text)
    assert rundir.cut_back(log, 7, compared=True) == 1
    assert [json.loads(x) for x in log.read_text().splitlines()] == rows[:4]
    log.write_text(text)
    assert rundir.cut_back(log, 7) == 3
    assert [json.loads(x) for x in log.read_text().splitlines()] == rows[:2]


def _killed_mid_write(save, name):
    """The temporary file save_atomic (and runs.write_config) had open when kill -9 struck: mkstemp's name."""
    import tempfile
    fd, tmp = tempfile.mkstemp(dir=save, prefix="." + name, suffix=".tmp")
    os.write(fd, b"half a checkpoint")
    os.close(fd)
    return tmp


def test_resume_and_overwrite_remove_the_residue_of_writes_a_killed_process_left(task, tmp_path):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "2", "--rl-steps", "0", "--no-compare-mle")) == 0
    mine = [save / ".notes.tmp", save / "checkpoint_notes.tmp", save / ".checkpoint_last.pt.bak"]
    for p in mine:
        p.write_text("mine")

    def residue():
        return [_killed_mid_write(save, n) for n in ("checkpoint_step00000003.pt", "config.json",
                                                     "metrics.jsonl")] + [str(save / ".hf_final.tmp")]
    # a process killed (no clean-up runs) inside save_atomic's torch.save of checkpoint_last.pt
    code = ("import os, sys, torch\nfrom twophase.train.checkpoint import save_atomic\n"
            "def killed(obj, f):\n    f.write(b'half a checkpoint'); f.flush(); os._exit(9)\n"
            f"torch.save = killed\nsave_atomic({{'step': 3}}, {str(save / 'checkpoint_last.pt')!r})\n")
    done = forks.run(code, timeout=60)  # a process of its own, forked from one that imported torch
    assert done.returncode == 9
    [killed] = [p for p in save.iterdir() if p.name.startswith(".checkpoint_last.pt") and p.name.endswith(".tmp")]
    (save / ".hf_final.tmp").mkdir()
    left = residue() + [str(killed)]
    assert all(Path(p).exists() for p in left)
    assert cli.main(_argv(task, save, "--mle-steps", "3", "--rl-steps", "0", "--no-compare-mle", "--resume")) == 0
    assert not any(Path(p).exists() for p in left) and all(p.read_text() == "mine" for p in mine)

    (save / ".hf_final.tmp").mkdir()
    left = residue()
    assert cli.main(_argv(task, save, "--mle-steps", "1", "--rl-steps", "0", "--no-compare-mle", "--overwrite")) == 0
    assert not any(Path(p).exists() for p in left) and all(p.read_text() == "mine" for p in mine)
    assert torch.load(save / "checkpoint_last.pt", weights_only=True)["step"] == 1


def test_overwrite_removes_everything_the_old_run_wrote_and_nothing_else(task, tmp_path):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "4", "--rl-steps", "0", "--save-every", "2", "--keep-last",
                          "5", "--no-compare-mle")) == 0
    step2 = save / "checkpoint_step00000002.pt"
    assert cli.main(_argv(task, save, "--resume-from", str(step2), "--mle-steps", "4", "--rl-steps", "0")) == 0
    assert (save / "after_step2" / "checkpoint_step00000004.pt").is_file()  # the branch the resume set aside
    (save / "tensorboard").mkdir()
    (save / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"old run")
    (save / "other_board").mkdir()
    (save / "other_board" / "events.out.tfevents.2.host").write_bytes(b"not the run's")
    (save / "after_everything").mkdir()  # a name like the run's is not the run's
    (save / "notes.txt").write_text("mine")
    assert cli.main(_argv(task, save, "--mle-steps", "1", "--rl-steps", "0", "--no-compare-mle", "--overwrite")) == 0
    assert sorted(p.name for p in save.iterdir()) == [
        "after_everything", "checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_step00000001.pt", "config.json",
        "metrics.jsonl", "notes.txt", "other_board"]
    assert json.loads((save / "config.json").read_text())["config"]["mle_steps"] == 1
    # a tensorboard folder holding more than the run's events keeps the rest
    (save / "tensorboard").mkdir()
    (save / "tensorboard" / "events.out.tfevents.3.host").write_bytes(b"old run")
    (save / "tensorboard" / "README").write_text("mine")
    rundir.remove(rundir.claim(save, resume=False, overwrite=True))
    assert [p.name for p in (save / "tensorboard").iterdir()] == ["README"]


def test_a_rewritten_log_and_record_stay_readable_like_a_plain_file(tmp_path):
    """cut_back and config.json go through a temporary file (mkstemp: mode 0600); what replaces the file is
    readable as a plainly written one, and nothing temporary is left."""
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "phase": "mle"}) + "\n" for s in (1, 2, 3)))
    assert rundir.cut_back(log, 2) == 1
    assert log.stat().st_mode & 0o777 == 0o644
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    record = rundir.write_config(tmp_path, Config(), {})
    assert record.stat().st_mode & 0o777 == 0o644 and json.loads(record.read_text())["config"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "metrics.jsonl"]


def test_one_process_at_a_time_writes_into_a_save_dir(task, tmp_path, capsys):
    """Two real processes: while a run trains in --save-dir, a second (with --resume or without) is refused in one
    line naming the folder and the first process; SIGTERM ends the first with its save and releases the lock; a
    lock whose process was killed (no clean-up) is taken over with a note."""
    save = tmp_path / "run"
    first = forks.spawn(argv=[ROOT / "train.py", *_argv(task, save, "--mle-steps", "1000000", "--rl-steps", "0",
                                                         "--eval-every", "1000000", "--save-every", "1")],
                        env={"TWOPHASE_PICTURE": "off"})
    try:
        deadline = time.monotonic() + 120
        while not (save / "checkpoint_last.pt").exists():  # its first step saved: it holds the directory
            assert time.monotonic() < deadline
            time.sleep(0.1)
        holder = json.loads((save / rundir.LOCK).read_text())
        assert holder["pid"] == first.pid
        capsys.readouterr()
        for flags in (["--resume"], ["--overwrite", "--mle-steps", "2", "--rl-steps", "0"]):
            assert cli.main(_argv(task, save, *flags)) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"--save-dir {save} is in use by another run (process {first.pid} on " \
                f"{holder['host']}, started {holder['started']}; its lock {save / rundir.LOCK})" in err, err
    finally:
        os.kill(first.pid, signal.SIGTERM)  # the first run finishes its step, saves and exits 143
        done = first.wait(timeout=120)
    assert done.returncode == 143, done.stderr
    assert not (save / rundir.LOCK).exists() and (save / "checkpoint_last.pt").exists()

    # SIGTERM outside the steps (no handler of the run's own yet): the command's clean-up runs, the lock goes
    code = (f"import os, signal, time\nfrom twophase.train import rundir\nlock = rundir.RunLock()\ntry:\n"
            f"    lock.acquire({str(save)!r})\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n"
            "finally:\n    lock.release()\n")
    assert forks.run(code, timeout=60).returncode == 143 and not (save / rundir.LOCK).exists()

    # kill -9 while holding it: the file stays, its process is gone
    killed = forks.run(f"import os\nfrom twophase.train import rundir\nrundir.RunLock().acquire({str(save)!r})\n"
                       "print(os.getpid(), flush=True)\nos._exit(9)", timeout=60)
    assert killed.returncode == 9 and (save / rundir.LOCK).exists()
    assert cli.main(_argv(task, save, "--mle-steps", "2", "--rl-steps", "0", "--overwrite")) == 0
    assert f"took over the lock of a run that is gone (process {killed.stdout.strip()} on " in capsys.readouterr().err
    assert not (save / rundir.LOCK).exists()
