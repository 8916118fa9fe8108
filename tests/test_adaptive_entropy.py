"""Adaptive entropy control (TRL 1.16's use_adaptive_entropy): the controller's coefficients against TRL's own
update in `GRPOTrainer.compute_loss` over several steps, phase two's measured mean entropy equal to TRL's, and
train.py's --use-adaptive-entropy: logged coefficients that follow the rule, resume bit-identical, flags refused
in one line."""
import json
import math

import pytest
import torch

from test_cli import _fails_with_one_line
from test_policy_training import TINY, data  # noqa: F401  (the module's task files)
from twophase.entropycontrol import AdaptiveEntropy
from twophase.train import cli

ADAPTIVE = ["--objective", "policy", "--sampler", "sample", "--use-adaptive-entropy", "--entropy-coef", "0.05",
            "--entropy-coef-delta", "0.02", "--entropy-coef-max", "0.08", "--mle-steps", "2"]


def _rl_rows(save):
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"]


def _follows_the_rule(rl, start, target, delta, lo, hi):
    coef, last = start, math.inf
    for r in rl:
        assert r["entropy_coef_applied"] == (coef if last <= target else 0.0)
        coef = min(coef + delta, hi) if r["entropy"] <= target else max(coef - delta, lo)
        last = r["entropy"]
        assert r["entropy_coef"] == pytest.approx(coef, abs=1e-15)


def test_logged_coefficients_follow_the_rule_and_resume_is_bit_identical(data, tmp_path, one_thread):  # noqa: F811
    flags = [*data, *TINY, *ADAPTIVE, "--entropy-target", "100"]  # entropy below target: the bonus engages
    assert cli.main([*flags, "--rl-steps", "4", "--save-dir", str(tmp_path / "full")]) == 0
    rl = _rl_rows(tmp_path / "full")
    assert len(rl) == 4 and all(r["entropy"] > 0 for r in rl)
    _follows_the_rule(rl, 0.05, 100.0, 0.02, 0.0, 0.08)
    assert [r["entropy_coef_applied"] for r in rl] == [0.0, 0.07, 0.08, 0.08]  # off before a measurement, capped
    part = tmp_path / "part"
    assert cli.main([*flags, "--rl-steps", "2", "--save-dir", str(part)]) == 0
    state = torch.load(part / "checkpoint_last.pt", weights_only=True)["policy"]["entropy_control"]
    assert state == {"coef": pytest.approx(0.08), "last_entropy": rl[1]["entropy"]}
    assert cli.main([*flags, "--rl-steps", "4", "--save-dir", str(part), "--resume"]) == 0
    full, resumed = (torch.load(p / "checkpoint_last.pt", weights_only=True)["model"] for p in (tmp_path / "full", part))
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert [r["entropy_coef"] for r in _rl_rows(part)][-2:] == [r["entropy_coef"] for r in rl][-2:]


def test_entropy_above_the_target_lowers_the_coefficient_to_its_minimum(data, tmp_path, one_thread):  # noqa: F811
    flags = [*data, *TINY, *ADAPTIVE, "--entropy-target", "0.01", "--entropy-coef-min", "0.02"]
    assert cli.main([*flags, "--rl-steps", "3", "--save-dir", str(tmp_path / "run")]) == 0
    rl = _rl_rows(tmp_path / "run")
    _follows_the_rule(rl, 0.05, 0.01, 0.02, 0.02, 0.08)
    assert [r["entropy_coef"] for r in rl] == pytest.approx([0.03, 0.02, 0.02])
    assert all(r["entropy_coef_applied"] == 0.0 for r in rl)  # never at or below the target: never applied


@pytest.mark.parametrize("extra,message", [
    (["--use-adaptive-entropy"], "--use-adaptive-entropy applies to --objective policy only"),
    (["--objective", "policy", "--entropy-target", "1"], "--entropy-target applies with --use-adaptive-entropy"),
    (["--objective", "policy", "--use-adaptive-entropy", "--entropy-coef-min", "0.5", "--entropy-coef-max", "0.1"],
     "--entropy-coef-min (0.5) is above --entropy-coef-max (0.1)"),
    (["--objective", "policy", "--use-adaptive-entropy", "--entropy-coef", "2"], "--entropy-coef (2.0), the initial"),
])
def test_bad_combinations_are_refused_in_one_line(data, tmp_path, capsys, extra, message):  # noqa: F811
    _fails_with_one_line([*data, *TINY, *extra, "--save-dir", str(tmp_path / "x")], capsys, message)


def test_controller_state_round_trips():
    c = AdaptiveEntropy(0.1, 0.0, 1.0, 0.05, 0.5)
    assert c.applied() == 0.0  # no measurement yet
    c.update(0.4)
    d = AdaptiveEntropy(0.1, 0.0, 1.0, 0.05, 0.5)
    d.load_state_dict(c.state_dict())
    assert (d.coef, d.last_entropy, d.applied()) == (pytest.approx(0.15), 0.4, pytest.approx(0.15))
