"""`Samples.token_scores`: phase one's per-token log-probabilities are the model's own teacher-forced ones
(its `token_scores`, and `step` run row by row), 0 past each row's end, and sum to `scores`; `select`, `cat` and
`of_targets` carry them. Every family: the built-in LSTM, protocol-only models, Karel, the HF wrappers."""
import importlib.util

import pytest
import torch

import foreign_models
from conftest import tiny_model, toy_batch
from twophase import beam_search, greedy, protocol, sample
from twophase.phase1.onephase import one_phase_beam_search, one_phase_sample
from twophase.samples import Samples

pytestmark = pytest.mark.usefixtures("one_thread")


def _check(model, source, s, atol=1e-10):
    assert s.token_scores is not None and s.token_scores.shape == s.tokens.shape
    mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id)
    assert (s.token_scores[~mask] == 0).all()
    torch.testing.assert_close(s.token_scores.sum(1), s.scores, rtol=0, atol=atol)
    with torch.no_grad(), protocol.scoring_mode(model):
        enc = model.encode(source)
        stepped = protocol.step_token_scores(model, enc, s.tokens, s.owner)
        own = protocol.token_scores(model, enc, s.tokens, s.owner)
    torch.testing.assert_close(stepped.to(s.token_scores.dtype), s.token_scores, rtol=0, atol=atol)
    torch.testing.assert_close(own.to(s.token_scores.dtype), s.token_scores, rtol=0, atol=atol)


def _searches(model, source):
    g = torch.Generator().manual_seed(0)
    yield beam_search(model, source, 5, 6)
    yield sample(model, source, 4, 6, generator=g)
    yield greedy(model, source, 6)


@pytest.mark.parametrize("compact_at", [2.0, 0.0])
def test_lstm_search_and_one_phase(compact_at, monkeypatch):
    from twophase.phase1 import search
    monkeypatch.setattr(search, "COMPACT_AT", compact_at)
    model, source = tiny_model(), toy_batch()
    for s in _searches(model, source):
        _check(model, source, s)
    for s, _ in (one_phase_beam_search(model, source, 5, 6),
                 one_phase_sample(model, source, 4, 6, generator=torch.Generator().manual_seed(0))):
        assert not s.token_scores.requires_grad
        _check(model, source, s)


@pytest.mark.parametrize("name", ["transformer", "scored-transformer", "gru", "end-is-pad"])
def test_protocol_models(name):
    model, source = foreign_models.make(name), foreign_models.sources(name)
    for s in _searches(model, source):
        _check(model, source, s)


def test_karel_model():
    from test_karel_task import grids, tiny_model as karel_model
    model, source = karel_model(), grids()
    for s in _searches(model, source):
        _check(model, source, s)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("kind", ["t5", "llama", "gpt2"])
def test_hf_wrappers(kind):
    from test_hf import PROMPTS, _batch, _wrapped
    wrapper = _wrapped(kind)
    source = _batch(PROMPTS, wrapper.pad_id, left=kind != "t5")
    atol = 1e-6 if kind in ("t5", "llama") else 1e-10
    _check(wrapper, source, beam_search(wrapper, source, 3, 5), atol)
    head, wrapper.head = wrapper.head, None  # the full-logits path gives the same numbers
    _check(wrapper, source, sample(wrapper, source, 2, 5, generator=torch.Generator().manual_seed(1)), atol)
    wrapper.head = head


def test_select_cat_and_targets_carry_them():
    model, source = tiny_model(), toy_batch()
    a, b = beam_search(model, source, 3, 4), sample(model, source, 2, 6, generator=torch.Generator().manual_seed(0))
    both = Samples.cat([a, b], model.pad_id)
    assert both.token_scores.shape == both.tokens.shape
    torch.testing.assert_close(both.token_scores.sum(1), both.scores, rtol=0, atol=1e-10)
    rows = torch.tensor([len(a) + 1, 0])
    picked = both.select(rows)
    torch.testing.assert_close(picked.token_scores[1, :a.tokens.shape[1]], a.token_scores[0])
    ref = Samples.of_targets(a.tokens, a.owner, model.pad_id, model.eos_id)
    assert ref.token_scores.shape == a.tokens.shape and (ref.token_scores == 0).all()
    bare = Samples(a.tokens, a.lengths, a.owner, a.scores)  # hand-made, without token scores
    assert bare.select(rows[1:]).token_scores is None and Samples.cat([bare, a], 0).token_scores is None


@pytest.mark.parametrize("kind", ["dfa", "brackets"])
def test_constrained_one_pass_equals_its_step_loop(kind):
    """`Constrained` over a model with per-position distributions gives its per-token log-probs in one pass
    (the policy objectives' phase two), equal to running its own `step` row by row and to what search summed."""
    import grammars
    from twophase.constraints import Constrained
    inner = foreign_models.make("scored-transformer")
    model = Constrained(inner, grammars.make(kind, inner, inner.out.out_features))
    assert callable(getattr(model, "token_scores", None))
    for s in _searches(model, foreign_models.sources("scored-transformer")):
        _check(model, foreign_models.sources("scored-transformer"), s)


def test_constrained_karel_model():
    from test_karel_task import constrained_model, grids
    model = constrained_model(8)
    g = torch.Generator().manual_seed(0)
    for s in (beam_search(model, grids(), 5, 8), sample(model, grids(), 4, 8, generator=g)):
        _check(model, grids(), s)
