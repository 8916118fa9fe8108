"""Completions of another engine: `Samples.from_completions(..., sampling_token_logps=...)` keeps the engine's
log-probabilities (checked as token_logps), `mismatch.importance_correction` equals TRL 1.16's formulas for its
four modes (transcribed here from `_generate_and_score_completions`), and the corrected objective stays exact
through phase two for every chunk size, rows and tree, at the token and the sequence level (float64, against
plain autograd of TRL's loss with the correction)."""
import math

import pytest
import torch

from conftest import take_grads, tiny_model, toy_batch
from test_policy_losses import MAX_LEN, _trl_loss
from test_policy_rescoring import _candidates, _moved
from twophase import Samples, protocol, rescore_backward
from twophase.objectives.mismatch import MODES, importance_correction, own_token_logps
from twophase.objectives.policy import advantages, policy_loss
from twophase.vocab import EOS, PAD

pytestmark = pytest.mark.usefixtures("one_thread")


def _trl_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vllm_importance_sampling_ratio, line for line."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


CLIPS = [(None, 3.0), (0.5, 2.0), (0.8, None)]


@pytest.mark.parametrize("clip_min,clip_max", CLIPS)
@pytest.mark.parametrize("mode", MODES)
def test_correction_equals_trls_formula(mode, clip_min, clip_max):
    g = torch.Generator().manual_seed(0)
    N, T = 8, 6
    lengths = torch.tensor([6, 1, 3, 6, 4, 2, 5, 6])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old = -2 * torch.rand(N, T, generator=g, dtype=torch.float64) * mask
    sampling = (old + 0.9 * torch.randn(N, T, generator=g, dtype=torch.float64)).clamp(max=0) * mask
    want = _trl_ratio(old, sampling, mask, mode, clip_min, clip_max).expand(N, T)
    got = importance_correction(old, sampling, lengths, mode, clip_min, clip_max)
    torch.testing.assert_close(got * mask, want * mask, rtol=1e-15, atol=0)
    assert ((got == 0) & (mask > 0)).any() == mode.endswith("mask")  # the masks bite
    if mode.endswith("truncate") and clip_max is not None:
        assert (got * mask).max() == clip_max


def test_from_completions_keeps_the_engines_log_probs():
    ids, owner = [[4, 5, EOS, 6], [7], [EOS, 4]], [0, 0, 1]
    engine = [[-1.0, -2.0, -0.5, -9.0], [-0.25], [-3.0, -9.0]]
    s = Samples.from_completions(ids, owner, PAD, EOS, sampling_token_logps=engine)
    assert s.token_scores is None  # the trainer's own are not given
    assert s.sampling_token_scores.tolist() == [[-1.0, -2.0, -0.5], [-0.25, 0, 0], [-3.0, 0, 0]]
    both = Samples.cat([s.select(torch.tensor([2, 0])), s], PAD)
    assert both.sampling_token_scores.tolist()[:2] == [[-3.0, 0, 0], [-1.0, -2.0, -0.5]]
    with pytest.raises(ValueError, match="sampling_token_logps row 1 position 0 is 0.5"):
        Samples.from_completions(ids, owner, PAD, EOS, sampling_token_logps=[[-1.0] * 3, [0.5], [-1.0]])
    with pytest.raises(ValueError, match="sampling_token_logps row 0 has 2 log-probabilities for its 3"):
        Samples.from_completions(ids, owner, PAD, EOS, sampling_token_logps=[[-1.0] * 2, [-1.0], [-1.0]])
    with pytest.raises(ValueError, match="unknown correction mode"):
        importance_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([2]), "row_mask")


@pytest.mark.parametrize("level,mode", [("token", "token_truncate"), ("token", "sequence_mask"),
                                        ("sequence", "token_mask"), ("sequence", "sequence_truncate")])
def test_corrected_objective_is_exact_through_phase_two(level, mode):
    """An engine's rows (from_completions with its log-probabilities), the trainer's own as the old policy, the
    policy moved since: chunked = one autograd of TRL's corrected loss, every chunk size, rows and tree."""
    model, source = tiny_model(), toy_batch()
    c = _candidates(model, source, 3, MAX_LEN)
    g = torch.Generator().manual_seed(5)
    noise = 0.3 * torch.randn(c.token_scores.shape, generator=g, dtype=torch.float64)
    engine = (c.token_scores + noise).clamp(max=-1e-3)
    rows = [r[:n] for r, n in zip(c.tokens.tolist(), c.lengths.tolist())]
    s = Samples.from_completions(rows, c.owner, model.pad_id, model.eos_id,
                                 sampling_token_logps=[e[:n] for e, n in zip(engine.tolist(), c.lengths.tolist())])
    old = own_token_logps(model, source, s, chunk_size=4)
    torch.testing.assert_close(old, c.token_scores.double(), rtol=1e-12, atol=1e-12)  # search's scores: the same
    _moved(model, scale=1.0)
    adv = advantages(torch.rand(len(s), generator=g, dtype=torch.float64), s.owner, 3)
    ref = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    clip_min, clip_max = 0.7, 1.6
    obj = policy_loss(adv, old, lengths=s.lengths, loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=0.04,
                      ref_token_logps=ref, importance_sampling_level=level,
                      sampling_token_logps=s.sampling_token_scores,
                      correction_mode=mode, correction_clip_min=clip_min, correction_clip_max=clip_max)
    mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id).double()
    ratio = _trl_ratio(old, s.sampling_token_scores, mask, mode, clip_min, clip_max)
    assert (ratio * mask != mask).any()  # the correction changes something
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        tok = protocol.token_scores(model, model.encode(source), s.tokens, s.owner)
        want_loss = _trl_loss(tok, mask, adv, old, ref, loss_type="grpo", beta=0.04, level=level, is_ratio=ratio)
    want_loss.backward()
    want = take_grads(model)
    for tree in (True, False):
        for chunk in (1, 3, 7, 1000):
            loss = rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree)
            assert loss == pytest.approx(want_loss.item(), rel=1e-10, abs=1e-13), (tree, chunk)
            for a, b in zip(take_grads(model), want):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
