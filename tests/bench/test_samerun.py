"""tools/samerun.py: two run directories compared, metrics rows field by field (timings left out) and checkpoints
tensor by tensor; a difference anywhere else is reported."""
import json

import torch

from tools import samerun


def _run(folder, loss: float, weight: torch.Tensor, seconds: float, python_state: int):
    folder.mkdir()
    rows = [{"step": 1, "phase": "mle", "loss": loss, "elapsed_s": seconds, "cpu_seconds": seconds}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.save({"model": {"w": weight}, "rng": {"python": {"state": [python_state]}, "torch": torch.arange(3)},
                "stats": {"mle": {"seconds": seconds, "steps": 1}}}, folder / "checkpoint_last.pt")


def test_equal_runs_differ_only_in_timings_and_unseeded_streams(tmp_path):
    _run(tmp_path / "a", 0.5, torch.ones(2, dtype=torch.float64), 1.0, 7)
    _run(tmp_path / "b", 0.5, torch.ones(2, dtype=torch.float64), 2.0, 8)
    assert samerun.compare(tmp_path / "a", tmp_path / "b") == []


def test_a_loss_a_tensor_or_its_dtype_is_reported(tmp_path):
    _run(tmp_path / "a", 0.5, torch.ones(2, dtype=torch.float64), 1.0, 7)
    _run(tmp_path / "b", 0.25, torch.tensor([1.0, 1.0 + 2**-40], dtype=torch.float64), 1.0, 7)
    _run(tmp_path / "c", 0.5, torch.ones(2, dtype=torch.float32), 1.0, 7)
    found = samerun.compare(tmp_path / "a", tmp_path / "b")
    assert found == ["metrics row 0: loss 0.5 / 0.25", "checkpoint_last.pt.model.w"]
    assert samerun.compare(tmp_path / "a", tmp_path / "c") == ["checkpoint_last.pt.model.w"]


def test_an_ignored_field_is_left_out_on_both_sides(tmp_path):
    _run(tmp_path / "a", 0.5, torch.ones(2), 1.0, 7)
    _run(tmp_path / "b", 0.5, torch.ones(2), 1.0, 7)
    state = torch.load(tmp_path / "a" / "checkpoint_last.pt")
    state["stats"]["gone"] = 1  # a field the other side no longer writes
    torch.save(state, tmp_path / "a" / "checkpoint_last.pt")
    assert samerun.compare(tmp_path / "a", tmp_path / "b") == ["checkpoint_last.pt.stats: keys ['gone']"]
    assert samerun.compare(tmp_path / "a", tmp_path / "b", (".stats.gone",)) == []
