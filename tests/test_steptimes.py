"""Trainer.part_times: the CPU seconds of an RL step's parts (phase one, rewards, phase two, update)."""
import time

import pytest

from twophase.train import cli, trainer as trainer_module
from twophase.train.config import Config
from tests.tasks import task_dir


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 40, 4)


def _trainer(task, save):
    return cli.build(Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=16,
                            embed_dim=8, batch_size=4, mle_batch_size=8, beam_size=3, rescore_chunk=5, max_len=8,
                            save_dir=str(save)))


def test_each_part_gets_its_own_seconds(task, tmp_path, monkeypatch, one_thread):
    """A fake process clock that only the patched parts advance, each by its own power of ten: every part's
    total is exactly its own advance, so none is attributed to another, missed, or counted twice."""
    tr = _trainer(task, tmp_path / "run")
    clock = [0.0]
    monkeypatch.setattr(time, "process_time", lambda: clock[0])

    def advancing(fn, by):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            clock[0] += by
            return out
        return run

    monkeypatch.setattr(tr, "search", advancing(tr.search, 1.0))
    monkeypatch.setattr(tr, "rewards_of", advancing(tr.rewards_of, 10.0))
    monkeypatch.setattr(trainer_module, "rescore_backward", advancing(trainer_module.rescore_backward, 100.0))
    monkeypatch.setattr(tr.optimizer, "step", advancing(tr.optimizer.step, 1000.0))
    tr.train_step("rl")  # not asked: nothing recorded
    assert tr.part_times is None
    tr.part_times = {}
    tr.train_step("rl")
    assert tr.part_times == {"phase one": 1.0, "rewards": 10.0, "phase two": 100.0, "update": 1000.0}


def test_parts_lie_within_the_step(task, tmp_path, one_thread):
    """With the real clock: every part is measured, none negative, and together they are no more than the step."""
    tr = _trainer(task, tmp_path / "run")
    tr.part_times = {}
    start = time.process_time()
    tr.train_step("rl")
    total = time.process_time() - start
    assert set(tr.part_times) == {"phase one", "rewards", "phase two", "update"}
    assert all(v >= 0 for v in tr.part_times.values()) and sum(tr.part_times.values()) <= total + 1e-9


def test_karel_bench_splits_the_step(task, tmp_path, one_thread):
    """bench.karel's step split (on a tiny TSV trainer: the same Trainer path): every part and the rest, which
    add up to the step; its untied rewards differ from the true ones by less than 1e-3 and never tie."""
    from twophase.bench import karel as bench_karel
    tr = _trainer(task, tmp_path / "run")
    true_rewards = tr.rewards_of
    tr.rewards_of = bench_karel.untied(true_rewards)
    row = bench_karel._step_seconds(tr, "rl", 2)
    assert set(row) == {"cpu_s", "phase_one_s", "rewards_s", "phase_two_s", "update_s", "other_s"}
    assert tr.part_times is None and row["phase_two_s"] > 0 and row["phase_one_s"] > 0
    cand = tr.search(tr._sources([0, 1]))
    examples = [tr.train[0], tr.train[1]]
    exact = true_rewards(cand.tokens, cand.owner.tolist(), examples)
    untied = tr.rewards_of(cand.tokens, cand.owner.tolist(), examples)
    assert ((untied - exact) >= 0).all() and ((untied - exact) < 1e-3).all()
    assert len(set(untied.tolist())) == len(untied)


def test_karel_bench_refuses_a_bad_grammar_list(capsys):
    from twophase.bench import karel as bench_karel
    with pytest.raises(SystemExit) as exit_:
        bench_karel.main(["--grammar", "on,maybe"])
    assert exit_.value.code == 2 and "--grammar" in capsys.readouterr().err
