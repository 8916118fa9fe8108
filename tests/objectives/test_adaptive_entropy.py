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
from twophase.objectives.entropycontrol import AdaptiveEntropy
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


# ---------------------------------------------------------------------- TRL 1.16's own compute_loss as the oracle
@pytest.fixture(scope="module")
def oracle_setup():
    """test_trl_oracle's TRL trainer and tiny Llama (its fixture's body, called once for this module)."""
    pytest.importorskip("trl")
    import test_trl_oracle as oracle
    return oracle, oracle.setup.__wrapped__()


def _objective(s, inputs, coef, quantile):
    from twophase.objectives.policy import policy_loss
    return policy_loss(inputs["advantages"], s.token_scores, lengths=s.lengths, loss_type="dapo", epsilon=0.2,
                       epsilon_high=0.28, beta=0.04, ref_token_logps=inputs["ref_per_token_logps"],
                       num_items=float(inputs["num_items_in_batch"]), entropy_coef=coef,
                       top_entropy_quantile=quantile, measure_entropy=True)


TRL_ATTRS = {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04, "loss_type": "dapo",
             "_entropy_bonus_enabled": True, "use_adaptive_entropy": True, "_entropy_window_stats": None,
             "current_gradient_accumulation_steps": 1}


@pytest.mark.parametrize("quantile", [1.0, 0.3])
def test_coefficients_follow_trls_own_update_over_several_steps(oracle_setup, quantile):
    """Six optimizer steps of TRL's compute_loss in train mode (its update, its clamps, its window entropy) against
    the controller fed phase two's measured entropy; the targets put the entropy below, then above, then below
    again, with the bounds reached on both sides."""
    from twophase import rescore_backward
    oracle, (trainer, wrapper, source, s) = oracle_setup
    inputs = oracle._inputs(wrapper, source, s, torch.Generator().manual_seed(1))
    settings = {"args.entropy_coef_min": 0.01, "args.entropy_coef_max": 0.06, "args.entropy_coef_delta": 0.02,
                "args.entropy_target": 0.2, "args.top_entropy_quantile": quantile, "top_entropy_quantile": quantile,
                "entropy_coef": 0.03, "_last_world_entropy": math.inf}
    control = AdaptiveEntropy(0.03, 0.01, 0.06, 0.02, 0.2)
    saved = _set_missing(oracle, trainer, {**TRL_ATTRS, **settings})
    try:
        trainer.model.train()
        for below in (True, True, False, False, False, True):
            stats = {}
            rescore_backward(wrapper, source, s, _objective(s, inputs, control.applied(), quantile), 5,
                             stats=stats)
            entropy = stats["entropy"] / stats["entropy_tokens"]
            target = entropy + (0.1 if below else -0.1)  # TRL's gate and ours on the same side
            control.target = trainer.args.entropy_target = target
            trainer.compute_loss(trainer.model, inputs)  # TRL's update, at the end of its optimizer step
            assert trainer._last_world_entropy == pytest.approx(entropy, rel=1e-5)
            assert control.update(entropy) == pytest.approx(trainer.entropy_coef, abs=1e-12)
        assert trainer.entropy_coef == pytest.approx(0.03)  # 0.05, 0.06 (max), 0.04, 0.02, 0.01 (min), 0.03
    finally:
        trainer.model.eval()
        _set_missing(oracle, trainer, saved)


@pytest.mark.parametrize("last_entropy", [0.1, 0.9])
def test_gradient_at_the_adaptive_coefficient_equals_trls(oracle_setup, last_entropy):
    """TRL's compute_loss (evaluation mode: no update) with adaptive control at coefficient 0.4 and last entropy
    below / above the target 0.5: the bonus applied or gated off, and twophase's gradient and loss equal."""
    from conftest import take_grads
    from twophase import rescore_backward
    oracle, (trainer, wrapper, source, s) = oracle_setup
    inputs = oracle._inputs(wrapper, source, s, torch.Generator().manual_seed(2))
    saved = _set_missing(oracle, trainer, {**TRL_ATTRS, "entropy_coef": 0.4, "_last_world_entropy": last_entropy,
                                           "args.entropy_target": 0.5})
    try:
        wrapper.zero_grad(set_to_none=True)
        trl_loss = trainer.compute_loss(trainer.model, inputs)
        trl_loss.backward()
    finally:
        _set_missing(oracle, trainer, saved)
    want = take_grads(wrapper)
    control = AdaptiveEntropy(0.4, target=0.5, last_entropy=last_entropy)
    assert control.applied() == (0.4 if last_entropy <= 0.5 else 0.0)
    loss = rescore_backward(wrapper, source, s, _objective(s, inputs, control.applied(), 1.0), 5)
    assert loss == pytest.approx(trl_loss.item(), rel=1e-5)
    scale = max(float(w.abs().max()) for w in want)
    for a, b in zip(take_grads(wrapper), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale)


def _set_missing(oracle, trainer, attrs: dict) -> dict:
    """oracle._set, also for attributes the trainer has only once it trains (saved as None)."""
    for key in attrs:
        owner, name = (trainer.args, key[5:]) if key.startswith("args.") else (trainer, key)
        if not hasattr(owner, name):
            setattr(owner, name, None)
    return oracle._set(trainer, attrs)


@pytest.mark.parametrize("coef,truncate", [(0.0, False), (0.3, True)])
def test_measured_entropy_is_the_full_logits_mean_for_every_chunk(coef, truncate, one_thread):
    """Phase two's measured mean entropy (the LSTM's by-hand output layer, float64) equals the mean over the
    loss's tokens of every position's entropy from the full logits, rows and tree, every chunk size, at a
    coefficient 0 (measured, not applied) and not."""
    from conftest import tiny_model, toy_batch
    from test_entropy_bonus import _entropies
    from test_policy_rescoring import _candidates, _moved
    from twophase import protocol, rescore_backward
    from twophase.objectives.policy import advantages, policy_loss, truncated_rows
    model, source = tiny_model(), toy_batch()
    s = _candidates(model, source, 3, 6)
    _moved(model, scale=1.0)
    adv = advantages(torch.rand(len(s), generator=torch.Generator().manual_seed(3), dtype=torch.float64), s.owner, 3)
    adv[:2] = 0.0  # rows without a gradient still count in the mean
    truncated = truncated_rows(s.tokens, s.lengths, model.eos_id) if truncate else None
    obj = policy_loss(adv, s.token_scores, lengths=s.lengths, truncated=truncated, entropy_coef=coef,
                      measure_entropy=True)
    with torch.no_grad(), protocol.scoring_mode(model):
        mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id).double()
        if truncate:
            mask = mask * (~truncated).double()[:, None]
        want = float((_entropies(model, source, s) * mask).sum() / mask.sum())
    for tree in (True, False):
        for chunk in (1, 2, 5, 1000):
            stats = {}
            rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree, stats=stats)
            assert stats["entropy_tokens"] == float(mask.sum())
            assert stats["entropy"] / stats["entropy_tokens"] == pytest.approx(want, rel=1e-12)


def test_measuring_the_entropy_adds_no_host_sync(one_thread):
    """The measured sums stay on the device until the chunks' statistics are read back: rescore_backward with the
    measure makes as many host reads as with the static bonus alone, at every chunk size."""
    from conftest import tiny_model, toy_batch
    from test_policy_rescoring import _candidates
    from twophase import rescore_backward
    from benchmarks.hostsyncs import count_host_syncs
    from twophase.objectives.policy import advantages, policy_loss
    model, source = tiny_model(), toy_batch()
    s = _candidates(model, source, 3, 6)
    adv = advantages(torch.rand(len(s), generator=torch.Generator().manual_seed(3), dtype=torch.float64), s.owner, 3)
    for tree in (True, False):
        for chunk in (1, 4):
            counts = []
            for measure in (False, True):
                obj = policy_loss(adv, s.token_scores, lengths=s.lengths, entropy_coef=0.3, measure_entropy=measure)
                with count_host_syncs() as syncs:
                    rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree, stats={})
                counts.append(syncs.total)
            assert counts[1] == counts[0], (tree, chunk, counts)
