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


# Where pad_id == eos_id (GPT-2), rows cut without eos (vLLM's rows at the length limit, rows ended by a stop
# string) of different lengths: nothing is appended, and phase two scores each row's own tokens exactly.
CUT = [[2, 3, 4], [3, 4, 2, 3], [4, 0], [2, 3]]  # eos = pad = 0: rows 0, 1 and 3 end without eos
CUT_OWNER = [0, 1, 1, 2]


def test_rows_cut_without_eos_get_no_eos_where_pad_is_eos():
    s = Samples.from_completions(CUT, CUT_OWNER, 0, 0)
    assert s.lengths.tolist() == [3, 4, 2, 2]
    assert s.tokens.tolist() == [[2, 3, 4, 0], [3, 4, 2, 3], [4, 0, 0, 0], [2, 3, 0, 0]]
    logps = [[-0.5] * len(r) for r in CUT]
    assert Samples.from_completions(CUT, CUT_OWNER, 0, 0, token_logps=logps).scores.tolist() == [-1.5, -2, -1, -1]


def _own_token_log_probs(model, source, rows, owner):
    """N lists of (1,) log p of each row's own tokens, decoded alone by `step` without any padding:
    independent of Samples and of phase two's chunks and trees."""
    enc = model.encode(source)
    out = []
    for row, o in zip(rows, owner):
        own = torch.tensor([o])
        state, prev, terms = model.init_state(enc, own), torch.tensor([model.bos_id]), []
        for tok in row:
            state, logp = model.step(enc, own, prev, state)
            terms.append(logp[0, tok])
            prev = torch.tensor([tok])
        out.append(terms)
    return out


def _own_tokens_log_p(model, source, rows, owner):
    """(N,) the sums of `_own_token_log_probs`."""
    return torch.stack([sum(terms) for terms in _own_token_log_probs(model, source, rows, owner)])


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_cut_rows_train_on_their_own_tokens_only(prefix_sharing, one_thread):
    """EndIsPadRNN (pad == eos, `step` only): the tree, and rows scored alone."""
    import foreign_models as fm
    model, source = fm.make("end-is-pad").eval(), fm.sources("end-is-pad")
    s = Samples.from_completions(CUT, CUT_OWNER, model.pad_id, model.eos_id)
    c = torch.tensor([0.7, -1.3, 0.4, 2.0], dtype=torch.float64)
    (c * _own_tokens_log_p(model, source, CUT, CUT_OWNER)).sum().backward()
    want = take_grads(model)
    for chunk in (1, 2, 4):
        rescore_backward(model, source, s, c, chunk_size=chunk, prefix_sharing=prefix_sharing)
        assert all(torch.allclose(g, w, rtol=1e-12, atol=1e-14) for g, w in zip(take_grads(model), want)), chunk


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_cut_rows_train_a_policy_loss_on_their_own_tokens_only(prefix_sharing, one_thread):
    """DAPO over rows cut without eos: the tokens counted and differentiated are the rows' own."""
    import foreign_models as fm
    from twophase.objectives.policy import policy_loss
    model, source = fm.make("end-is-pad").eval(), fm.sources("end-is-pad")
    g = torch.Generator().manual_seed(3)
    old = [[-0.5 - float(torch.rand((), generator=g)) for _ in r] for r in CUT]
    s = Samples.from_completions(CUT, CUT_OWNER, model.pad_id, model.eos_id, token_logps=old)
    adv = torch.tensor([0.9, -1.1, 0.3, 1.7], dtype=torch.float64)
    terms = _own_token_log_probs(model, source, CUT, CUT_OWNER)
    loss = 0.0
    for row_terms, row_old, a in zip(terms, old, adv):  # TRL's clipped surrogate, summed over 11 tokens
        for lp, o in zip(row_terms, row_old):
            ratio = (lp - o).exp()
            loss = loss - torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
    (loss / sum(map(len, CUT))).backward()
    want = take_grads(model)
    objective = policy_loss(adv, s.token_scores, lengths=s.lengths, loss_type="dapo", epsilon=0.2,
                            epsilon_high=0.28)
    for chunk in (1, 4):
        rescore_backward(model, source, s, objective, chunk_size=chunk, prefix_sharing=prefix_sharing)
        assert all(torch.allclose(g, w, rtol=1e-12, atol=1e-14) for g, w in zip(take_grads(model), want)), chunk


def test_cut_rows_train_on_their_own_tokens_only_through_gpt2(one_thread):
    """GPT-2 (pad == eos) scores rows in one pass over the chunk: a chunk never reads a cut row's padding."""
    pytest.importorskip("transformers")
    import hf_tiny
    from twophase.models.hf import HFCausalLM
    wrapper = HFCausalLM(hf_tiny.causal("gpt2"))
    assert wrapper.pad_id == wrapper.eos_id == hf_tiny.EOS
    rows = [[5, 6, 7], [6, 7, 8, 9, 4], [7, 1], [8, 9], [4, 5, 6, 7, 8]]  # eos 1: only row 2 ends with it
    owner = [0, 0, 1, 1, 1]
    prompts = [[5, 6, 7, 8], [9, 10]]
    source = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    s = Samples.from_completions(rows, owner, wrapper.pad_id, wrapper.eos_id)
    assert s.lengths.tolist() == [3, 5, 2, 2, 5]
    c = torch.tensor([0.7, -1.3, 0.4, 2.0, -0.6], dtype=torch.float64)
    total = 0.0
    for row, o, ci in zip(rows, owner, c):  # the model itself on prompt + completion, one row at a time
        ids = torch.tensor([prompts[o] + row[:-1]])
        logits = wrapper.model(input_ids=ids).logits[0, len(prompts[o]) - 1:]  # (len(row), V)
        total = total + ci * torch.log_softmax(logits, -1).gather(1, torch.tensor(row)[:, None]).sum()
    total.backward()
    want = take_grads(wrapper)
    for chunk in (1, 2, 5):
        rescore_backward(wrapper, source, s, c, chunk_size=chunk)
        got = take_grads(wrapper)
        assert all(torch.allclose(g, w, rtol=1e-10, atol=1e-13) for g, w in zip(got, want)), chunk


@pytest.mark.parametrize("call, message", [
    (lambda: Samples.from_completions([[4], [5]], [0, 1], PAD, EOS, token_logps=[[-1.0]]),
     "token_logps has 1 rows but completion_ids 2"),
    (lambda: Samples.from_completions([[4, 5], [5]], [0, 1], PAD, EOS, token_logps=[[-1.0], [-1.0]]),
     "token_logps row 0 has 1 log-probabilities for its 2 tokens"),
    (lambda: Samples.from_completions(torch.tensor([[4, 5], [5, 6]]), [0, 1], PAD, EOS,
                                      token_logps=torch.zeros(2, 1)),
     "token_logps row 0 has 1 log-probabilities for its 2 tokens"),
    (lambda: Samples.from_completions([[4], [5, 6]], [0, 1], PAD, EOS, token_logps=[[-1.0], [-1.0, 0.5]]),
     "token_logps row 1 position 1 is 0.5: log-probabilities are finite and <= 0"),
    (lambda: Samples.from_completions([[4], [5]], [0, 1], PAD, EOS, token_logps=[[-1.0], [float("-inf")]]),
     "token_logps row 1 position 0 is -inf"),
    (lambda: Samples.from_completions([[4], [5]], [0, 1], PAD, EOS, token_logps=[[float("nan")], [-1.0]]),
     "token_logps row 0 position 0 is nan"),
    (lambda: Samples.from_completions([[4], [5]], [[0], [1]], PAD, EOS),
     r"owner must hold one source index per completion, shape \(N,\); got shape \(2, 1\)"),
    (lambda: Samples.from_completions([[4], [5]], [0, -1], PAD, EOS), "owner row 1 is -1"),
    (lambda: Samples.from_completions(torch.tensor([[4, 5, -100], [5, 6, 7]]), [0, 1], PAD, EOS),
     "completion_ids row 0 holds id -100 at position 2: ids must be >= 0"),
    (lambda: Samples.from_completions([[4, 5], [5, 7]], [0, 1], PAD, EOS, vocab_size=7),
     r"completion_ids row 1 holds id 7 at position 1: ids must be in \[0, 7\)"),
    (lambda: Samples.from_completions([[4, "x"]], [0], PAD, EOS), "completion_ids must be N rows of numbers"),
    (lambda: Samples.from_completions(torch.tensor([4, 5]), [0, 1], PAD, EOS),
     r"completion_ids must be N rows, an \(N, T\) tensor or N lists; got shape \(2,\)"),
])
def test_inconsistent_inputs_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match="^" + message) as err:
        call()
    assert "\n" not in str(err.value)


def test_what_follows_a_rows_end_is_not_checked():
    """-100 or junk after a row's eos (HF labels' padding) is dropped, not refused; so are its log-probs."""
    s = Samples.from_completions(torch.tensor([[4, EOS, -100], [5, 6, 7]]), [0, 1], PAD, EOS,
                                 token_logps=torch.tensor([[-1.0, -2.0, 3.0], [-1.0, -1.0, -1.0]]))
    assert s.tokens.tolist() == [[4, EOS, PAD], [5, 6, 7]] and s.scores.tolist() == [-3.0, -3.0]


def test_rows_are_built_on_the_device_asked_for():
    s = Samples.from_completions([[4, EOS], [5]], [0, 1], PAD, EOS, token_logps=[[-1.0, -1.0], [-0.5]],
                                 device=torch.device("cpu"))
    assert {t.device.type for t in (s.tokens, s.lengths, s.owner, s.scores, s.token_scores)} == {"cpu"}
