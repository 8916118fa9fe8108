"""TRL's other loss types and options through phase two (cispo, sapo, luspo, delta, mask_truncated_completions,
the sequence-level ratio of GSPO): for every chunk size, with and without the prefix tree, the gradient and value
equal one plain autograd of TRL's formulas over all rows at once (float64, written out here from TRL 1.16's
`_compute_loss`), for the LSTM's by-hand paths and its autograd paths, at a policy moved since phase one so
that the clipping, caps and masks bite. The sequence level's statistics pass keeps no graph."""
import math

import pytest
import torch

from conftest import take_grads, tiny_model, toy_batch
from test_policy_rescoring import _candidates, _moved
from twophase import protocol, rescore_backward
from twophase.objectives.policy import advantages, policy_loss, truncated_rows

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 6


def _trl_loss(tok, mask, adv, old, ref, *, loss_type, beta, eps_low=0.2, eps_high=0.28, level="token",
              delta=None, tau_pos=1.0, tau_neg=1.05, is_ratio=None, off_policy=None, sampling=None):
    """TRL 1.16's `_compute_loss` from per-token log-probs tok (N, T) with a graph (eval mode, one process)."""
    adv = adv[:, None]
    log_ratio = tok - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_w)
    if beta != 0:
        kl = (torch.exp(ref - tok) - (ref - tok) - 1) * coef_1
    if loss_type == "cispo":
        loss = -torch.clamp(coef_1, max=eps_high).detach() * adv * tok
    elif loss_type == "vespo":  # TRL's get_gamma_weights, default k and lambda
        with torch.no_grad():
            log_w = torch.clamp(torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True),
                                math.log(1e-8), 20.0)
            k = torch.where(adv >= 0, 2.0, 3.0).to(log_w.dtype)
            lam = torch.where(adv >= 0, 3.0, 2.0).to(log_w.dtype).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        loss = -phi * adv * tok
    elif loss_type == "sapo":
        # TRL's torch.where of two Python floats is float32; float64 here (the test checks exactness)
        t = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
        loss = -torch.sigmoid(t * (coef_1 - 1)) * 4 / t * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if off_policy is not None:  # TRL's get_off_policy_mask
        kl_div = torch.nan_to_num((old if sampling is None else sampling) - tok.detach(), nan=0.0)
        avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        loss = loss * ((adv >= 0) | (avg_seq_kl <= off_policy)).to(mask.dtype)
    if is_ratio is not None:
        loss = loss * is_ratio
    if beta != 0:
        loss = loss + beta * kl
    if loss_type in ("grpo", "sapo"):
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / (loss.size(0) * MAX_LEN)
    if loss_type == "luspo":
        return (loss * mask).sum(-1).mean()
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)  # dapo, cispo, vespo (num_items: the mask's), bnpo


CASES = {  # name: policy_loss's options (TRL's names)
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.3},
    "sapo": {"loss_type": "sapo", "sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.4},
    "delta": {"loss_type": "dapo", "delta": 1.4},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "gspo-delta-dr": {"loss_type": "dr_grpo", "importance_sampling_level": "sequence", "delta": 1.2},
    "sapo-sequence": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
    "cispo-sequence": {"loss_type": "cispo", "epsilon_high": 1.1, "importance_sampling_level": "sequence"},
    "off-policy-mask": {"loss_type": "dapo", "off_policy_mask_threshold": 0.05},
    "vespo": {"loss_type": "vespo"},
    "gspo-off-policy-mask": {"loss_type": "grpo", "importance_sampling_level": "sequence",
                             "off_policy_mask_threshold": 0.05},
}


def _setup(model, source, B, name, beta, mask_truncated, seed=7):
    s = _candidates(model, source, B, MAX_LEN)
    _moved(model, scale=1.0)
    g = torch.Generator().manual_seed(seed)
    adv = advantages(torch.rand(len(s), generator=g, dtype=torch.float64), s.owner, B)
    ref = s.token_scores + 0.3 * torch.randn(s.token_scores.shape, generator=g, dtype=torch.float64)
    truncated = truncated_rows(s.tokens, s.lengths, model.eos_id)
    if mask_truncated:
        assert truncated.any() and not truncated.all()
    kw = {"epsilon": 0.2, "epsilon_high": 0.28, **CASES[name]}
    obj = policy_loss(adv, s.token_scores, lengths=s.lengths, beta=beta, ref_token_logps=ref, max_len=MAX_LEN,
                      truncated=truncated if mask_truncated else None, **kw)
    return s, obj, adv, ref, truncated, kw


def _one_backward(model, source, s, adv, ref, truncated, mask_truncated, beta, kw):
    """TRL's loss over every row at once, plain autograd through the model's per-token log-probs."""
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        tok = protocol.token_scores(model, model.encode(source), s.tokens, s.owner)  # (N, T)
        mask = protocol.target_mask(s.tokens, model.pad_id, model.eos_id).double()
        if mask_truncated:
            mask = mask * (~truncated).double()[:, None]
        loss = _trl_loss(tok, mask, adv, s.token_scores, ref, loss_type=kw["loss_type"], beta=beta,
                         eps_low=kw["epsilon"], eps_high=kw["epsilon_high"],
                         level=kw.get("importance_sampling_level", "token"), delta=kw.get("delta"),
                         tau_pos=kw.get("sapo_temperature_pos", 1.0), tau_neg=kw.get("sapo_temperature_neg", 1.05),
                         off_policy=kw.get("off_policy_mask_threshold"))
    loss.backward()
    return loss.item(), take_grads(model)


def _check(model, source, name, beta, mask_truncated, chunks=(1, 4, 1000), trees=(True, False)):
    s, obj, adv, ref, truncated, kw = _setup(model, source, 3, name, beta, mask_truncated)
    want_loss, want = _one_backward(model, source, s, adv, ref, truncated, mask_truncated, beta, kw)
    assert max(float(w.abs().max()) for w in want) > 0
    for tree in trees:
        for chunk in chunks:
            stats = {}
            loss = rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree, stats=stats)
            assert loss == pytest.approx(want_loss, rel=1e-10, abs=1e-13), (tree, chunk)
            for g, w in zip(take_grads(model), want):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
            assert stats["tokens"] == int(s.lengths[obj.live()].sum())  # masked rows are not decoded
            if mask_truncated:
                assert not obj.live()[truncated].any()
    return stats, s, obj


@pytest.mark.parametrize("beta,mask_truncated", [(0.0, False), (0.04, True)])
@pytest.mark.parametrize("name", list(CASES))
def test_lstm_fast_paths(name, beta, mask_truncated):
    model, source = tiny_model(), toy_batch()
    stats, s, obj = _check(model, source, name, beta, mask_truncated)
    if name in ("cispo", "delta"):
        assert stats["clip_high"] > 0  # the cap bites
    if "off_policy_mask_threshold" in CASES[name]:  # the mask drops some rows' policy terms and keeps others'
        with protocol.scoring_mode(model):
            tok = protocol.token_scores(model, model.encode(source), s.tokens, s.owner)
        mean_kl = ((s.token_scores - tok) * protocol.target_mask(s.tokens, model.pad_id, model.eos_id)).sum(1) \
            / s.lengths
        dropped = (obj.advantages < 0) & (mean_kl > 0.05)
        assert dropped.any() and (~dropped & (obj.advantages < 0)).any()


def test_sequence_level_every_chunk_size():
    """GSPO's row sums over chunks of every size, so that chunks split the sources' groups every way."""
    model, source = tiny_model(), toy_batch()
    n = len(_candidates(model, source, 3, MAX_LEN))
    _check(model, source, "gspo", 0.04, True, chunks=range(1, n + 1))


@pytest.mark.parametrize("name", ["cispo", "sapo", "gspo", "luspo"])
def test_lstm_autograd_paths(name, monkeypatch):
    model, source = tiny_model(), toy_batch()
    monkeypatch.setattr(model, "weighted_tree_backward", None)  # `step` over the tree / `token_scores` rows
    monkeypatch.setattr(model, "weighted_score_backward", None)
    _check(model, source, name, 0.04, True, chunks=(1, 3, 1000))


def test_closed_form_weights_equal_autograd_of_trls_formula():
    """At the sequence level a position's weight is the whole row's derivative: `derivative` with the rows'
    statistics against autograd of TRL's formula over (N, T)."""
    g = torch.Generator().manual_seed(0)
    N, T = 6, 5
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 2
    lengths = torch.tensor([5, 3, 1, 4, 5, 2])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    ref = old - 0.2
    row, col = mask.nonzero(as_tuple=True)
    for name in CASES:
        for beta in (0.0, 0.04):
            kw = {"epsilon": 0.2, "epsilon_high": 0.28, **CASES[name]}
            obj = policy_loss(adv, old, lengths=lengths, beta=beta, ref_token_logps=ref, max_len=MAX_LEN, **kw)
            tok = (old + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)).requires_grad_()
            want = _trl_loss(tok, mask, adv, old, ref, loss_type=kw["loss_type"], beta=beta,
                             eps_high=kw["epsilon_high"], level=kw.get("importance_sampling_level", "token"),
                             delta=kw.get("delta"), tau_pos=kw.get("sapo_temperature_pos", 1.0),
                             tau_neg=kw.get("sapo_temperature_neg", 1.05),
                             off_policy=kw.get("off_policy_mask_threshold"))
            (d_want,) = torch.autograd.grad(want, tok)
            logp = tok.detach()[row, col]
            if obj.needs_row_statistics():
                terms = obj.row_statistic_terms(logp, row, col)
                stats = terms.new_zeros(N, terms.shape[1]).index_add_(0, row, terms)
                obj = obj.with_row_statistics(stats)
            value, d, _ = obj.derivative(logp, row, col)
            assert float(value.sum()) == pytest.approx(want.item(), rel=1e-12), name
            torch.testing.assert_close(d, d_want[row, col], rtol=1e-10, atol=1e-14, msg=name)
            x = logp.clone().requires_grad_()
            (d_terms,) = torch.autograd.grad(obj.terms(x, row, col).sum(), x)  # autograd's path: the same
            torch.testing.assert_close(d_terms, d_want[row, col], rtol=1e-10, atol=1e-14, msg=name)


def test_truncated_rows_are_those_without_eos():
    tokens = torch.tensor([[4, 5, 3, 0], [4, 5, 6, 7], [3, 0, 0, 0], [6, 0, 0, 0]])
    assert truncated_rows(tokens, torch.tensor([3, 4, 1, 1]), eos_id=3).tolist() == [False, True, False, True]


def test_sequence_level_without_statistics_is_refused():
    obj = policy_loss(torch.ones(2, dtype=torch.float64), torch.zeros(2, 3), lengths=torch.tensor([3, 2]),
                      importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="statistics"):
        obj.derivative(torch.zeros(2), torch.tensor([0, 1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(torch.ones(2), torch.zeros(2, 3), lengths=torch.tensor([3, 2]), importance_sampling_level="row")


@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_token_level_objective_adds_no_host_sync_per_chunk(tree, level):
    """The clip counts and summed KL stay on the device until the batch ends: a token-level chunk waits for the
    host no more than a coefficient chunk does (`test_host_syncs_phase2.LSTM_READS`); the sequence level's
    statistics pass adds only what the model's per-token scoring reads (the LSTM's token_scores: its positions'
    count, twice)."""
    from test_host_syncs_phase2 import LSTM_READS, _lstm
    from benchmarks.hostsyncs import count_host_syncs
    model, source, s = _lstm()
    adv = advantages(torch.rand(len(s), generator=torch.Generator().manual_seed(0), dtype=torch.float64), s.owner, 4)
    obj = policy_loss(adv, s.token_scores, lengths=s.lengths, beta=0.04, ref_token_logps=s.token_scores - 0.1,
                      importance_sampling_level=level)
    counts = []
    for chunk in (16, 2):
        stats = {}
        with count_host_syncs() as syncs:
            rescore_backward(model, source, s, obj, chunk, prefix_sharing=tree, stats=stats)
        counts.append((stats["chunks"], syncs.total))
    (n1, t1), (n2, t2) = counts
    assert n2 >= n1 + 3
    per = (t2 - t1) / (n2 - n1)
    allowed = LSTM_READS["tree" if tree else "rows"] + (0 if level == "token" else 2)
    assert per <= allowed, (counts, syncs.report(8))


@pytest.mark.parametrize("case", ["gspo-off-policy-mask", "sapo"])
@pytest.mark.parametrize("name", ["transformer", "scored-transformer", "gru"])
def test_protocol_models(name, case):
    """Models of the protocol alone (`step` over the tree; their own `score` / `token_scores` over rows)."""
    import foreign_models
    model, source = foreign_models.make(name), foreign_models.sources(name)
    _check(model, source, case, 0.04, False, chunks=(2, 1000))


@pytest.mark.parametrize("case", ["gspo", "cispo-sequence"])
@pytest.mark.parametrize("kind,head", [("llama", True), ("t5", True), ("gpt2", False)])
def test_hf_wrappers(kind, head, case):
    """The HF wrappers' by-hand output layer (the causal LM's first token by autograd, the rest by hand: one
    row's positions split between two paths) and, without the head, autograd over the full logits."""
    pytest.importorskip("transformers")
    from test_hf import PROMPTS, _batch, _wrapped
    wrapper = _wrapped(kind)
    if not head:
        wrapper.head = None
    source = _batch(PROMPTS, wrapper.pad_id, left=kind != "t5")
    _check(wrapper, source, case, 0.04, False, chunks=(2, 1000), trees=(True,))
