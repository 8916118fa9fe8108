"""The one-phase baseline finds phase one's candidates and its single backward gives phase two's gradient; the
seed-style step (per-beam U y, plain autograd) is the same function with the same parameters."""

import pytest
import torch

from twophase import beam_search, objectives, rescore_backward, sample
from benchmarks.seedstyle import SeedStyleSeq2Seq
from twophase.phase1.onephase import one_phase_backward, one_phase_beam_search, one_phase_sample
from twophase.vocab import EOS

from conftest import take_grads, tiny_model, toy_batch

K, MAX_LEN = 5, 6


pytestmark = pytest.mark.usefixtures("one_thread")


def _search(model, kind, src, lens, graph):
    if kind == "beam":
        return (one_phase_beam_search if graph else beam_search)(model, (src, lens), K, MAX_LEN)
    g = torch.Generator().manual_seed(7)
    fn = one_phase_sample if graph else sample
    return fn(model, (src, lens), K, MAX_LEN, generator=g)


def _coefficients(objective, cand, B):
    rewards = torch.rand(len(cand), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if objective == "beam":
        return objectives.beam(rewards, cand.scores, cand.owner, B, tokens=cand.tokens)
    if objective == "mrt":
        return objectives.mrt(rewards, cand.scores, cand.owner, B, alpha=0.5, tokens=cand.tokens)
    return objectives.reinforce(rewards, cand.owner, B, "mean")


def _assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("kind", ["beam", "sample"])
@pytest.mark.parametrize("objective", ["beam", "mrt", "reinforce"])
def test_one_phase_gradient_equals_two_phase(kind, objective):
    model = tiny_model(bidirectional=objective == "mrt")
    src, lens = toy_batch()
    two = _search(model, kind, src, lens, graph=False)
    one, log_p = _search(model, kind, src, lens, graph=True)
    assert torch.equal(one.tokens, two.tokens) and torch.equal(one.owner, two.owner)
    torch.testing.assert_close(one.scores, two.scores, rtol=0, atol=1e-12)
    assert log_p.requires_grad and not one.scores.requires_grad
    coef = _coefficients(objective, two, src.shape[0])
    one_loss = one_phase_backward(log_p, coef)
    g_one = take_grads(model)
    two_loss = rescore_backward(model, (src, lens), two, coef, chunk_size=4)
    g_two = take_grads(model)
    assert one_loss == pytest.approx(two_loss, rel=1e-9)
    assert any(g.abs().max() > 0 for g in g_two)
    _assert_same(g_one, g_two)


@pytest.mark.parametrize("kind", ["beam", "sample"])
def test_seed_style_matches_one_phase(kind):
    model = tiny_model()
    seed = SeedStyleSeq2Seq.from_model(model)
    src, lens = toy_batch()
    one, log_p = _search(model, kind, src, lens, graph=True)
    other, seed_log_p = _search(seed, kind, src, lens, graph=True)
    assert torch.equal(one.tokens, other.tokens) and torch.equal(one.owner, other.owner)
    torch.testing.assert_close(seed_log_p, log_p, rtol=1e-9, atol=1e-10)
    coef = _coefficients("beam", one, src.shape[0])
    one_phase_backward(log_p, coef)
    one_phase_backward(seed_log_p, coef)
    seed.release()
    _assert_same(take_grads(seed), take_grads(model))


def test_seed_style_search_runs_the_seed_code(monkeypatch):
    """Both search loops must reach `seed_style_advance` at every step (a regression once made the seed-style
    benchmark run the fused attention instead)."""
    from benchmarks import seedstyle as onephase

    calls = []
    real = onephase.seed_style_advance

    def counted(model, beam_memory, prev, state):
        calls.append(len(prev))
        return real(model, beam_memory, prev, state)

    monkeypatch.setattr(onephase, "seed_style_advance", counted)
    seed = SeedStyleSeq2Seq.from_model(tiny_model())
    seed.banned[EOS] = True  # every row runs MAX_LEN steps, so no row is ever skipped
    src, lens = toy_batch()
    for kind in ("beam", "sample"):
        calls.clear()
        _search(seed, kind, src, lens, graph=True)
        assert calls == [K * src.shape[0]] * MAX_LEN, kind
    seed.release()


def test_one_phase_backward_checks_the_coefficients():
    with pytest.raises(ValueError, match="expected 3 coefficients"):
        one_phase_backward(torch.zeros(3, requires_grad=True), torch.zeros(2))
