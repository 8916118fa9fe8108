"""`Constrained(model, grammar)`: the protocol suite's exactness checks (tests/core/test_protocol.py) for the foreign
test models, each under a random DFA and under a bracket language (a stack in tensors), against an oracle that
renormalises the unconstrained model's step-by-step distributions in plain Python (tests/grammars.py)."""
import itertools
import math
import re
from pathlib import Path

import pytest
import torch

import foreign_models as fm
import grammars
from conftest import take_grads
from twophase import Samples, beam_search, protocol, rescore_backward, sample
from twophase.constraints import Constrained, GrammarError
from twophase.phase1 import search
from twophase.phase1.onephase import one_phase_backward, one_phase_beam_search
from twophase.phase2.rescoring import shares_prefixes

K, MAX_LEN, B = 3, 4, 3
NAMES = fm.NAMES + ("scored-transformer",)
KINDS = tuple(grammars.GRAMMARS)

pytestmark = pytest.mark.usefixtures("one_thread")


def _make(name, kind, **kwargs):
    model = fm.make(name, **kwargs)
    return Constrained(model, grammars.make(kind, model, model.out.out_features)), fm.sources(name)


def _oracle(c: Constrained, source, tokens, owner):
    """(N,) constrained log p of rows, with a graph: the model's own `step` teacher-forced, each position's
    distribution renormalised over the Python grammar's allowed set; -inf where a token is not allowed."""
    model, g = c.model, c.grammar
    with protocol.scoring_mode(model):
        enc = model.encode(source)
        prev = protocol.teacher_forced_inputs(tokens, model.bos_id)
        mask = protocol.target_mask(tokens, model.pad_id, model.eos_id)
        state, rows = model.init_state(enc, owner), [[] for _ in range(len(owner))]
        for t in range(tokens.shape[1]):
            state, logp = model.step(enc, owner, prev[:, t], state)  # (N, V)
            for i in range(len(owner)):
                if mask[i, t]:
                    ok = g.allowed_after(tokens[i, :t].tolist())
                    tok = int(tokens[i, t])
                    if tok not in ok:
                        rows[i].append(logp.new_tensor(-math.inf))
                    else:
                        rows[i].append(logp[i, tok] - logp[i, sorted(ok)].logsumexp(0))
    return torch.stack([torch.stack(r).sum() for r in rows])


def _check_in_language(c, s, max_len):
    """No candidate holds a disallowed token; a row ends with an allowed eos, or is cut at max_len."""
    for row, n in zip(s.tokens.tolist(), s.lengths.tolist()):
        for t in range(n):
            assert row[t] in c.grammar.allowed_after(row[:t]), row
        assert row[n - 1] == c.eos_id or n == max_len, row


def _search(c, source, kind, k=K, max_len=MAX_LEN):
    if kind == "beam":
        return beam_search(c, source, k, max_len)
    return sample(c, source, k, max_len, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind", ["beam", "sample"])
@pytest.mark.parametrize("grammar", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_search_scores_are_the_constrained_teacher_forced_log_probs(name, grammar, kind):
    c, source = _make(name, grammar)
    s = _search(c, source, kind, k=4)
    _check_in_language(c, s, MAX_LEN)
    assert c.training and set(s.owner.tolist()) == set(range(B))
    with torch.no_grad(), protocol.scoring_mode(c):
        enc = c.encode(source)
        torch.testing.assert_close(protocol.step_score(c, enc, s.tokens, s.owner), s.scores, rtol=0, atol=1e-9)
        torch.testing.assert_close(protocol.score(c, enc, s.tokens, s.owner), s.scores, rtol=0, atol=1e-9)
        torch.testing.assert_close(_oracle(c, source, s.tokens, s.owner), s.scores, rtol=0, atol=1e-9)


def _allowed_sequences(c, vocab, max_len):
    """(M, max_len) every row the constrained model may return: allowed words + eos, or cut at max_len."""
    words = grammars.generable(vocab, (c.pad_id, c.bos_id, c.eos_id))
    rows = []
    for n in range(max_len + 1):
        for w in itertools.product(words, repeat=n):
            if all(w[t] in c.grammar.allowed_after(w[:t]) for t in range(n)):
                if n < max_len and c.eos_id not in c.grammar.allowed_after(w):
                    continue
                row = list(w) + ([c.eos_id] if n < max_len else [])
                rows.append(row + [c.pad_id] * (max_len - len(row)))
    return torch.tensor(rows)


@pytest.mark.parametrize("grammar", KINDS)
@pytest.mark.parametrize("name", fm.NAMES)
def test_exhaustive_beam_equals_brute_force_over_the_allowed_sequences(name, grammar, monkeypatch):
    monkeypatch.setattr(search, "COMPACT_AT", 0.0)  # compaction on from the first finished row
    monkeypatch.setattr(search, "BLOCK_BYTES", 1)  # candidate scores one source at a time (the split's slices)
    c, source = _make(name, grammar)
    source, max_len = fm.sources(name, B=2), 3
    rows = _allowed_sequences(c, c.model.out.out_features, max_len)
    with torch.no_grad():
        lp = torch.cat([_oracle(c, source, rows, torch.full((len(rows),), b)) for b in range(2)]).view(2, -1)
    s = beam_search(c, source, beam_size=len(rows) + 3, max_len=max_len)
    _check_in_language(c, s, max_len)
    for b in range(2):
        finite = torch.isfinite(lp[b])
        got = s.select(torch.nonzero(s.owner == b).squeeze(1))
        assert len(got) == int(finite.sum())
        best = lp[b][finite].sort(descending=True).values
        torch.testing.assert_close(got.scores, best, rtol=0, atol=1e-9)
        assert float(lp[b][finite].exp().sum()) == pytest.approx(1.0, abs=1e-9)  # a distribution over them


def _reference_grads(c, source, s, coef):
    c.zero_grad(set_to_none=True)
    total = (coef * _oracle(c, source, s.tokens, s.owner)).sum()
    total.backward()
    return take_grads(c), float(total.detach())


@pytest.mark.parametrize("grammar", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_chunked_gradient_is_exact_at_every_chunk_size(name, grammar):
    c, source = _make(name, grammar)
    cand = _search(c, source, "beam")
    refs = _search(c, source, "sample", k=1)  # rows of the language, as a task's references are
    s = Samples.cat([cand, refs], c.pad_id)
    coef = torch.cat([fm.coefficients("beam", cand, B), 0.3 * fm.coefficients("mle", refs, B)])
    want, total = _reference_grads(c, source, s, coef)
    assert any(float(g.abs().sum()) > 0 for g in want)
    for chunk in (1, 3, len(s)):
        value = rescore_backward(c, source, s, coef, chunk_size=chunk, oom_retry=chunk == 3)
        assert value == pytest.approx(total, abs=1e-10)
        for g, w in zip(take_grads(c), want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    assert c.training


@pytest.mark.parametrize("name", fm.NAMES)
def test_one_phase_equals_two_phase(name):
    c, source = _make(name, "brackets")
    two = _search(c, source, "beam")
    one, log_p = one_phase_beam_search(c, source, K, MAX_LEN)
    assert torch.equal(one.tokens, two.tokens)
    coef = fm.coefficients("beam", two, B)
    loss = one_phase_backward(log_p, coef)
    g_one = take_grads(c)
    assert rescore_backward(c, source, two, coef, chunk_size=2) == pytest.approx(loss, rel=1e-9)
    for g, w in zip(take_grads(c), g_one):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_optional_methods_follow_the_model():
    """The one-pass score only where the model gives its per-position distributions; the split only where the
    model has it; checkpoints hold the model's own parameters."""
    scored, _ = _make("scored-transformer", "dfa")
    stepped, _ = _make("transformer", "dfa")
    gru, _ = _make("gru", "dfa")
    assert callable(getattr(scored, "score", None)) and not shares_prefixes(scored)
    assert getattr(stepped, "score", None) is None and shares_prefixes(stepped)
    assert callable(getattr(gru, "advance", None)) and gru.vocab_size == gru.model.vocab_size
    assert getattr(stepped, "advance", None) is None
    assert list(scored.state_dict()) == list(scored.model.state_dict())
    fresh = fm.make("scored-transformer", seed=5)
    fresh.load_state_dict(scored.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), scored.model.parameters()))


class _NoEnd(torch.nn.Module):
    """A foreign GRU that gives eos probability zero until a row produced `free` tokens: a grammar allowing
    only eos there has no mass to renormalise."""

    def __init__(self):
        super().__init__()
        self.inner = fm.make("gru")
        self.pad_id, self.bos_id, self.eos_id = self.inner.pad_id, self.inner.bos_id, self.inner.eos_id

    def encode(self, source):
        return self.inner.encode(source)

    def init_state(self, enc, owner):
        return self.inner.init_state(enc, owner)

    def step(self, enc, owner, prev, state):
        state, logp = self.inner.step(enc, owner, prev, state)
        return state, logp.index_fill(1, torch.tensor([self.eos_id]), -math.inf).log_softmax(1)


class _EndAfter:
    """Any one generable token, then only eos: with `_NoEnd` every row is stuck after one token."""

    def __init__(self, words, eos_id, vocab):
        self.words, self.eos_id, self.V = words, eos_id, vocab

    def start(self, owner):
        return torch.zeros_like(owner)

    def allowed(self, n):
        allowed = torch.zeros(len(n), self.V, dtype=torch.bool)
        allowed[:, self.words] = (n == 0)[:, None]
        allowed[:, self.eos_id] = n >= 1
        return allowed

    def advance(self, n, tokens):
        return n + 1


def test_no_allowed_mass_makes_a_row_impossible_without_nan():
    model = _NoEnd()
    words = grammars.generable(7, (model.pad_id, model.bos_id, model.eos_id))
    c, source = Constrained(model, _EndAfter(words, model.eos_id, 7)), fm.sources("gru")
    assert len(beam_search(c, source, 4, 3)) == 0  # every hypothesis impossible, none returned
    assert len(sample(c, source, 4, 3, generator=torch.Generator().manual_seed(0))) == 0
    rows = torch.tensor([[words[0], model.eos_id], [words[1], model.eos_id]])
    with torch.no_grad(), protocol.scoring_mode(c):
        assert torch.isneginf(protocol.score(c, c.encode(source), rows, torch.tensor([0, 1]))).all()
    enc, owner = c.encode(source), torch.arange(B)
    state, first = c.step(enc, owner, torch.full((B,), c.bos_id), c.init_state(enc, owner))
    _, stuck = c.step(enc, owner, torch.full((B,), words[0]), state)  # (B, V): nothing possible
    assert torch.isneginf(stuck).all() and torch.isfinite(first[:, words]).all()
    (first[:, words[0]].sum() + torch.where(torch.isfinite(stuck), stuck, 0.0).sum()).backward()
    grads = [p.grad for p in c.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_a_state_that_allows_nothing_is_an_error():
    """A grammar bug (a state reached by allowed tokens with no way on) stops search and scoring, not NaN."""
    model = fm.make("gru")
    words = grammars.generable(7, (model.pad_id, model.bos_id, model.eos_id))
    broken = _EndAfter(words, model.eos_id, 7)
    broken.allowed = lambda n: torch.zeros(len(n), 7, dtype=torch.bool).index_fill(  # eos forgotten
        1, torch.tensor(words), True) & (n == 0)[:, None]
    c, source = Constrained(model, broken), fm.sources("gru")
    with pytest.raises(GrammarError, match="allows no token"):
        beam_search(c, source, 2, 3)
    with pytest.raises(GrammarError, match="allows no token"):
        sample(c, source, 2, 3)
    with pytest.raises(GrammarError, match="allows no token"):
        protocol.score(c, c.encode(source), torch.tensor([[words[0], 0, 0]] * 3), torch.arange(3))


class _BadMask(grammars.RandomDFA):
    """A grammar whose allowed() returns what `wrong` makes of the right mask."""

    def __init__(self, wrong, *args):
        super().__init__(*args)
        self.wrong = wrong

    def allowed(self, state):
        return self.wrong(super().allowed(state))


@pytest.mark.parametrize("wrong, got", [
    (lambda m: m.long(), r"a torch\.int64 tensor of shape \(\d+, \d+\)"),
    (lambda m: m.float(), r"a torch\.float32 tensor of shape \(\d+, \d+\)"),
    (lambda m: m[:, :-1], r"a torch\.bool tensor of shape \(\d+, \d+\)"),
    (lambda m: m[:1], r"a torch\.bool tensor of shape \(1, \d+\)"),
    (lambda m: m.tolist(), r"a list"),
])
@pytest.mark.parametrize("name", ["gru", "transformer", "scored-transformer"])
def test_a_grammar_returning_a_wrong_mask_is_named_in_one_line(name, wrong, got):
    """Search, sampling and the teacher-forced pass all stop with one line naming the grammar and what allowed()
    must return (the model's width where it declares vocab_size, else the width of its scores)."""
    model = fm.make(name)
    V = model.out.out_features
    c = Constrained(model, _BadMask(wrong, V, model.pad_id, model.bos_id, model.eos_id))
    source = fm.sources(name)
    width = str(V) if hasattr(c, "vocab_size") else f"(?:{V}|V)"  # V: a step's width is known from its scores
    expected = (rf"grammar _BadMask: allowed\(\) must return a \(\d+, {width}\) torch\.bool tensor \(one row per "
                rf"row of the state, one column per token\), got {got}")
    if not hasattr(c, "vocab_size"):  # a mask too narrow for the step's scores
        expected += rf"|grammar _BadMask: allowed\(\) returned {V - 1} columns, the model scores {V} tokens"
    calls = [lambda: beam_search(c, source, 2, 3), lambda: sample(c, source, 2, 3)]
    if hasattr(c, "position_log_probs"):
        tokens = torch.tensor([[4, 5, model.eos_id]] * 3)
        calls.append(lambda: c.position_log_probs(c.encode(source), tokens, torch.arange(3)))
    for call in calls:
        with pytest.raises(GrammarError) as err:
            call()
        assert re.fullmatch(expected, str(err.value)), str(err.value)


def test_the_documented_example_runs(capsys):
    text = (Path(__file__).resolve().parents[2] / "docs" / "constraints.md").read_text()
    snippets = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(snippets) == 1
    exec(compile(snippets[0], "docs/constraints.md", "exec"), {})
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 8 and all(r.split()[1] in "123" for r in rows)
