"""--compare-mle (MLE continued from the end of MLE for RL's training time), the --lr-decay schedule with its early
stop, their resumption, and the learning-curve plot, on a tiny TSV task in-process."""
import copy
import json
import os
import signal
import sys
import time

import pytest
import torch

from twophase import plot
from twophase.train import cli, mlephase, recipe, report, runparts
from twophase.train import run as run_module
from twophase.config import Config
from twophase.train.runstate import Interrupted
from twophase.train.report import summary_table
from twophase.train.mlephase import Plateau, budget_clock

from taskfiles import task_dir


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 200, 12)


def _trainer(task, save, **overrides):
    cfg = Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=16, embed_dim=8,
                 batch_size=4, mle_batch_size=8, beam_size=3, rescore_chunk=5, max_len=8, save_dir=str(save),
                 eval_every=4, log_every=0, **{"compare_mle": True, **overrides})
    return recipe.setup(cfg)


def _rows(save):
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


def _slow_rl(tr, seconds):
    """RL steps that take at least `seconds` of CPU time (inside the step's measured time), so the comparison has
    a budget."""
    real = tr.trainer.rl_step

    def rl_step():
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
        return real()
    tr.trainer.rl_step = rl_step


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in a)


def _watch_steps(monkeypatch, watch) -> None:
    """`watch(phase, take)` around every step, the run's and the comparison's (`take()`: the step itself)."""
    real = runparts.take_step

    def take_step(trainer, state, saver, phase, *args, **kwargs):
        return watch(phase, lambda: real(trainer, state, saver, phase, *args, **kwargs))
    monkeypatch.setattr(run_module, "take_step", take_step)
    monkeypatch.setattr(mlephase, "take_step", take_step)


def test_continued_mle_starts_from_the_end_of_mle_for_the_rl_time(task, tmp_path, monkeypatch):
    tr = _trainer(task, tmp_path, mle_steps=6, rl_steps=4, mle_weight=0.5)  # RL surely moves the parameters
    seen = {}
    _slow_rl(tr, 0.05)  # RL's budget: 4 steps of at least 50 ms

    def step(phase, take):
        if phase == "mle-continued" and "start" not in seen:
            seen["start"] = copy.deepcopy(tr.trainer.model.state_dict())
            seen["rl_end"] = copy.deepcopy(tr.comparison.final["model"])
        before = tr.state.stats[phase].get("cpu_seconds", 0.0)
        row = take()
        # the step's CPU time as the budget counts it (wall time differs on a loaded machine)
        seen.setdefault(phase, []).append(tr.state.stats[phase]["cpu_seconds"] - before)
        return row

    _watch_steps(monkeypatch, step)  # the run's steps and the comparison's
    summary = tr.train()
    branch = torch.load(tmp_path / "checkpoint_mle_end.pt", weights_only=True)
    assert branch["step"] == 6
    assert _close(seen["start"], branch["model"])  # continued from the end of MLE ...
    assert not _close(seen["start"], seen["rl_end"])  # ... not from RL's parameters
    assert _close(tr.trainer.model.state_dict(), seen["rl_end"])  # and the run ends with the RL model
    last = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert _close(last["model"], seen["rl_end"]) and last["compared"]
    continued = torch.load(tmp_path / "checkpoint_mle_continued.pt", weights_only=True)
    assert continued["phase"] == "mle-continued" and not _close(continued["model"], branch["model"])
    assert budget_clock(tr.trainer.device) == "cpu_seconds"  # on CPU: the process's CPU time, whatever else the machine runs
    budget, spent = tr.state.stats["rl"]["cpu_seconds"], tr.state.stats["mle-continued"]["cpu_seconds"]
    assert spent >= budget > spent - max(seen["mle-continued"])  # stops at the first step past RL's time
    rows = _rows(tmp_path)
    steps = [r for r in rows if r["phase"] == "mle-continued"]
    assert [r["continued"] for r in steps] == list(range(1, len(steps) + 1)) == [r["step"] - 6 for r in steps]
    assert all(r["lr"] == 2e-4 for r in steps) and len(steps) == summary["mle-continued"]["steps"]
    evals = [r for r in rows if r.get("after") == "mle-continued"]
    assert evals[-1]["continued"] == len(steps) and evals[-1]["word_acc"] == summary["mle-continued"]["word_acc"]
    table = summary_table(summary, tr.trainer.task.metrics)
    assert table.splitlines()[0].split() == ["end", "of", "MLE", "MLE", "continued", "RL"]
    assert len(next(line for line in table.splitlines() if line.startswith("valid reward")).split()) == 5


def test_plateau_decays_then_stops():
    p = Plateau(1.0, 0.5, 2, 0.25, higher_is_better=True)
    actions = [p.update(s) for s in (0.1, 0.2, 0.2, 0.1, 0.3, 0.3, float("nan"), 0.2, 0.2, 0.9)]
    assert actions == [None, None, None, "decay", None, None, "decay", None, "stop", None]
    assert p.lr == 0.25 and p.stopped and p.best == 0.3
    q = Plateau(1.0, 0.5, 2, 0.25, higher_is_better=True)
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict()
    assert Plateau(1.0, 1.0, 1, 0.0, True).update(0.0) is None  # decay 1: a constant rate


def _scripted(tr, scores):
    """Validation scores by step from `scores` (word_acc only), so the schedule's decisions are known."""
    def validate():
        acc = scores.get(tr.state.step, 0.0)
        return {"word_acc": acc, "per": 1 - acc, "reward": acc, "n": 12}
    tr.validate = validate


SCORES = {4: 0.5, 8: 0.4, 12: 0.6, 16: 0.5, 20: 0.5, 24: 0.5}  # decay at 8, stop at 16 (patience 1)


def test_lr_decay_and_early_stop_then_rl(task, tmp_path):
    tr = _trainer(task, tmp_path, mle_steps=40, rl_steps=3, lr_decay=0.5, patience=1, min_lr=1e-3,
                  best_metric="word_acc", compare_mle=False)
    _scripted(tr, SCORES)
    summary = tr.train()
    rows = _rows(tmp_path)
    lrs = [(r["step"], r["lr"]) for r in rows if r["phase"] == "mle"]
    assert lrs == [(s, 2e-3) for s in range(1, 9)] + [(s, 1e-3) for s in range(9, 17)]
    assert [(r["step"], r["action"]) for r in rows if r["phase"] == "schedule"] == [(8, "decay"), (16, "stop")]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [17, 18, 19]  # RL's steps follow at once
    assert summary["mle"]["steps"] == 16 and tr.state.mle_end == 16
    assert torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["mle_end"] == 16


def test_schedule_survives_resume(task, tmp_path):
    full = _trainer(task, tmp_path / "full", mle_steps=40, rl_steps=2, lr_decay=0.5, patience=1, min_lr=1e-3,
                    compare_mle=False)
    _scripted(full, SCORES)
    full.train()
    part = _trainer(task, tmp_path / "part", mle_steps=12, rl_steps=0, lr_decay=0.5, patience=1, min_lr=1e-3,
                    compare_mle=False)
    _scripted(part, SCORES)
    part.train()  # stopped after the decay at step 8, before the plateau at 16
    assert torch.load(tmp_path / "part" / "checkpoint_last.pt", weights_only=True)["schedule"]["lr"] == 1e-3
    part = _trainer(task, tmp_path / "part", mle_steps=40, rl_steps=2, lr_decay=0.5, patience=1, min_lr=1e-3,
                    compare_mle=False, resume=True)
    _scripted(part, SCORES)
    part.train()
    assert part.state.mle_end == 16 and part.state.step == 18
    assert _close(part.trainer.model.state_dict(), full.trainer.model.state_dict())


def test_resume_during_the_comparison_redoes_it(task, tmp_path, monkeypatch):
    tr = _trainer(task, tmp_path, mle_steps=4, rl_steps=3)
    calls = []
    _slow_rl(tr, 0.1)  # budget for a few continued steps

    def step(phase, take):
        if phase == "mle-continued":
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)  # caught by the run: it stops after this step
        return take()

    _watch_steps(monkeypatch, step)
    with pytest.raises(Interrupted) as stop:
        tr.train()
    assert "comparison" in str(stop.value) and stop.value.code == 130
    last = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert last["step"] == 7 and not last["compared"]
    resumed = _trainer(task, tmp_path, mle_steps=4, rl_steps=3, resume=True)
    assert resumed.state.step == 7 and not resumed.state.compared
    summary = resumed.train()
    assert "mle-continued" in summary and resumed.state.compared
    steps = [r["continued"] for r in _rows(tmp_path) if r["phase"] == "mle-continued"]
    assert steps == list(range(1, len(steps) + 1))  # the stopped comparison's rows went; no step twice
    assert _close(resumed.trainer.model.state_dict(), last["model"])  # the final model is still RL's


def test_plot_writes_a_png(tmp_path, capsys):
    rows = [{"step": 4, "phase": "eval", "after": "mle", "word_acc": 0.2, "per": 0.5, "reward": 0.4, "elapsed_s": 10},
            {"step": 8, "phase": "eval", "after": "mle", "word_acc": 0.3, "per": 0.4, "reward": 0.5, "elapsed_s": 20},
            {"step": 10, "phase": "eval", "after": "rl", "word_acc": 0.35, "per": 0.35, "reward": 0.6,
             "elapsed_s": 40},
            {"step": 15, "phase": "eval", "after": "mle-continued", "continued": 5, "since_branch_s": 20,
             "word_acc": 0.33, "per": 0.37, "reward": 0.55, "elapsed_s": 65}]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    branches = plot.curves(rows)
    assert [(r["step"], r["minutes"]) for r in branches["mle-continued"]] == [(8, 20 / 60), (13, 40 / 60)]
    out = tmp_path / "curves.png"
    assert plot.main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip().endswith("(word_acc, per, reward)")  # the rows' own metrics
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n{oops\n")
    assert plot.main([str(run), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().endswith("metrics.jsonl:2: not a JSON line")


def test_plot_and_tensorboard_without_their_packages(tmp_path, monkeypatch, capsys, task):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "phase": "eval", "after": "mle"}) + "\n")
    assert plot.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib is not installed" in err
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert cli.main(["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--tensorboard",
                     "--save-dir", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tensorboard needs the tensorboard package" in err
    assert not (tmp_path / "tb").exists()


def test_tensorboard_tags_with_a_fake_writer():
    class Fake:
        def __init__(self):
            self.scalars, self.flushes = [], 0

        def add_scalar(self, tag, value, step, walltime=None):
            self.scalars.append((tag, value, step))

        def flush(self):
            self.flushes += 1

    fake = Fake()
    log = report.TensorBoardLog(fake, lambda: 100)
    log.write({"step": 5, "phase": "mle", "loss": 2.0, "lr": 1e-3, "skipped": 0})
    log.write({"step": 130, "phase": "eval", "after": "mle-continued", "continued": 30, "word_acc": 0.5, "n": 9})
    log.write({"step": 120, "phase": "eval", "after": "rl", "word_acc": 0.6})
    log.write({"step": 130, "phase": "test", "model": "rl", "per": 0.1})
    assert fake.scalars == [("train/mle/loss", 2.0, 5), ("train/mle/lr", 1e-3, 5), ("train/mle/skipped", 0, 5),
                            ("valid_mle_continued/word_acc", 0.5, 130), ("valid/word_acc", 0.6, 120),
                            ("test/rl/per", 0.1, 130)]
    assert fake.flushes == 3


def test_preset_sets_defaults_the_flags_still_win(task, tmp_path, capsys):
    parser = cli.build_parser()
    parser.set_defaults(**cli.PRESETS["g2p-long"])
    args = parser.parse_args(["--preset", "g2p-long", "--rl-steps", "7"])
    assert args.bidirectional and args.dropout == 0.3 and args.lr_decay == 0.5 and args.rl_steps == 7
    assert cli.main(["--preset", "g2p-long", "--train", str(task / "train.tsv"), "--valid",
                     str(task / "valid.tsv"), "--save-dir", str(tmp_path)]) == 2
    assert "--preset g2p-long is a recipe for the built-in G2P data" in capsys.readouterr().err


def test_an_mle_only_run_resumed_with_rl_compares(task, tmp_path):
    _trainer(task, tmp_path, mle_steps=4, rl_steps=0).train()
    assert not (tmp_path / "checkpoint_mle_end.pt").exists()  # nothing to compare without RL
    tr = _trainer(task, tmp_path, mle_steps=4, rl_steps=2, resume=True)
    summary = tr.train()
    assert "mle-continued" in summary and tr.state.compared
    assert torch.load(tmp_path / "checkpoint_mle_end.pt", weights_only=True)["step"] == 4


def test_rows_carry_their_models_steps(task, tmp_path):
    """Continued MLE is numbered from its branch point (the end of MLE), and each test row carries the step of the
    model it tested: the end of MLE, the end of the continuation, the end of RL."""
    tr = _trainer(task, tmp_path, mle_steps=4, rl_steps=2, test=str(task / "valid.tsv"))
    _slow_rl(tr, 0.05)
    summary = tr.train()
    rows = _rows(tmp_path)
    continued = [r for r in rows if r["phase"] == "mle-continued"]
    assert [r["step"] for r in continued] == [4 + r["continued"] for r in continued]
    tests = {r["model"]: r["step"] for r in rows if r["phase"] == "test"}
    assert tests == {"mle": 4, "rl": 6, "mle-continued": 4 + summary["mle-continued"]["steps"]}


def test_plot_draws_each_tasks_own_metrics(tmp_path, capsys):
    """Karel's validation rows: its metrics and the reward, no G2P panel left empty."""
    keys = ["generalization", "syntax_error_rate", "reward"]
    rows = [{"step": s, "phase": "eval", "after": "mle", **{k: s / 10 for k in keys}, "n": 6, "elapsed_s": s}
            for s in (2, 4)] + [{"step": 4, "phase": "mle", "loss": 1.0, "lr": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot.metric_keys([rows]) == keys
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "k.png")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"({', '.join(keys)})")
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "k.png"), "--metrics", "word_acc"]) == 2
    assert "--metrics: no validation row holds word_acc" in capsys.readouterr().err
