"""`Samples.from_completions`: any generator's completions as phase two's rows (cut after the first eos, padded),
scores from the generator's log-probabilities or unknown (NaN), and the same gradient as search's own rows."""
import math

import pytest
import torch

from twophase import Samples, objectives, rescore_backward, sample
from twophase.vocab import EOS, PAD

from conftest import take_grads, tiny_model, toy_batch


def test_rows_are_cut_after_eos_and_padded():
    s = Samples.from_completions([[4, 5, EOS, 6, 6], [7], [EOS, 4]], [0, 0, 1], PAD, EOS,
                                 token_logps=[[-1.0, -2.0, -0.5, -9.0, -9.0], [-0.25], [-3.0, -9.0]])
    assert s.tokens.tolist() == [[4, 5, EOS], [7, PAD, PAD], [EOS, PAD, PAD]]
    assert s.lengths.tolist() == [3, 1, 1] and s.owner.tolist() == [0, 0, 1]
    assert s.scores.tolist() == [-3.5, -0.25, -3.0]  # the kept positions' log-probabilities only
    unknown = Samples.from_completions(torch.tensor([[4, EOS], [5, 6]]), torch.tensor([0, 1]), PAD, EOS)
    assert all(math.isnan(x) for x in unknown.scores.tolist())
    with pytest.raises(ValueError, match="2 completions but 3 owners"):
        Samples.from_completions([[4], [5]], [0, 0, 1], PAD, EOS)


def test_external_rows_train_as_search_rows(one_thread):
    model, (src, lengths) = tiny_model(), toy_batch()
    cand = sample(model, (src, lengths), 4, 6, generator=torch.Generator().manual_seed(0))
    # what a generator hands over: each row with junk after its eos, and no scores
    junk = [row[:n] + [5] * (6 - n) for row, n in zip(cand.tokens.tolist(), cand.lengths.tolist())]
    ext = Samples.from_completions(junk, cand.owner, PAD, EOS)
    assert torch.equal(ext.tokens, cand.tokens) and torch.equal(ext.lengths, cand.lengths)
    r = torch.rand(len(cand), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    c = objectives.reinforce(r, cand.owner, 3, "mean")
    rescore_backward(model, (src, lengths), cand, c, chunk_size=3)
    want = take_grads(model)
    rescore_backward(model, (src, lengths), ext, c, chunk_size=5)
    assert all(torch.allclose(g, w, rtol=1e-12, atol=1e-14) for g, w in zip(take_grads(model), want))
    with pytest.raises(ValueError, match="unknown"):
        objectives.beam(r, ext.scores, ext.owner, 3, tokens=ext.tokens)
