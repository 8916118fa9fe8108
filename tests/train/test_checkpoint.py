"""Tests for twophase.checkpoint: atomic saves, safe loads, RNG round trips and rotation."""
import random

import numpy as np
import pytest
import torch

from twophase.train import checkpoint
from twophase.train.checkpoint import CheckpointError, CheckpointManager, load, rng_state, save_atomic, set_rng_state


def _write_marker(path):
    with open(path, "w") as f:
        f.write("executed")
    return "pwned"


class Evil:
    """Unpickling this would write a marker file; a safe loader must never do that."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_write_marker, (self.marker,))


def _sample_state():
    return {
        "model": {"w": torch.randn(3, 4), "b": torch.arange(4)},
        "optimizer": {"state": {0: {"step": 3, "exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 1e-3}]},
        "step": 42, "loss": 0.125, "name": "run-a", "none": None, "items": [1, 2.5, "x", [3, None]],
        "rng": rng_state(),
    }


def _assert_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b


def test_round_trip(tmp_path):
    state = _sample_state()
    path = tmp_path / "ck.pt"
    save_atomic(state, path)
    _assert_equal(state, load(path))
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_rng_state_restores_all_generators(tmp_path):
    path = tmp_path / "rng.pt"
    save_atomic({"model": {}, "rng": rng_state()}, path)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)  # advance every generator past the saved point
    set_rng_state(load(path)["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_pickle_payload_refused_and_not_executed(tmp_path):
    marker = tmp_path / "marker.txt"
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(1)}, "extra": Evil(str(marker))}, path)
    with pytest.raises(CheckpointError, match="refused") as info:
        load(path)
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    save_atomic({"model": {"w": torch.ones(2)}, "step": 1}, path)

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomic({"model": {"w": torch.zeros(2)}, "step": 2}, path)
    monkeypatch.undo()
    old = load(path)
    assert old["step"] == 1 and torch.equal(old["model"]["w"], torch.ones(2))
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_truncated_file_is_rejected(tmp_path, keep):
    path = tmp_path / "ck.pt"
    save_atomic(_sample_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="not a readable checkpoint") as info:
        load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match="no such file") as info:
        load(path)
    assert str(path) in str(info.value)


def test_non_twophase_payload(tmp_path):
    path = tmp_path / "other.pt"
    save_atomic({"weights": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match="no 'model' entry"):
        load(path)


def _step_files(folder):
    return sorted(p.name for p in folder.glob("checkpoint_step*.pt"))


def test_manager_rotation(tmp_path):
    mgr = CheckpointManager(tmp_path / "run" / "ckpt", keep_last=2)
    for step in range(1, 6):
        written = mgr.save({"model": {}, "step": step}, step)
        assert mgr.step_path(step) in written and mgr.last_path in written
        assert len(_step_files(mgr.save_dir)) == min(step, 2)
    assert _step_files(mgr.save_dir) == ["checkpoint_step00000004.pt", "checkpoint_step00000005.pt"]
    assert load(mgr.last_path)["step"] == 5
    assert not mgr.best_path.exists()
    assert not list(mgr.save_dir.glob("*.tmp")) and not list(mgr.save_dir.glob(".*.tmp"))


def test_manager_keep_zero(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    assert mgr.save({"model": {}}, 1, metric=1.0) == [mgr.last_path, mgr.best_path]
    assert _step_files(tmp_path) == []


@pytest.mark.parametrize("higher, metrics, best_steps", [
    (True, [1.0, 0.5, 2.0, None, 2.0], [1, 3]),
    (False, [1.0, 2.0, 0.5, None, 0.5], [1, 3]),
])
def test_manager_best(tmp_path, higher, metrics, best_steps):
    mgr = CheckpointManager(tmp_path, keep_last=1, higher_is_better=higher)
    improved_at = []
    for step, metric in enumerate(metrics, start=1):
        if mgr.best_path in mgr.save({"model": {}, "step": step}, step, metric=metric):
            improved_at.append(step)
            assert load(mgr.best_path)["step"] == step
    assert improved_at == best_steps
    assert load(mgr.best_path)["step"] == best_steps[-1]
    assert mgr.best == metrics[best_steps[-1] - 1]
    # The best value survives a restart through the saved state.
    restarted = CheckpointManager(tmp_path, keep_last=1, higher_is_better=higher)
    restarted.best = load(mgr.last_path).get("best_metric")
    assert restarted.best == mgr.best
    worse = mgr.best - 1 if higher else mgr.best + 1
    assert restarted.best_path not in restarted.save({"model": {}}, 99, metric=worse)


def test_manager_does_not_mutate_state(tmp_path):
    state = {"model": {}}
    CheckpointManager(tmp_path).save(state, 1, metric=0.3)
    assert state == {"model": {}}
