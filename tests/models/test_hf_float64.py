"""Float64 exactness of the Hugging Face path against an independent computation: phase two's chunked gradient
(rows scored in chunks through the wrappers, the output layer differentiated by hand) equals a plain float64
autograd of the same loss through the HF model itself, one row at a time (model(ids).logits -> log_softmax ->
gather), to 1e-12 relative, for Σ c_i log p_i and for the DAPO policy loss. T5's and Llama's RMS norms run in
float32 in transformers whatever the model's dtype; the wrappers keep a float64 model's in float64
(`twophase.models.hf.precision`), without which these differ by ~1e-8."""
import importlib.util

import pytest
import torch
from torch import nn

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM, HFSeq2Seq  # noqa: E402
from twophase.models.hf.precision import keep_float64_norms  # noqa: E402
from twophase.objectives.policy import advantages, policy_loss  # noqa: E402

import hf_tiny  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [4, 8, 11, 6]]


def _source(pad_id):
    P = max(map(len, PROMPTS))
    ids, mask = torch.full((3, P), pad_id), torch.zeros(3, P, dtype=torch.long)
    for i, r in enumerate(PROMPTS):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return {"input_ids": ids, "attention_mask": mask}


def _wrapped(kind):
    if kind in hf_tiny.SEQ2SEQ:
        return HFSeq2Seq(hf_tiny.seq2seq(kind, seed=1))
    return HFCausalLM(hf_tiny.causal(kind))


def _plain_token_log_probs(wrapper, s):
    """(N, T) log p of each row's tokens from one forward of the HF model per row (its real prompt or source,
    no padding), with the graph; 0 past each row's end."""
    rows = []
    for tokens, n, o in zip(s.tokens, s.lengths.tolist(), s.owner.tolist()):
        src, row = torch.tensor(PROMPTS[o])[None], tokens[:n][None]  # (1, P), (1, n)
        if isinstance(wrapper, HFSeq2Seq):
            start = torch.full((1, 1), wrapper.bos_id)
            logits = wrapper.model(input_ids=src, decoder_input_ids=torch.cat([start, row[:, :-1]], 1)).logits[0]
        else:
            logits = wrapper.model(input_ids=torch.cat([src, row[:, :-1]], 1)).logits[0, src.shape[1] - 1:]
        lp = torch.log_softmax(logits, -1).gather(1, row.T)[:, 0]  # (n,)
        rows.append(torch.nn.functional.pad(lp, (0, s.tokens.shape[1] - n)))
    return torch.stack(rows)


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _relative(got, want):
    assert got.keys() == want.keys()
    num = sum(float((got[n] - want[n]).norm()) ** 2 for n in want) ** 0.5
    return num / sum(float(want[n].norm()) ** 2 for n in want) ** 0.5


@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5", "bart"])
def test_chunked_gradient_equals_a_plain_float64_autograd(kind, one_thread):
    wrapper = _wrapped(kind)
    source = _source(wrapper.pad_id)
    s = sample(wrapper, source, 3, 5, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    c = torch.randn(len(s), dtype=torch.float64, generator=g)
    r = torch.rand(len(s), dtype=torch.float64, generator=g)
    old = s.token_scores + 0.3 * torch.randn(s.token_scores.shape, dtype=torch.float64, generator=g)
    adv = advantages(r, s.owner, 3)
    objective = policy_loss(adv, old, lengths=s.lengths, loss_type="dapo", epsilon=0.2, epsilon_high=0.28)

    tok = _plain_token_log_probs(wrapper, s)  # (N, T)
    (c * tok.sum(1)).sum().backward(retain_graph=True)
    want_seq = _grads(wrapper.model)
    scored = torch.arange(tok.shape[1])[None, :] < s.lengths[:, None]  # (N, T)
    ratio = (tok - old).exp()
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])  # TRL's, beta 0
    (torch.where(scored, per_token, 0.0).sum() / scored.sum()).backward()
    want_dapo = _grads(wrapper.model)

    for chunk in (2, len(s)):
        rescore_backward(wrapper, source, s, c, chunk_size=chunk)
        assert _relative(_grads(wrapper.model), want_seq) < 1e-12, chunk
        rescore_backward(wrapper, source, s, objective, chunk_size=chunk)
        assert _relative(_grads(wrapper.model), want_dapo) < 1e-12, chunk


def test_float64_norms_leave_other_dtypes_and_other_norms_alone():
    """The hook changes a float64 norm's output by float32 rounding only, a float32 one not at all, and a
    norm of another formula (Gemma's 1 + weight) is not hooked."""
    import transformers as T

    norm = T.models.llama.modeling_llama.LlamaRMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    before = norm(x)
    assert keep_float64_norms(norm) == 1 and keep_float64_norms(norm) == 0  # hooked once
    assert torch.equal(norm(x), before)  # float32: the module's own output, bit for bit
    norm.double()
    exact = norm.weight * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(x.double()), exact)

    class OnePlusRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.zeros(8)), 1e-6

        def forward(self, h):
            return (1 + self.weight) * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    assert keep_float64_norms(OnePlusRMSNorm()) == 0
