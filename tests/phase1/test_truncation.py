"""`sample(..., top_k, top_p, min_len)`: draws from the truncated law `generate` uses (exact support, and its
frequencies by a chi-square test on a fixed seed), while the scores stay the model's own log-probabilities."""
import math

import pytest
import torch

from twophase import sample

V, PAD, BOS, EOS = 8, 0, 1, 2
LOGITS = torch.tensor([0.0, 0.0, 1.0, 2.0, 0.5, 1.5, -1.0, 0.2], dtype=torch.float64)  # pad, bos get -inf below


class Fixed(torch.nn.Module):
    """Every step's next-token distribution is softmax(LOGITS) over the tokens 2..7."""
    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def encode(self, source):
        return source  # (B, 1)

    def init_state(self, enc, owner):
        return torch.zeros(len(owner), 1)

    def step(self, enc, owner, prev, state):
        logits = LOGITS.clone()
        logits[[PAD, BOS]] = float("-inf")
        return state, torch.log_softmax(logits, 0).expand(len(owner), V)


LOGP = Fixed().step(None, torch.zeros(1, dtype=torch.long), None, None)[1][0]  # (V,)


def _law(top_k=None, top_p=None):
    """The truncated, renormalised first-token law, written out as `generate` applies it: the top_k tokens, then
    the nucleus of that renormalised law (tokens in order of probability until their mass reaches top_p)."""
    p = LOGP.exp()
    order = p.argsort(descending=True).tolist()[:top_k or V]
    k_mass = float(p[order].sum())
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for tok in order:
        if (top_p is not None and mass >= top_p) or p[tok] == 0:
            break
        keep[tok] = True
        mass += float(p[tok]) / k_mass
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize("top_k, top_p", [(3, None), (None, 0.6), (4, 0.7), (1, None), (None, 1e-9)])
def test_first_tokens_follow_the_truncated_law(top_k, top_p):
    n = 20000
    s = sample(Fixed(), torch.zeros(1, 1), n, 1, generator=torch.Generator().manual_seed(0), top_k=top_k,
               top_p=top_p)
    q = _law(top_k, top_p)
    counts = torch.bincount(s.tokens[:, 0], minlength=V).double()
    assert set(s.tokens[:, 0].tolist()) == set(q.nonzero().squeeze(1).tolist())  # exact support
    support = q > 0
    chi2 = float(((counts[support] - n * q[support]) ** 2 / (n * q[support])).sum())
    df = int(support.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * max(df, 1))  # far beyond the 1e-6 quantile would fail; a fixed seed
    # the scores are the model's own log p of what was drawn, not the truncated law's
    assert torch.allclose(s.scores, LOGP[s.tokens[:, 0]], rtol=0, atol=1e-12)


def test_min_len_bans_eos_before_it_and_only_then():
    s = sample(Fixed(), torch.zeros(1, 1), 3000, 6, generator=torch.Generator().manual_seed(1), min_len=3)
    assert not (s.tokens[:, :3] == EOS).any()
    assert (s.tokens[:, 3] == EOS).any()  # from position 3 on eos is drawn again
    ended = s.lengths < 6
    assert bool(ended.any()) and int(s.lengths[ended].min()) == 4
    # scores: the sum of the model's own log p over each row's tokens
    want = torch.stack([LOGP[row[:n]].sum() for row, n in zip(s.tokens, s.lengths.tolist())])
    assert torch.allclose(s.scores, want, rtol=0, atol=1e-12)


def test_bad_truncation_is_refused():
    for kwargs in ({"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            sample(Fixed(), torch.zeros(1, 1), 2, 2, **kwargs)


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.8), (7, 0.5)])
def test_truncation_is_generates(top_k, top_p):
    """The tokens `truncate` keeps are those transformers' TopK and TopP warpers keep (a trusted peer)."""
    T = pytest.importorskip("transformers")
    from twophase.phase1.search import truncate
    logits = torch.randn(40, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 3
    theirs = logits.clone()
    if top_k is not None:
        theirs = T.TopKLogitsWarper(top_k)(None, theirs)
    if top_p is not None:
        theirs = T.TopPLogitsWarper(top_p)(None, theirs)
    ours = truncate(logits, EOS, 5, top_k, top_p, 0)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
