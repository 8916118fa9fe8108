"""--include-reference: RL_beam over each source's candidates and its reference (Bunel et al. 2018), in float64.

The coefficients equal the hand formula over the set candidates ∪ {reference} (a reference the beam already holds
counted once), and phase two's chunked gradient equals one backward of the expected reward they stand for."""
import pytest
import torch

from twophase import beam_search, objectives, protocol, rescore_backward
from twophase.samples import Samples
from twophase.train.evaluation import with_references
from twophase.vocab import pad_targets

from conftest import tiny_model, toy_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def setup():
    model = tiny_model()
    src, lengths = toy_batch()
    source = (src, lengths)
    cand = beam_search(model, source, 3, 4)
    # Source 0's reference is its beam's second candidate (already held); 1's and 2's are new sequences.
    second = cand.tokens[cand.owner == 0][1]
    held = second[:int(cand.lengths[cand.owner == 0][1]) - 1].tolist()  # its tokens, EOS dropped
    refs_ids = [held, [4, 5, 6, 4, 5], [6, 6, 5, 4, 4]]  # longer than the beam can find
    assert held and held[-1] != model.eos_id
    tgt = pad_targets(refs_ids, None, model.pad_id, model.eos_id)
    refs = Samples.of_targets(tgt, torch.tensor([0, 1, 2]), model.pad_id, model.eos_id)
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(len(cand), generator=g, dtype=torch.float64)
    rewards[(cand.owner == 0).nonzero()[1]] = 1.0  # the copy of the reference: its reward is the reference's
    ref_rewards = torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64)
    rows, r = with_references(model, source, cand, rewards, refs, ref_rewards)
    return model, source, cand, refs, rows, r


def key(tokens, length):
    return tuple(tokens[:length].tolist())


def test_coefficients_equal_the_hand_formula_over_candidates_and_reference():
    model, source, cand, refs, rows, r = setup()
    B = 3
    assert len(rows) == len(cand) + 3
    with torch.no_grad(), protocol.scoring_mode(model):
        want_scores = protocol.score(model, model.encode(source), refs.tokens, refs.owner)
    torch.testing.assert_close(rows.scores[len(cand):], want_scores, rtol=0, atol=1e-12)
    c = objectives.beam(r, rows.scores, rows.owner, B, tokens=rows.tokens)
    want = torch.zeros(len(rows), dtype=torch.float64)
    for b in range(B):
        mine = [i for i in range(len(rows)) if rows.owner[i] == b]
        groups = {}
        for i in mine:
            groups.setdefault(key(rows.tokens[i], int(rows.lengths[i])), []).append(i)
        sets = list(groups.values())
        assert len(sets) == (3 if b == 0 else 4)  # source 0's reference was in its beam: one candidate, two rows
        s = torch.stack([rows.scores[g].mean() for g in sets])
        q = torch.softmax(s, 0)
        rr = torch.stack([r[g].mean() for g in sets])
        expected = (q * rr).sum()
        for qi, ri, g in zip(q, rr, sets):
            for i in g:
                want[i] = -qi * (ri - expected) / B / len(g)
    torch.testing.assert_close(c, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("chunk", [1, 4])
def test_chunked_gradient_equals_one_backward_of_the_expected_reward(chunk):
    model, source, cand, refs, rows, r = setup()
    B = 3
    c = objectives.beam(r, rows.scores, rows.owner, B, tokens=rows.tokens)
    model.zero_grad(set_to_none=True)
    rescore_backward(model, source, rows, c, chunk)
    got = [p.grad.clone() for p in model.parameters()]
    # One backward of -(1/B) sum_b E_q[r] over the distinct sequences of each source, q = softmax(log p).
    inverse, copies = objectives.distinct(rows.owner, rows.tokens)
    first = [int((inverse == u).nonzero()[0]) for u in range(len(copies))]
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        log_p = protocol.score(model, model.encode(source), rows.tokens[first], rows.owner[first])
    owner_u = rows.owner[first]
    r_u = r[first]
    loss = 0.0
    for b in range(B):
        m = owner_u == b
        loss = loss - (torch.softmax(log_p[m], 0) * r_u[m]).sum() / B
    loss.backward()
    for p, w in zip(model.parameters(), got):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-11)
    assert any(float(w.abs().sum()) > 0 for w in got)
