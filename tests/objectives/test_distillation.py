"""On-policy distillation through phase two: `rescore_backward` with `distillation(teacher, beta, temperature)`
gives, for every chunk size, with and without the prefix tree, the value and gradient of a plain float64 autograd
of the divergence written independently (`_reference`: torch's kl_div over full (N, T, V) distributions), for an
LSTM student-teacher pair of two sizes and a T5 pair; the teacher gets no gradient; another vocabulary is
refused in one line. TRL's own loss is the oracle of the causal pair (test_distillation_trl.py)."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import take_grads, tiny_model, toy_batch
from twophase import beam_search, protocol, rescore_backward, sample
from twophase.objectives import distillation
from twophase.samples import Samples

pytestmark = pytest.mark.usefixtures("one_thread")
BETAS = (0.0, 0.25, 0.5, 1.0)


def jsd(s_logits, t_logits, beta, temperature):
    """(..., ) TRL's generalized JSD written with torch's kl_div (its GKD form): beta 0 KL(teacher || student),
    1 KL(student || teacher), between beta KL(t || m) + (1 - beta) KL(s || m), m = (1 - beta) s + beta t."""
    s = F.log_softmax(s_logits / temperature, dim=-1)
    t = F.log_softmax(t_logits / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    return (beta * F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
            + (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True).sum(-1))


def step_distributions(model, enc, tokens, owner):
    """(N, T, V) teacher-forced next-token log-probabilities through `step`, with autograd's graph."""
    prev = protocol.teacher_forced_inputs(tokens, model.bos_id)
    state, out = model.init_state(enc, owner), []
    for t in range(tokens.shape[1]):
        state, log_probs = model.step(enc, owner, prev[:, t], state)
        out.append(log_probs)
    return torch.stack(out, 1)


def _reference(student, teacher, source, s, beta, temperature, allowed=None, distributions=step_distributions):
    """(loss, grads): sum over scored positions of jsd / scored tokens, one float64 backward over all rows."""
    student.zero_grad(set_to_none=True)
    with protocol.scoring_mode(student), protocol.scoring_mode(teacher):
        ls = distributions(student, student.encode(source), s.tokens, s.owner)
        with torch.no_grad():
            lt = distributions(teacher, teacher.encode(source), s.tokens, s.owner)
    if allowed is not None:  # banned tokens (probability 0 in both) left out: kl_div would read 0 * (-inf - -inf)
        ls, lt = ls[..., allowed], lt[..., allowed]
    mask = protocol.target_mask(s.tokens, student.pad_id, student.eos_id)
    loss = jsd(ls, lt, beta, temperature)[mask].sum() / mask.sum()
    loss.backward()
    return loss.item(), take_grads(student)


def _candidates(model, source, max_len=6):
    a = sample(model, source, 4, max_len, generator=torch.Generator().manual_seed(3))
    b = beam_search(model, source, 3, max_len)
    both = Samples.cat([a, b], model.pad_id)  # repeated prefixes, so the tree shares nodes
    return both.select(torch.sort(both.owner, stable=True).indices)


def _ours(student, teacher, source, s, beta, temperature, chunk, tree):
    student.zero_grad(set_to_none=True)
    value = rescore_backward(student, source, s, distillation(teacher, beta, temperature), chunk_size=chunk,
                             prefix_sharing=tree)
    return value, take_grads(student)


def _close(got, want, rtol, atol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def lstm_pair():
    student = tiny_model(hidden=12, embed=6, seed=0)
    teacher = tiny_model(hidden=20, embed=10, seed=5)
    source = toy_batch()
    s = _candidates(student, source, max_len=5)
    assert bool((s.lengths < 5).any()) and bool((s.tokens[:, -1] != 0).any())  # rows with and without EOS
    for p in teacher.parameters():
        p.requires_grad_(True)  # trainable, as a loaded model is: still no gradient
    return student, teacher, source, s


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_lstm_pair_equals_float64_autograd(lstm_pair, beta, temperature):
    student, teacher, source, s = lstm_pair
    allowed = ~student.banned
    want_loss, want = _reference(student, teacher, source, s, beta, temperature, allowed)
    assert want_loss > 1e-3
    for tree in (True, False):
        for chunk in (1, 5, len(s)):
            value, got = _ours(student, teacher, source, s, beta, temperature, chunk, tree)
            assert value == pytest.approx(want_loss, rel=1e-9, abs=1e-12), (tree, chunk)
            _close(got, want, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in teacher.parameters())


def test_another_vocabulary_is_refused(lstm_pair):
    student, _, source, s = lstm_pair
    other = tiny_model(tgt_vocab=8, hidden=12, embed=6)
    with pytest.raises(ValueError, match="teacher's vocabulary has 8 tokens, the student's 7") as err:
        rescore_backward(student, source, s, distillation(other), chunk_size=4)
    assert "\n" not in str(err.value)


def test_bad_beta_and_temperature():
    with pytest.raises(ValueError, match="beta must be in"):
        distillation(None, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        distillation(None, temperature=0)


def test_out_of_memory_halving_stays_exact(lstm_pair, monkeypatch):
    """A chunk that runs out of memory half-way through its backward is redone at half the size: nothing of the
    failed attempt (gradient, loss) is kept, and the teacher decodes the smaller chunks afresh."""
    student, teacher, source, s = lstm_pair
    want_loss, want = _reference(student, teacher, source, s, 0.5, 0.7, ~student.banned)
    sizes, real = [], student.decoder_states

    def counted(enc, tokens, owner):
        sizes.append(len(tokens))
        return real(enc, tokens, owner)

    def fail(grad):
        if sizes[-1] > 3:
            raise torch.cuda.OutOfMemoryError("injected")
        return grad

    monkeypatch.setattr(student, "decoder_states", counted)
    handle = student.cell.weight_ih.register_hook(fail)
    try:
        value = rescore_backward(student, source, s, distillation(teacher, 0.5, 0.7), chunk_size=8, oom_retry=True,
                                 prefix_sharing=False)
    finally:
        handle.remove()
    assert sizes[:3] == [8, 4, 2]
    assert value == pytest.approx(want_loss, rel=1e-9)
    _close(take_grads(student), want, rtol=1e-9, atol=1e-12)
