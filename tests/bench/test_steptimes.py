"""bench.steptimes: the CPU seconds of an RL step's parts (phase one, rewards, phase two, update), as the parts'
profiler; and tools/beforeafter.py, tools/stepworker.py, which time them from outside."""
import json
import time

import pytest

from benchmarks.steptimes import PartTimes
from twophase.train import recipe
from twophase.train.steps import parts as parts_module
from twophase.config import Config
from taskfiles import task_dir


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 40, 4)


def _run(task, save):
    return recipe.setup(Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=16,
                            embed_dim=8, batch_size=4, mle_batch_size=8, beam_size=3, rescore_chunk=5, max_len=8,
                            save_dir=str(save)))


def test_each_part_gets_its_own_seconds(task, tmp_path, monkeypatch, one_thread):
    """A fake process clock that only the patched parts advance, each by its own power of ten: every part's
    total is exactly its own advance, so none is attributed to another, missed, or counted twice."""
    run = _run(task, tmp_path / "run")
    tr = run.trainer
    clock = [0.0]
    monkeypatch.setattr(time, "process_time", lambda: clock[0])

    def advancing(fn, by):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            clock[0] += by
            return out
        return run

    monkeypatch.setattr(parts_module, "search", advancing(parts_module.search, 1.0))
    monkeypatch.setattr(parts_module, "rewards_of", advancing(parts_module.rewards_of, 10.0))
    monkeypatch.setattr(parts_module, "rescore_backward", advancing(parts_module.rescore_backward, 100.0))
    monkeypatch.setattr(tr.optimizer, "step", advancing(tr.optimizer.step, 1000.0))
    run.train_step("rl")  # not asked: nothing recorded
    assert tr.parts.profiler is None
    times = PartTimes().attach(tr)
    run.train_step("rl")
    assert times == {"phase one": 1.0, "rewards": 10.0, "phase two": 100.0, "update": 1000.0}


def test_parts_lie_within_the_step(task, tmp_path, one_thread):
    """With the real clock: every part is measured, none negative, and together they are no more than the step."""
    run = _run(task, tmp_path / "run")
    times = PartTimes().attach(run.trainer)
    start = time.process_time()
    run.train_step("rl")
    total = time.process_time() - start
    assert set(times) == {"phase one", "rewards", "phase two", "update"}
    assert all(v >= 0 for v in times.values()) and sum(times.values()) <= total + 1e-9


def test_a_profiled_step_gives_the_callers_profiler_back(task, tmp_path, one_thread):
    """--profile-memory's profiler takes the parts' profiler slot for its step and writes its rows; an attached
    PartTimes is the parts' profiler again after it, and times the next step unprofiled."""
    run = _run(task, tmp_path / "run")
    tr = run.trainer
    times = PartTimes().attach(tr)
    from twophase.train import runparts
    runparts.take_step(tr, run.state, run.saver, "rl", 0.01, profiled=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "memory_profile.jsonl").read_text().splitlines()]
    assert tr.parts.profiler is times and times == {} and len(rows) == 1
    sections = [r["section"] for r in rows[0]["sections"]]
    assert "phase 1: search" in sections and "optimizer step" in sections and None not in sections
    run.train_step("rl")
    assert set(times) == {"phase one", "rewards", "phase two", "update"}


def test_karel_bench_splits_the_step(task, tmp_path, one_thread):
    """bench.karel's step split (on a tiny TSV trainer: the same Trainer path): every part and the rest, which
    add up to the step; its untied rewards differ from the true ones by less than 1e-3 and never tie."""
    from benchmarks import karel as bench_karel
    run = _run(task, tmp_path / "run")
    tr = run.trainer
    true_reward = tr.parts.reward
    tr.parts.reward = bench_karel.Untied(true_reward)
    row = bench_karel._step_seconds(run, "rl", 2)
    assert set(row) == {"cpu_s", "phase_one_s", "rewards_s", "phase_two_s", "update_s", "other_s"}
    assert tr.parts.profiler is None and row["phase_two_s"] > 0 and row["phase_one_s"] > 0
    cand = parts_module.search(tr.parts, tr.rl.search, parts_module.sources(tr.parts, [0, 1]))
    examples = [tr.task.train[0], tr.task.train[1]]
    untied = parts_module.rewards_of(tr.parts, cand.tokens, cand.owner.tolist(), examples)
    tr.parts.reward = true_reward
    exact = parts_module.rewards_of(tr.parts, cand.tokens, cand.owner.tolist(), examples)
    assert ((untied - exact) >= 0).all() and ((untied - exact) < 1e-3).all()
    assert len(set(untied.tolist())) == len(untied)


def test_karel_bench_refuses_a_bad_grammar_list(capsys):
    from benchmarks import karel as bench_karel
    with pytest.raises(SystemExit) as exit_:
        bench_karel.main(["--grammar", "on,maybe"])
    assert exit_.value.code == 2 and "--grammar" in capsys.readouterr().err


def test_karel_bench_without_grammar_measures_the_recipes(monkeypatch, capsys):
    """No --grammar: one measurement at the recipe's grammar (or the one after --), not a refusal."""
    from benchmarks import karel as bench_karel
    seen = []
    monkeypatch.setattr(bench_karel, "measure", lambda flags, steps, beams, tasks, grammars, untie:
                        seen.append((flags, grammars)) or [{"kind": "rl"}])
    assert bench_karel.main(["--steps", "1", "--", "--grammar", "off"]) == 0
    assert seen == [(["--grammar", "off"], [None])] and '"kind": "rl"' in capsys.readouterr().out


def _tiny_rl_job(task):
    return {"kind": "rl", "untie": True, "flags": [
        "--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--hidden-size", "16",
        "--embed-dim", "8", "--batch-size", "4", "--beam-size", "3", "--max-len", "8", "--rescore-chunk", "5",
        "--threads", "1"], "flags_if_known": [["--no-such-flag", "1"], ["--seed", "3"]]}


def test_stepworker_times_a_trainers_parts_from_outside(task, one_thread):
    """The before/after worker's RL job: the same four parts as bench.steptimes', taken from the trainer's
    sections and phase_two, within the step; a flag the command does not know is left out."""
    from tools import stepworker
    parts = {}
    step, model = stepworker.rl_job(_tiny_rl_job(task), parts)
    start = time.process_time()
    step()
    total = time.process_time() - start
    assert set(parts) == {"phase one", "rewards", "phase two", "update"}
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= total + 1e-9


def test_worker_answers_each_step_in_its_own_process(task):
    """The worker run as the driver runs it (its source through -c, this checkout on the path): built, then one
    JSON answer per step with the four parts; what the command prints on the way is passed through."""
    from pathlib import Path
    from tools import beforeafter
    worker = beforeafter.Worker("after", Path(__file__).resolve().parents[2], _tiny_rl_job(task))
    try:
        assert worker.answer("ready")["parameters"] > 0
        for _ in range(2):
            row = worker.step()
            assert set(row["parts"]) == {"phase one", "rewards", "phase two", "update"} and row["cpu_s"] > 0
    finally:
        worker.close()
    assert worker.proc.returncode == 0


def test_before_after_alternates_the_sides(monkeypatch):
    """Steps asked in turns (before, after; after, before; ...), warm-up steps dropped; medians and the table."""
    from tools import beforeafter
    asked = []

    class Fake:
        def __init__(self, side, checkout, job):
            self.side, self.n = side, 0

        def answer(self, key):
            return {"parameters": 1}

        def step(self):
            asked.append(self.side)
            self.n += 1
            cpu = self.n * (1.0 if self.side == "before" else 0.5)
            return {"cpu_s": cpu, "wall_s": cpu, "parts": {"phase one": cpu / 2}}

        def close(self):
            pass

    monkeypatch.setattr(beforeafter, "Worker", Fake)
    rows = beforeafter.run_job({}, {"before": None, "after": None}, steps=3, warmup=1, log=lambda *a, **k: None)
    assert asked == ["before", "after", "after", "before", "before", "after", "after", "before"]
    assert [r["cpu_s"] for r in rows["before"]] == [2.0, 3.0, 4.0]
    results = {"toy": {side: beforeafter.summary(r) for side, r in rows.items()}}
    assert results["toy"]["after"]["phase one"] == 0.75 and results["toy"]["before"]["steps_per_s"] == 1 / 3
    text = beforeafter.table(results)
    assert "| toy | step, CPU s | 3.000 | 1.500 | 0.50 |" in text and "| toy | phase one, CPU s |" in text


def test_before_after_refuses_bad_input(tmp_path, capsys):
    from pathlib import Path
    from tools import beforeafter
    here = str(Path(__file__).resolve().parents[2])
    for argv, message in [(["--before", str(tmp_path), "--after", here], "not a checkout of twophase"),
                          (["--before", here, "--after", here, "--jobs", "karel,nope"], "--jobs"),
                          (["--before", here, "--after", here, "--steps", "g2p=x"], "--steps"),
                          (["--before", here, "--after", here, "--g2p-checkpoint", str(tmp_path / "no.pt")],
                           "no such file")]:
        with pytest.raises(SystemExit) as exit_:
            beforeafter.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
