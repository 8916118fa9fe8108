"""TRL's entropy bonus (`entropy_coef`) through phase two: its gradient goes through the by-hand output layer a
block of logits at a time. Chunked = one plain autograd over the full logits of every row (float64, every chunk
size, rows and tree, the LSTM), refused where phase two differentiates per-token log-probabilities alone, and
its peak memory adds a block, never the (C, T, V) logits."""
import pytest
import torch

from conftest import take_grads, tiny_model, toy_batch
from test_policy_losses import MAX_LEN, _trl_loss
from test_policy_rescoring import _candidates, _moved
from twophase import Seq2Seq, protocol, rescore_backward, sample
from twophase.models import outputlayer
from twophase.objectives.policy import advantages, policy_loss, truncated_rows

pytestmark = pytest.mark.usefixtures("one_thread")
COEF = 0.3


def _entropies(model, source, s):
    """(N, T) every position's next-token entropy from the LSTM's full logits, with a graph (0 past the end)."""
    enc = model.encode(source)
    h, target, row = model.decoder_states(enc, s.tokens, s.owner)  # (M, H), (M,), (M,)
    logp = torch.log_softmax(outputlayer.logits(h, model.out.weight, model.out.bias, model.banned), dim=-1)
    p = logp.exp()
    H = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)  # (M,)
    valid = (s.tokens != model.pad_id).reshape(-1).nonzero().squeeze(1)  # as decoder_states picks them
    return H.new_zeros(s.tokens.numel()).index_copy(0, valid, H).reshape(s.tokens.shape)


def _setup(model, source, loss_type, mask_truncated):
    s = _candidates(model, source, 3, MAX_LEN)
    _moved(model, scale=1.0)
    g = torch.Generator().manual_seed(4)
    adv = advantages(torch.rand(len(s), generator=g, dtype=torch.float64), s.owner, 3)
    ref = s.token_scores + 0.3 * torch.randn(s.token_scores.shape, generator=g, dtype=torch.float64)
    truncated = truncated_rows(s.tokens, s.lengths, model.eos_id) if mask_truncated else None
    obj = policy_loss(adv, s.token_scores, lengths=s.lengths, loss_type=loss_type, beta=0.04, ref_token_logps=ref,
                      epsilon_high=0.28, max_len=MAX_LEN, truncated=truncated, entropy_coef=COEF)
    return s, obj, adv, ref, truncated


@pytest.mark.parametrize("loss_type,mask_truncated", [("dapo", False), ("grpo", True)])
def test_entropy_bonus_is_exact_for_every_chunk(loss_type, mask_truncated):
    model, source = tiny_model(), toy_batch()
    s, obj, adv, ref, truncated = _setup(model, source, loss_type, mask_truncated)
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        tok = protocol.token_scores(model, model.encode(source), s.tokens, s.owner)
        mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id).double()
        if mask_truncated:
            mask = mask * (~truncated).double()[:, None]
        H = _entropies(model, source, s)
        # TRL: L_policy - coef * the mean entropy over the loss's tokens
        want_loss = _trl_loss(tok, mask, adv, s.token_scores, ref, loss_type=loss_type, beta=0.04) \
            - COEF * (H * mask).sum() / mask.sum()
    want_loss.backward()
    want = take_grads(model)
    for tree in (True, False):
        for chunk in (1, 2, 5, 1000):
            loss = rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree)
            assert loss == pytest.approx(want_loss.item(), rel=1e-10, abs=1e-13), (tree, chunk)
            for a, b in zip(take_grads(model), want):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # the bonus matters: without it the gradient differs
    plain = policy_loss(adv, s.token_scores, lengths=s.lengths, loss_type=loss_type, beta=0.04, ref_token_logps=ref,
                        epsilon_high=0.28, max_len=MAX_LEN, truncated=truncated)
    rescore_backward(model, source, s, plain, 1000)
    assert max(float((a - b).abs().max()) for a, b in zip(take_grads(model), want)) > 1e-6


def test_entropy_bonus_is_refused_without_a_by_hand_output_layer(monkeypatch):
    model, source = tiny_model(), toy_batch()
    s, obj, *_ = _setup(model, source, "dapo", False)
    monkeypatch.setattr(model, "weighted_tree_backward", None)
    monkeypatch.setattr(model, "weighted_score_backward", None)
    with pytest.raises(ValueError, match="entropy_coef needs the model's by-hand output layer"):
        rescore_backward(model, source, s, obj, 4, prefix_sharing=False)


def test_entropy_bonus_adds_a_block_not_the_logits(monkeypatch):
    """A wide vocabulary: phase two's peak with the bonus stays within a few logit blocks of its peak without,
    far below one chunk's (C, T, V) logits."""
    from twophase.models import fused
    from twophase.system.memory import AllocationPeak
    monkeypatch.setattr(fused, "BLOCK_BYTES", 2**18)  # blocks of 8 positions: many blocks per chunk
    torch.manual_seed(0)
    V = 4000
    model = Seq2Seq(9, V, embed_dim=8, hidden_size=16).double().eval()
    source = toy_batch()
    s = sample(model, source, 8, 12, generator=torch.Generator().manual_seed(0))
    adv = advantages(torch.rand(len(s), generator=torch.Generator().manual_seed(1), dtype=torch.float64), s.owner, 3)
    peaks = {}
    for coef in (0.0, 0.1):
        obj = policy_loss(adv, s.token_scores, lengths=s.lengths, entropy_coef=coef)
        model.zero_grad(set_to_none=True)
        rescore_backward(model, source, s, obj, 1000, prefix_sharing=False)  # .grad exists before measuring
        with AllocationPeak() as peak:
            rescore_backward(model, source, s, obj, 1000, prefix_sharing=False)
        peaks[coef] = peak.peak_bytes
    logits = int(s.lengths.sum()) * V * 8  # the chunk's (C, T, V) float64 logits
    assert peaks[0.1] - peaks[0.0] <= 3 * fused.BLOCK_BYTES, peaks  # p and p * log p, one block each
    assert peaks[0.1] - peaks[0.0] < logits / 4, (peaks, logits)


def _high_entropy_mask(H, mask, q):
    """TRL's get_high_entropy_mask (one process)."""
    local = H.detach()[mask.bool()].float()
    threshold = torch.quantile(local, 1 - q)
    return ((H.detach() * mask) >= threshold) & mask.bool()


@pytest.mark.parametrize("coef", [0.0, COEF])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_top_entropy_quantile_is_exact_for_every_chunk(level, coef):
    """TRL's top_entropy_quantile: the policy term (and the bonus, averaged over them) on the positions of
    highest entropy only, the threshold from every row's entropies (the statistics pass, `step`)."""
    model, source = tiny_model(), toy_batch()
    s = _candidates(model, source, 3, MAX_LEN)
    _moved(model, scale=1.0)
    g = torch.Generator().manual_seed(4)
    adv = advantages(torch.rand(len(s), generator=g, dtype=torch.float64), s.owner, 3)
    ref = s.token_scores + 0.3 * torch.randn(s.token_scores.shape, generator=g, dtype=torch.float64)
    obj = policy_loss(adv, s.token_scores, lengths=s.lengths, loss_type="grpo", beta=0.04, ref_token_logps=ref,
                      epsilon_high=0.28, importance_sampling_level=level, entropy_coef=coef,
                      top_entropy_quantile=0.4)
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        tok = protocol.token_scores(model, model.encode(source), s.tokens, s.owner)
        mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id).double()
        H = _entropies(model, source, s)
        em = _high_entropy_mask(H, mask, 0.4).double()
        assert 0 < em.sum() < mask.sum()
        want_loss = _trl_loss(tok, mask, adv, s.token_scores, ref, loss_type="grpo", beta=0.04, level=level,
                              is_ratio=em)  # TRL multiplies the policy term by the mask as by a ratio
        if coef:
            want_loss = want_loss - coef * (H * em).sum() / em.sum()
    want_loss.backward()
    want = take_grads(model)
    for tree in (True, False):
        for chunk in (1, 3, 1000):
            loss = rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree)
            assert loss == pytest.approx(want_loss.item(), rel=1e-10, abs=1e-13), (tree, chunk)
            for a, b in zip(take_grads(model), want):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def _step_oracle(model, source, s):
    """((N, T) log p of the rows' tokens, (N, T) entropies), with a graph, by the model's `step` row by row."""
    enc = model.encode(source)
    prev = protocol.teacher_forced_inputs(s.tokens, model.bos_id)
    state, toks, ents = model.init_state(enc, s.owner), [], []
    for t in range(s.tokens.shape[1]):
        state, log_probs = model.step(enc, s.owner, prev[:, t], state)  # (N, V)
        toks.append(log_probs.gather(1, s.tokens[:, t:t + 1]).squeeze(1))
        p = log_probs.exp()
        ents.append(-(p * log_probs.masked_fill(p == 0, 0.0)).sum(-1))
    mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id)
    tok, H = torch.stack(toks, 1), torch.stack(ents, 1)
    return torch.where(mask, tok, torch.zeros_like(tok)), torch.where(mask, H, torch.zeros_like(H))


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_hf_wrappers_entropy_bonus_and_mask(kind):
    """The HF wrappers: the bonus through their head's by-hand output layer (the causal LM's first positions by
    autograd), the mask's entropies by their `step`; against autograd through `step` itself."""
    pytest.importorskip("transformers")
    from test_hf import PROMPTS, _batch, _wrapped
    model = _wrapped(kind)
    source = _batch(PROMPTS, model.pad_id, left=kind != "t5")
    s = _candidates(model, source, 3, MAX_LEN)
    _moved(model, scale=1.0)
    g = torch.Generator().manual_seed(4)
    adv = advantages(torch.rand(len(s), generator=g, dtype=torch.float64), s.owner, 3)
    obj = policy_loss(adv, s.token_scores, lengths=s.lengths, loss_type="dapo", epsilon_high=0.28,
                      entropy_coef=COEF, top_entropy_quantile=0.5)
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        tok, H = _step_oracle(model, source, s)
        mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id).double()
        em = _high_entropy_mask(H, mask, 0.5).double()
        want_loss = _trl_loss(tok, mask, adv, s.token_scores, None, loss_type="dapo", beta=0.0, is_ratio=em) \
            - COEF * (H * em).sum() / em.sum()
    want_loss.backward()
    want = take_grads(model)
    for chunk in (2, 1000):
        loss = rescore_backward(model, source, s, obj, chunk)
        assert loss == pytest.approx(want_loss.item(), rel=1e-9)
        for a, b in zip(take_grads(model), want):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
