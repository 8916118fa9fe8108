"""Token-level objectives through phase two: `rescore_backward` with a `policy_loss` gives, for every chunk size,
with and without the prefix tree, the gradient and value of one backward over all rows (float64), for the
LSTM's by-hand paths, protocol-only models, Karel and the HF wrappers, with clipping active on both sides; the
closed-form weights equal autograd's; OOM halving stays exact; coefficient vectors are unchanged."""
import importlib.util

import pytest
import torch

import foreign_models
from conftest import take_grads, tiny_model, toy_batch
from twophase import beam_search, protocol, rescore_backward, sample
from twophase.objectives.policy import advantages, policy_loss, zero_std_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def _candidates(model, source, B, max_len=6):
    s = sample(model, source, 4, max_len, generator=torch.Generator().manual_seed(3))
    b = beam_search(model, source, 3, max_len)
    from twophase.samples import Samples
    both = Samples.cat([s, b], model.pad_id)  # repeated prefixes, so the tree shares nodes
    order = torch.sort(both.owner, stable=True).indices
    return both.select(order)


def _objective(model, s, B, loss_type="dapo", beta=0.04, eps_high=0.28, ref_shift=0.3):
    g = torch.Generator().manual_seed(7)
    r = torch.rand(len(s), generator=g, dtype=torch.float64)
    adv = advantages(r, s.owner, B)
    ref = s.token_scores + ref_shift * torch.randn(s.token_scores.shape, generator=g, dtype=torch.float64)
    return policy_loss(adv, s.token_scores, lengths=s.lengths, loss_type=loss_type, epsilon=0.2,
                       epsilon_high=eps_high, beta=beta, ref_token_logps=ref, num_sources=B, owner=s.owner)


def _moved(model, scale=0.5, seed=11):
    """Parameters moved away from the old policy: ratios leave [1 - eps, 1 + eps_high] on both sides."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _one_backward(model, source, s, obj):
    """The objective's loss over all rows at once, autograd through the model's per-token log-probs."""
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        tok = protocol.token_scores(model, model.encode(source), s.tokens, s.owner)  # (N, T)
        row, col = protocol.target_mask(s.tokens, model.pad_id, model.eos_id).nonzero(as_tuple=True)
        loss = obj.terms(tok[row, col], row, col).sum()
    loss.backward()
    sums = obj.derivative(tok[row, col].detach(), row, col)[2]  # device tensors
    return loss.item(), take_grads(model), {key: value.item() for key, value in sums.items()}


def _check(model, source, B, chunks=(1, 3, 1000), trees=(True, False), atol=1e-12, max_len=6, **kw):
    s = _candidates(model, source, B, max_len)
    _moved(model)
    obj = _objective(model, s, B, **kw)
    want_loss, want, want_sums = _one_backward(model, source, s, obj)
    assert want_sums["clip_low"] > 0 and want_sums["clip_high"] > 0  # both sides clipped
    for tree in trees:
        for chunk in chunks:
            stats = {}
            loss = rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree, stats=stats)
            assert loss == pytest.approx(want_loss, rel=1e-9, abs=atol)
            for g, w in zip(take_grads(model), want):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=atol)
            assert stats["tokens"] == int(s.lengths.sum())
            assert (stats["clip_low"], stats["clip_high"]) == (want_sums["clip_low"], want_sums["clip_high"])
            assert stats["kl"] == pytest.approx(want_sums["kl"], rel=1e-9)
    return s


@pytest.mark.parametrize("loss_type", ("grpo", "dr_grpo", "dapo", "bnpo", "sequence"))  # the clipped types
def test_lstm_fast_paths(loss_type):
    model, source = tiny_model(), toy_batch()
    _check(model, source, 3, loss_type=loss_type)


@pytest.mark.parametrize("beta,eps_high", [(0.0, 0.2), (0.04, 0.28)])
def test_lstm_autograd_paths(beta, eps_high, monkeypatch):
    model, source = tiny_model(), toy_batch()
    monkeypatch.setattr(model, "weighted_tree_backward", None)  # `step` over the tree / `token_scores` rows
    monkeypatch.setattr(model, "weighted_score_backward", None)
    _check(model, source, 3, chunks=(2, 1000), beta=beta, eps_high=eps_high)


@pytest.mark.parametrize("name", ["transformer", "scored-transformer", "gru"])
def test_protocol_models(name):
    model, source = foreign_models.make(name), foreign_models.sources(name)
    _check(model, source, 3, chunks=(2, 1000), loss_type="grpo")


def test_karel_model():
    from test_karel_task import grids, tiny_model as karel_model
    _check(karel_model(), grids(), 3, chunks=(2, 1000), trees=(True,), loss_type="bnpo")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("kind,head", [("llama", True), ("t5", True), ("gpt2", False)])
def test_hf_wrappers(kind, head):
    from test_hf import PROMPTS, _batch, _wrapped
    wrapper = _wrapped(kind)
    if not head:
        wrapper.head = None  # the full logits, autograd through `score`'s per-token version
    source = _batch(PROMPTS, wrapper.pad_id, left=kind != "t5")
    _check(wrapper, source, 3, chunks=(2, 1000), trees=(True,), atol=1e-7 if kind != "gpt2" else 1e-12,
           loss_type="dr_grpo")


def test_closed_form_weights_equal_autograd():
    g = torch.Generator().manual_seed(0)
    N, T = 6, 5
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 2
    obj = policy_loss(torch.randn(N, generator=g, dtype=torch.float64), old, lengths=torch.full((N,), T),
                      loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=0.04, ref_token_logps=old - 0.2)
    row, col = torch.arange(N).repeat_interleave(T), torch.arange(T).repeat(N)
    for iw in (True, False):
        obj.kl_importance_weighted = iw
        logp = (old[row, col] + 0.5 * torch.randn(N * T, generator=g, dtype=torch.float64)).requires_grad_()
        terms = obj.terms(logp, row, col)
        (d_auto,) = torch.autograd.grad(terms.sum(), logp)
        value, d, _ = obj.derivative(logp.detach(), row, col)
        torch.testing.assert_close(value, terms.detach(), rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(d, d_auto, rtol=1e-12, atol=1e-15)


def test_sequence_at_the_old_policy_is_reinforce():
    """loss_type 'sequence', rho = 1, beta = 0: the gradient of today's reinforce coefficients."""
    from twophase import objectives
    model, source = tiny_model(), toy_batch()
    s = _candidates(model, source, 3)
    r = torch.rand(len(s), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    obj = policy_loss(advantages(r, s.owner, 3, scale="none"), s.token_scores, lengths=s.lengths,
                      loss_type="sequence", num_sources=3, owner=s.owner)
    rescore_backward(model, source, s, obj, 4)
    got = take_grads(model)
    rescore_backward(model, source, s, objectives.reinforce(r, s.owner, 3, "mean"), 4)
    for a, b in zip(got, take_grads(model)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)


def test_out_of_memory_halving_stays_exact(monkeypatch):
    model, source = tiny_model(), toy_batch()
    s = _candidates(model, source, 3)
    _moved(model)
    obj = _objective(model, s, 3)
    _, want, _ = _one_backward(model, source, s, obj)
    sizes, real = [], model.decoder_states

    def counted(enc, tokens, owner):
        sizes.append(len(tokens))
        return real(enc, tokens, owner)

    def fail(grad):
        if sizes[-1] > 3:
            raise torch.cuda.OutOfMemoryError("injected")
        return grad

    monkeypatch.setattr(model, "decoder_states", counted)
    handle = model.cell.weight_ih.register_hook(fail)
    stats = {}
    rescore_backward(model, source, s, obj, chunk_size=8, oom_retry=True, prefix_sharing=False, stats=stats)
    handle.remove()
    assert sizes[:3] == [8, 4, 2]
    assert stats["tokens"] == int(s.lengths.sum())  # the failed attempts counted nothing
    for g, w in zip(take_grads(model), want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_advantages_and_zero_std_groups():
    owner = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 0.0, 1.0], dtype=torch.float64)
    a = advantages(r, owner, 3, "mean", "group")
    torch.testing.assert_close(a[:3], torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) / (1.0 + 1e-4))
    assert (a[3:5] == 0).all()
    loo = advantages(r, owner, 3, "loo", "none")
    torch.testing.assert_close(loo[:3], torch.tensor([-1.5, 0.0, 1.5], dtype=torch.float64))
    batch = advantages(r, owner, 3, "mean", "batch")
    torch.testing.assert_close(batch, advantages(r, owner, 3, "mean", "none") / (r.std() + 1e-4))
    assert zero_std_groups(r, owner, 3).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(a, torch.zeros(7, 2), lengths=torch.ones(7), loss_type="ppo")


def test_karel_model_under_its_grammar():
    """`--grammar on`: the constrained Karel model's one-pass per-token log-probs carry the exact gradient."""
    from test_karel_task import constrained_model, grids
    _check(constrained_model(12, scale=3.0), grids(), 3, chunks=(2, 1000), trees=(True,), max_len=12,
           loss_type="dapo")
