"""`twophase.check_model`: every rule broken by a model built for it fails with one line naming the rule; the
built-in, Karel, foreign and Hugging Face models pass. Also: search refuses NaN log-probabilities (it used to drop
their rows), and library misuse is a ValueError naming the argument."""
import pytest
import torch
from torch import nn

import foreign_models as fm
from twophase import ModelError, Samples, beam_search, check_model, greedy, objectives, rescore_backward, sample
from twophase.models.karel import KarelModel
from twophase.models.seq2seq import Seq2Seq
from twophase.protocol import step_score, step_token_scores
from twophase.vocab import pad_batch


class Broken(nn.Module):
    """A good foreign model whose `step` output is passed through `fix`; `score` optionally shifted."""

    def __init__(self, inner, fix=None, state_fix=None):
        super().__init__()
        self.inner, self.fix, self.state_fix = inner, fix, state_fix
        self.pad_id, self.bos_id, self.eos_id = inner.pad_id, inner.bos_id, inner.eos_id

    def encode(self, source):
        return self.inner.encode(source)

    def init_state(self, enc, owner):
        return self.inner.init_state(enc, owner)

    def step(self, enc, owner, prev, state):
        state, logp = self.inner.step(enc, owner, prev, state if self.state_fix is None else self.state_fix(state))
        return state, logp if self.fix is None else self.fix(logp)


class BreaksLater(Broken):
    """A good model whose `step` output passes through `fix` once every row is past bos: e.g. a model that
    applies log_softmax at the first step only."""

    def step(self, enc, owner, prev, state):
        state, logp = self.inner.step(enc, owner, prev, state)
        return state, self.fix(logp) if bool((prev != self.bos_id).all()) else logp


class WrongScore(fm.ScoredFeatureDecoder):
    def score(self, enc, tokens, owner):
        return super().score(enc, tokens, owner) + 0.5


def _transformer(**kwargs):
    return fm.make("transformer", **kwargs), fm.sources("transformer")


def _rule(model, source, targets=None) -> str:
    with pytest.raises(ModelError) as err:
        check_model(model, source, targets)
    lines = str(err.value).splitlines()
    assert all(line.startswith("model check: ") for line in lines)
    return lines[0]


@pytest.mark.parametrize("fix, rule", [
    (lambda logp: logp + 3, "normalised"),  # log_softmax + 3
    (lambda logp: logp.exp(), "normalised"),  # probabilities
    (lambda logp: logp.index_fill(1, torch.tensor([0]), float("nan")), "finite"),
    (lambda logp: logp[:3], "shapes"),  # fewer rows than asked for
])
def test_a_broken_distribution_is_named(fix, rule):
    inner, source = _transformer()
    line = _rule(Broken(inner, fix), source)
    assert line.startswith(f"model check: {rule}: Broken.")


def test_one_column_short_is_named_against_the_targets():
    """(N, V-1), renormalised: only the ids the task uses can tell (the model has no vocab_size)."""
    inner, source = _transformer()
    model = Broken(inner, lambda logp: logp[:, :-1].log_softmax(-1))
    tgt = torch.tensor([[3, 5, 2], [4, 2, 0]])  # (R, T) the last id, 5, is one the model cannot produce
    refs = Samples.of_targets(tgt, torch.tensor([0, 1]), 0, 2)
    assert _rule(model, source, refs) == ("model check: vocabulary: Broken.step returns 5 log-probabilities per "
                                          "row, but a target id is 5")


def test_pad_or_bos_given_probability_is_named():
    model, source = _transformer(mask_specials=False)
    assert _rule(model, source).startswith("model check: specials: FeatureDecoder.step gives pad_id/bos_id [0, 1]")


def test_a_score_that_disagrees_with_step_is_named():
    torch.manual_seed(0)
    model = fm._scaled(WrongScore(), 2.0)
    assert _rule(model, fm.sources("transformer")).startswith("model check: score: WrongScore.score differs")


def test_a_state_that_is_not_reorderable_is_named():
    inner, source = fm.make("end-is-pad"), fm.sources("end-is-pad")
    model = Broken(inner, state_fix=lambda h: h.roll(1, 0))  # each row reads its neighbour's state
    assert _rule(model, source).startswith("model check: reorder: Broken.")


@pytest.mark.parametrize("fix, rule", [
    (lambda logp: logp + 3, "normalised"),  # log_softmax forgotten after the first step
    (lambda logp: logp.index_fill(1, torch.tensor([0]), float("nan")), "finite"),
    (lambda logp: logp.index_fill(1, torch.tensor([0]), -0.1).log_softmax(1), "specials"),  # pad unbanned later
])
def test_a_distribution_broken_after_the_first_step_is_named(fix, rule):
    inner, source = _transformer()
    line = _rule(BreaksLater(inner, fix), source)
    assert line.startswith(f"model check: {rule}: BreaksLater.") and "at step 2 of 3" in line, line


def test_rows_that_attend_to_each_other_are_named():
    """nn.TransformerEncoderLayer at batch_first=False over (N, t, H): reversing the rows changes nothing, but
    search's scores are not the rows' own (teacher-forced alone) log-probabilities."""
    model, source = fm.make("row-mixing"), fm.sources("row-mixing")
    s = beam_search(model, source, 3, 4)
    with torch.no_grad():
        model.eval()
        enc = model.encode(source)
        alone = torch.stack([step_score(model, enc, s.tokens[i:i + 1], s.owner[i:i + 1])[0] for i in range(len(s))])
        assert float((alone - s.scores).abs().max()) > 1e-3  # what the check must catch
    with pytest.raises(ModelError) as err:
        check_model(model, source)
    rules = [line.split(":")[1].strip() for line in str(err.value).splitlines()]
    assert "rows" in rules, str(err.value)
    assert "depend on the other rows of the batch" in str(err.value)


def test_a_statistic_over_the_rows_is_named():
    """Each step's state centred over the batch: the same set of rows reversed gives the same numbers, a subset
    or repeats do not."""
    inner, source = fm.make("end-is-pad"), fm.sources("end-is-pad")
    model = Broken(inner, state_fix=lambda h: h - h.mean(0, keepdim=True))
    lines = str(pytest.raises(ModelError, check_model, model, source).value).splitlines()
    assert any(line.startswith("model check: rows: Broken.") for line in lines), lines


@pytest.mark.parametrize("name", ["transformer", "scored-transformer", "gru", "end-is-pad"])
def test_foreign_models_pass(name):
    model = fm.make(name)
    check_model(model, fm.sources(name))
    assert model.training  # the check ran in evaluation mode and gave the mode back


def test_builtin_models_pass():
    torch.manual_seed(0)
    lstm = Seq2Seq(9, 8, 6, 8)
    refs = Samples.of_targets(torch.tensor([[4, 5, 2], [6, 2, 0]]), torch.tensor([0, 1]), 0, 2)
    check_model(lstm, pad_batch([[4, 5, 6], [7]]), refs)
    karel = KarelModel(12, 4, 4, 6, 8, (4, 4), 0.0)
    check_model(karel, torch.rand(2, 3, 32, 4, 4))


def test_hugging_face_wrappers_pass():
    pytest.importorskip("transformers")
    import hf_tiny
    from twophase.models.hf import HFSeq2Seq
    model = HFSeq2Seq(hf_tiny.seq2seq("t5"))  # pad gets probability: the wrapper leaves it to search
    source = {"input_ids": torch.tensor([[4, 5, 1], [6, 1, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    check_model(model, source)


def test_search_refuses_nan_instead_of_dropping_the_source():
    inner, source = _transformer()
    model = Broken(inner, lambda logp: torch.where(torch.arange(len(logp))[:, None] == 0, float("nan"), logp))
    for search in (lambda: beam_search(model, source, 2, 4), lambda: greedy(model, source, 4),
                   lambda: sample(model, source, 2, 4, generator=torch.Generator().manual_seed(0))):
        with pytest.raises(ModelError, match="^Broken returned NaN log-probabilities"):
            search()


def test_impossible_rows_are_still_dropped():
    """-inf stays legal: a source whose every continuation but eos is banned keeps its finite rows only."""
    inner, source = _transformer()

    def only_eos(logp):
        return torch.full_like(logp, float("-inf")).index_fill(1, torch.tensor([inner.eos_id]), 0.0)
    s = beam_search(Broken(inner, only_eos), source, 3, 4)
    assert len(s) == 3 and bool((s.scores == 0).all())  # one row per source: the other beams were impossible


def test_library_misuse_names_the_argument():
    model, source = _transformer()
    with pytest.raises(ValueError, match="^beam_size must be an integer >= 1, got 0"):
        beam_search(model, source, 0, 4)
    with pytest.raises(ValueError, match="^temperature must be a finite number > 0, got 0"):
        sample(model, source, 2, 4, temperature=0)
    owner = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="^num_sources=2 is smaller than the owners"):
        objectives.mle(owner, 2)
    with pytest.raises(ValueError, match="^num_sources=2"):
        objectives.reinforce(torch.ones(3), owner, 2)
    s = beam_search(model, source, 2, 4)
    c = torch.zeros(len(s), dtype=torch.float64)
    c[1] = float("nan")
    with pytest.raises(ValueError, match="^coefficients must be finite; row 1 is nan"):
        rescore_backward(model, source, s, c, chunk_size=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_log_probs_pass_and_search_sums_them_in_float32(dtype):
    """A model returning fp16/bf16 log-probabilities (a half-precision model) passes the check (bf16's rounding
    is not "not normalised") and every search runs, its scores the float32 sums of the 16-bit log-probs."""
    inner, source = _transformer()
    model = Broken(inner, lambda logp: logp.to(dtype))
    check_model(model, source)
    with pytest.raises(ModelError, match="^model check: normalised"):
        check_model(Broken(inner, lambda logp: (logp + 0.5).to(dtype)), source)
    for s in (beam_search(model, source, 3, 5), greedy(model, source, 5),
              sample(model, source, 3, 5, generator=torch.Generator().manual_seed(0))):
        assert s.scores.dtype == torch.float32
        with torch.no_grad():
            model.eval()
            want = step_token_scores(model, model.encode(source), s.tokens, s.owner).float().sum(1)
        assert torch.allclose(s.scores, want, rtol=0, atol=1e-5)


def _mixes_rows(logp):
    """1% of the batch's mean log-probabilities added to each row, renormalised: every row reads its neighbours."""
    return (logp + 0.01 * logp.masked_fill(logp.isinf(), 0).mean(0, keepdim=True)).log_softmax(1)


def test_rows_that_read_one_percent_of_the_batch_are_named_in_float32():
    """Search then scores a row by up to 1e-3 nats otherwise than the row alone: far more than float32's rounding
    (a per-step tolerance of 1e-3 let it pass)."""
    torch.manual_seed(1)
    model, source = Broken(Seq2Seq(9, 8, 6, 8), _mixes_rows), pad_batch([[4, 5, 6], [7], [5, 8]])
    s = beam_search(model, source, 3, 5)
    with torch.no_grad():
        model.eval()
        enc = model.encode(source)
        alone = torch.stack([step_score(model, enc, s.tokens[i:i + 1], s.owner[i:i + 1])[0] for i in range(len(s))])
    assert float((alone - s.scores).abs().max()) > 5e-4  # what the check must catch
    rules = [line.split(":")[1].strip() for line in str(pytest.raises(ModelError, check_model, model, source).value)
             .splitlines()]
    assert "rows" in rules, rules
    check_model(Broken(Seq2Seq(9, 8, 6, 8)), source)  # the same model without the mixing passes


def test_the_tolerance_is_the_rounding_float32_is_computed_with(monkeypatch):
    """float32's own eps, or TF32's where float32 matmuls may use it (--tf32)."""
    from twophase import modelcheck
    model, logp = Seq2Seq(9, 8, 6, 8), torch.zeros(2, 8)
    assert modelcheck._tolerance(model, logp.double()) == modelcheck.ROUNDING_UNITS * torch.finfo(torch.float64).eps
    assert modelcheck.ROUNDING_UNITS * modelcheck.ACROSS_BATCHES * torch.finfo(torch.float32).eps < 1e-4
    assert modelcheck._tolerance(model, logp) == modelcheck.ROUNDING_UNITS * torch.finfo(torch.float32).eps
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert modelcheck._tolerance(model, logp) == modelcheck.ROUNDING_UNITS * 2.0 ** -10
