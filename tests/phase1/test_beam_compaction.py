"""Beam search advancing only its open hypotheses (`search.COMPACT_AT`) finds the very beams, scores and
one-phase gradients of the full step, also when whole sources finish early and their beams are left out."""
import pytest
import torch

from twophase import beam_search
from twophase.models import fused
from twophase.phase1 import search
from twophase.phase1.onephase import one_phase_beam_search
from twophase.vocab import EOS

from conftest import tiny_model, toy_batch

ON, OFF = 0.0, 2.0  # compact as soon as one row finished / never (a fraction above 1)
LENGTHS = (3, 1, 5, 2, 4, 6)

pytestmark = pytest.mark.usefixtures("one_thread")


def _eos_model(seed, eos_bias):
    model = tiny_model(seed=seed)
    with torch.no_grad():
        model.out.bias[EOS] += eos_bias  # EOS likely enough that hypotheses finish at different steps
    return model


def _spy(monkeypatch):
    """Record, for every compacted step, (sources, open rows, their rows) summed over its blocks."""
    steps = []
    step, extensions = search._compact_step, search._open_extensions

    def step_spy(*args):
        steps.append((0, 0, 0))
        return step(*args)

    def extensions_spy(model, h, scores, at, *rest):
        steps[-1] = tuple(x + y for x, y in zip(steps[-1], (scores.shape[0], h.shape[0], scores.numel())))
        return extensions(model, h, scores, at, *rest)

    monkeypatch.setattr(search, "_compact_step", step_spy)
    monkeypatch.setattr(search, "_open_extensions", extensions_spy)
    return steps


def _search_both(monkeypatch, search_fn):
    out = {}
    for at in (OFF, ON):
        monkeypatch.setattr(search, "COMPACT_AT", at)
        out[at] = search_fn()
    return out[OFF], out[ON]


# (seed, EOS bias): rows finish at steps 1 to 7, all 6 sources open to the end; sources finish from step 2 on,
# the last one runs alone to step 7.
CASES = {"rows finish at different steps": (1, 0.0), "whole sources finish early": (0, 0.0)}


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_compaction_finds_the_same_beams(monkeypatch, case, blocks):
    model = _eos_model(*CASES[case])
    src, lens = toy_batch(lengths=LENGTHS)
    if blocks:
        monkeypatch.setattr(fused, "BLOCK_BYTES", 2 * 4 * 7 * 8)  # two sources' (K*V) fp64 candidates per block
    seen = _spy(monkeypatch)
    full, compact = _search_both(monkeypatch, lambda: beam_search(model, (src, lens), beam_size=4, max_len=8))
    assert any(rows < n for _, rows, n in seen)  # finished rows were skipped
    if case == "whole sources finish early":
        assert min(b for b, _, _ in seen) < len(LENGTHS)  # sources left out
    assert len(set(compact.lengths.tolist())) > 2
    assert torch.equal(compact.tokens, full.tokens) and torch.equal(compact.owner, full.owner)
    torch.testing.assert_close(compact.scores, full.scores, rtol=0, atol=1e-12)
    with torch.no_grad():
        lp = model.sequence_log_probs(src, lens, compact.tokens, compact.owner)
    torch.testing.assert_close(lp, compact.scores, rtol=0, atol=1e-9)


def test_no_finished_row_takes_the_full_step(monkeypatch):
    model = tiny_model()
    model.banned[EOS] = True  # as the benchmark: no hypothesis ever finishes
    src, lens = toy_batch(lengths=LENGTHS)
    monkeypatch.setattr(search, "COMPACT_AT", ON)
    monkeypatch.setattr(search, "_compact_step", None)  # calling it would raise
    s = beam_search(model, (src, lens), beam_size=4, max_len=5)
    assert torch.all(s.lengths == 5)


def test_compaction_keeps_the_one_phase_gradient(monkeypatch):
    model = _eos_model(*CASES["whole sources finish early"])
    src, lens = toy_batch(lengths=LENGTHS)
    seen = _spy(monkeypatch)

    def search_and_backward():
        cand, log_p = one_phase_beam_search(model, (src, lens), 4, 8)
        coef = torch.linspace(-1, 1, len(cand), dtype=log_p.dtype)
        (coef * log_p).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return cand, log_p.detach(), grads

    (full, full_lp, full_g), (compact, compact_lp, compact_g) = _search_both(monkeypatch, search_and_backward)
    assert seen and any(rows < n for _, rows, n in seen)
    assert torch.equal(compact.tokens, full.tokens) and torch.equal(compact.owner, full.owner)
    torch.testing.assert_close(compact_lp, full_lp, rtol=0, atol=1e-12)
    assert any(g.abs().max() > 0 for g in full_g)
    for a, b in zip(compact_g, full_g):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
