"""benchmarks.baselines: a run's RL step with a baseline's gradient in the place of phase two's takes the same
steps (losses, rewards, updates), as two-phase training; only the cost differs."""
import json

import pytest

from benchmarks import baselines
from twophase.config import Config
from twophase.train import recipe
from taskfiles import write_task


def _rl_rows(tmp_path, name: str, gradient, **more) -> list[dict]:
    save = tmp_path / name
    run = recipe.setup(Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "valid.tsv"), hidden_size=16,
                           embed_dim=8, batch_size=4, beam_size=3, max_len=8, mle_steps=2, rl_steps=3,
                           save_dir=str(save), **more))
    if gradient is not None:
        baselines.use(run, gradient)
    try:
        run.train()
    finally:
        run.cleanup()
    return [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]


@pytest.mark.parametrize("sampler", ["beam", "sample"])
@pytest.mark.parametrize("name", ["ONE_PHASE", "NO_PREFIX_SHARING"])
def test_a_baseline_takes_the_same_steps(tmp_path, sampler, name):
    """The one-phase baseline and phase two without prefix sharing only change how the gradient is computed:
    the same losses, rewards and updates as phase two's (--mle-weight: the reference rows go through phase two)."""
    write_task(tmp_path / "train.tsv", "reverse", 40, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 8, seed=1)
    rows = {kind: _rl_rows(tmp_path, kind, gradient, mle_weight=0.3, sampler=sampler)
            for kind, gradient in (("two", None), ("baseline", getattr(baselines, name)))}
    assert len(rows["baseline"]) == len(rows["two"]) == 3
    for a, b in zip(rows["baseline"], rows["two"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    if name == "NO_PREFIX_SHARING":  # every position decoded: as many nodes as positions
        assert all(a["prefix_nodes"] == a["prefix_positions"] for a in rows["baseline"])


def test_a_baseline_refuses_a_step_without_its_phase_two(tmp_path):
    write_task(tmp_path / "train.tsv", "reverse", 8, seed=0)
    run = recipe.setup(Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "train.tsv"), hidden_size=8,
                           embed_dim=4, batch_size=2, mle_batch_size=2, objective="policy", sampler="sample",
                           save_dir=str(tmp_path / "run")))
    with pytest.raises(ValueError, match="not --objective policy"):
        baselines.use(run, baselines.ONE_PHASE)
