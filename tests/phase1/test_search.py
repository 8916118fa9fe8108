"""Phase one: scores equal teacher-forced log-probs; beam search is exact when exhaustive; sampling follows
the model; padding and EOS edge cases."""
import itertools
from collections import Counter

import pytest
import torch

from twophase import beam_search, sample
from twophase.phase1 import search
from twophase.vocab import EOS, PAD

from conftest import tiny_model, toy_batch


def _check_rows(s, max_len):
    assert s.tokens.shape[0] == len(s.lengths) == len(s.owner) == len(s.scores)
    for row, n in zip(s.tokens.tolist(), s.lengths.tolist()):
        assert 1 <= n <= max_len
        assert all(t != PAD for t in row[:n]) and all(t == PAD for t in row[n:])
        assert EOS not in row[: n - 1]  # EOS only ever ends a row
        assert row[n - 1] == EOS or n == max_len
        assert 1 not in row  # never BOS


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", ["beam", "sample"])
def test_scores_equal_teacher_forced_log_probs(kind, bidirectional):
    model = tiny_model(bidirectional=bidirectional)
    src, lens = toy_batch()
    if kind == "beam":
        s = beam_search(model, (src, lens), beam_size=6, max_len=5)
    else:
        s = sample(model, (src, lens), num_samples=6, max_len=5, generator=torch.Generator().manual_seed(0))
    _check_rows(s, 5)
    assert set(s.owner.tolist()) == {0, 1, 2}
    with torch.no_grad():
        lp = model.sequence_log_probs(src, lens, s.tokens, s.owner)
    torch.testing.assert_close(lp, s.scores, rtol=0, atol=1e-9)


def test_beam_is_sorted_best_first_per_source(model, batch):
    s = beam_search(model, batch, beam_size=5, max_len=4)
    for b in range(3):
        sc = s.scores[s.owner == b]
        assert torch.all(sc[:-1] >= sc[1:])


def _all_sequences(tokens, max_len):
    """Every row beam search can return: w + EOS for |w| < max_len, and w of length max_len."""
    out = []
    for n in range(max_len + 1):
        for w in itertools.product(tokens, repeat=n):
            out.append(list(w) + [EOS] if n < max_len else list(w))
    return out


@pytest.mark.parametrize("compact_at", [2.0, 0.0])  # never / as soon as a row finished (see search.COMPACT_AT)
@pytest.mark.parametrize("beam_size", [13, 40, 60])
def test_exhaustive_beam_equals_brute_force(beam_size, compact_at, monkeypatch):
    # Target vocab: PAD BOS EOS UNK + 2 tokens, so 3 generable non-EOS tokens (UNK included). Beams of 40 and 60
    # hold impossible (-inf) hypotheses, which compaction skips as it skips finished ones.
    monkeypatch.setattr(search, "COMPACT_AT", compact_at)
    model = tiny_model(tgt_vocab=6)
    src, lens = toy_batch(lengths=(2, 1))
    max_len = 3
    seqs = _all_sequences([3, 4, 5], max_len)  # 1 + 3 + 9 ended, 27 cut at max_len: 40 in all
    rows = torch.full((len(seqs), max_len), PAD, dtype=torch.long)
    for i, q in enumerate(seqs):
        rows[i, : len(q)] = torch.tensor(q)
    s = beam_search(model, (src, lens), beam_size=beam_size, max_len=max_len)
    for b in range(2):
        with torch.no_grad():
            lp = model.sequence_log_probs(src, lens, rows, torch.full((len(seqs),), b))
        k = min(beam_size, len(seqs))  # a beam of 13 is as wide as all prefixes shorter than max_len
        best = lp.topk(k)
        got = s.select(torch.nonzero(s.owner == b).squeeze(1))
        assert len(got) == k
        torch.testing.assert_close(got.scores, best.values, rtol=0, atol=1e-9)
        want = {tuple(x for x in rows[i].tolist() if x != PAD) for i in best.indices.tolist()}
        have = {tuple(x for x in r if x != PAD) for r in got.tokens.tolist()}
        assert have == want


def test_sampling_frequencies_follow_the_model():
    model = tiny_model(tgt_vocab=6, seed=3)
    with torch.no_grad():
        model.out.weight.mul_(0.2)  # flatter distribution: many sequences with visible mass
    src, lens = toy_batch(lengths=(2,))
    n = 20000
    s = sample(model, (src, lens), num_samples=n, max_len=2, generator=torch.Generator().manual_seed(0))
    counts = Counter(tuple(r) for r in s.tokens.tolist())
    probs = {}
    for row, sc in zip(s.tokens.tolist(), s.scores.tolist()):
        probs[tuple(row)] = sc
    assert abs(sum(torch.tensor(list(probs.values())).exp().tolist()) - 1) < 0.05  # nearly all mass was seen
    for seq, lp in probs.items():
        p = float(torch.tensor(lp).exp())
        # 5 standard deviations of a binomial proportion
        assert abs(counts[seq] / n - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-3, (seq, counts[seq] / n, p)


def test_samples_are_independent_per_row(model, batch):
    s = sample(model, batch, num_samples=50, max_len=4, generator=torch.Generator().manual_seed(0))
    distinct = {tuple(r) for r in s.tokens[s.owner == 0].tolist()}
    assert len(distinct) > 1


def test_eos_first_token_gives_length_one_rows():
    model = tiny_model()
    with torch.no_grad():
        model.out.bias[EOS] = 100.0
    src, lens = toy_batch()
    s = beam_search(model, (src, lens), beam_size=3, max_len=4)
    top = s.select(torch.tensor([0, len(s) // 3, 2 * len(s) // 3]))
    assert torch.all(s.tokens[:, 0][s.lengths == 1] == EOS)
    assert (s.lengths == 1).sum() == 3  # the best of each source is EOS alone
    r = sample(model, (src, lens), num_samples=4, max_len=4, generator=torch.Generator().manual_seed(0))
    assert r.tokens.shape == (12, 1) and torch.all(r.tokens == EOS)
    with torch.no_grad():
        for x in (s, r, top):
            torch.testing.assert_close(model.sequence_log_probs(src, lens, x.tokens, x.owner), x.scores,
                                       rtol=0, atol=1e-9)


def test_no_eos_within_max_len():
    model = tiny_model()
    with torch.no_grad():
        model.out.bias[EOS] = -100.0
    src, lens = toy_batch()
    for s in (beam_search(model, (src, lens), beam_size=3, max_len=4),
              sample(model, (src, lens), num_samples=3, max_len=4, generator=torch.Generator().manual_seed(0))):
        assert torch.all(s.lengths == 4) and not torch.any(s.tokens == EOS)
        with torch.no_grad():
            torch.testing.assert_close(model.sequence_log_probs(src, lens, s.tokens, s.owner), s.scores,
                                       rtol=0, atol=1e-9)


def test_source_padding_is_ignored(model):
    # The same source alone and padded inside a batch with a longer one must score identically.
    src, lens = toy_batch(lengths=(1, 6))
    alone = beam_search(model, (src[:1, :1], lens[:1]), beam_size=4, max_len=5)
    inside = beam_search(model, (src, lens), beam_size=4, max_len=5)
    first = inside.select(torch.nonzero(inside.owner == 0).squeeze(1))
    assert alone.tokens.tolist() == first.tokens[:, : alone.tokens.shape[1]].tolist()
    torch.testing.assert_close(alone.scores, first.scores, rtol=0, atol=1e-9)


def test_beam_search_in_source_blocks_finds_the_same_beams(monkeypatch):
    from twophase.models import fused

    model = tiny_model()
    src, lens = toy_batch(lengths=(3, 1, 5, 2, 4))
    whole = beam_search(model, (src, lens), beam_size=4, max_len=6)
    monkeypatch.setattr(fused, "BLOCK_BYTES", 4 * 7 * 8 * 2)  # two sources' (K*V) candidates per block
    blocked = beam_search(model, (src, lens), beam_size=4, max_len=6)
    assert torch.equal(blocked.tokens, whole.tokens) and torch.equal(blocked.owner, whole.owner)
    torch.testing.assert_close(blocked.scores, whole.scores, rtol=1e-12, atol=1e-12)  # not bitwise: see test_fast_paths


def test_draw_follows_unnormalised_probs_and_never_draws_zeros():
    """`search.draw` (inverse CDF at one uniform per row, by blocks) against the probabilities it is given: frequencies
    within 5 binomial standard deviations, tokens of probability 0 never drawn (first, middle and last ones)."""
    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 3.0], [5.0, 0, 0, 0, 0, 0]])
    n = 20000
    rows = probs.repeat_interleave(n, dim=0)  # (3n, V)
    for block in (64, 2, 4):  # one block; whole blocks; a padded last block (V = 6)
        drawn = search.draw(rows, torch.Generator().manual_seed(block), block=block).reshape(3, n)
        assert not bool((probs.gather(1, drawn) == 0).any())
        p = probs[0] / probs[0].sum()
        freq = torch.bincount(drawn[0], minlength=6).double() / n
        assert bool(((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9).all()), (block, freq)
        assert drawn[1].eq(5).all() and drawn[2].eq(0).all()
    with pytest.raises(ValueError, match="no positive mass"):
        search.draw(torch.tensor([[0.5, 0.5], [0.0, 0.0]]))
