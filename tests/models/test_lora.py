"""LoRA adapters (peft) through the Hugging Face wrappers: a `PeftModel` is recognised, keeps the output layer
from the hidden states (no (C, T, V) logits saved in phase two), and its chunked gradient (adapters only) equals
one backward of the PeftModel's own forwards, in float64; a LoRA on lm_head falls back, with one line saying so."""
import importlib.util

import pytest
import torch

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None:
    pytest.skip("transformers and peft are not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM, HFSeq2Seq  # noqa: E402
from twophase.models.hf.lora import attach  # noqa: E402
from twophase.system.memory import SavedTensorMeter  # noqa: E402

import hf_tiny  # noqa: E402
from test_hf import PROMPTS, TOLERANCE, EXACT, _assert_close_grads, _batch  # noqa: E402


def _peft(kind, vocab=hf_tiny.VOCAB, targets=None):
    seq2seq = kind in hf_tiny.SEQ2SEQ
    model = hf_tiny.seq2seq(kind, seed=1, vocab=vocab) if seq2seq else hf_tiny.causal(kind, vocab=vocab)
    torch.manual_seed(3)
    adapted = attach(model, 4, 8.0, 0.0, targets, seq2seq).double().eval()
    with torch.no_grad():  # lora_B starts at zero: give the adapters a value, so their gradients are generic
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return adapted, (HFSeq2Seq(adapted) if seq2seq else HFCausalLM(adapted))


def _peft_reference(adapted, wrapper, samples):
    """(N,) log p of each candidate from the PeftModel's own forward, one unpadded row at a time."""
    out = []
    for tokens, n, o in zip(samples.tokens, samples.lengths.tolist(), samples.owner.tolist()):
        src, row = torch.tensor(PROMPTS[o])[None], tokens[:n][None]
        if isinstance(wrapper, HFSeq2Seq):
            start = torch.full((1, 1), wrapper.bos_id)
            logits = adapted(input_ids=src, decoder_input_ids=torch.cat([start, row[:, :-1]], 1)).logits[0]
        else:
            P = src.shape[1]
            logits = adapted(input_ids=torch.cat([src, row[:, :-1]], 1)).logits[0, P - 1:]
        out.append(torch.log_softmax(logits, -1).gather(1, row.T).sum())
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["t5", "gpt2"])
def test_lora_chunked_gradient_is_exact_on_the_fast_path(kind, one_thread):
    adapted, wrapper = _peft(kind)
    assert wrapper.adapter is adapted and wrapper.head is not None and wrapper.head_note is None
    trainable = {n for n, p in wrapper.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    source = _batch(PROMPTS, wrapper.pad_id)
    s = sample(wrapper, source, 3, 5, generator=torch.Generator().manual_seed(0))
    c = torch.randn(len(s), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (c * _peft_reference(adapted, wrapper, s)).sum().backward()
    want = {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}
    wrapper.zero_grad(set_to_none=True)
    rescore_backward(wrapper, source, s, c, chunk_size=2)
    got = {n: p.grad for n, p in wrapper.named_parameters() if p.grad is not None}
    assert set(want) == trainable
    _assert_close_grads(got, want, TOLERANCE.get(kind, EXACT))


@pytest.mark.parametrize("kind", ["t5", "gpt2"])
def test_lora_phase_two_saves_no_logits(kind, one_thread):
    V = 4000
    _, wrapper = _peft(kind, vocab=V)
    source = _batch(PROMPTS, wrapper.pad_id)
    s = sample(wrapper, source, 2, 6, generator=torch.Generator().manual_seed(0))
    peaks = []
    for head in (wrapper.head, None):  # None: the full-logits path, which does save them
        wrapper.head = head
        with SavedTensorMeter(list(wrapper.parameters())) as meter:
            rescore_backward(wrapper, source, s, torch.ones(len(s), dtype=torch.float64), chunk_size=len(s))
        peaks.append(meter.peak_bytes)
    logits = s.tokens.numel() * V * 8  # a chunk's (C, T, V) float64 logits
    first = len(s) * V * 8 if kind == "gpt2" else 0  # the causal LM's first tokens: the prompts' (C, V)
    assert peaks[0] < first + logits / 4 and peaks[1] >= logits


def test_lora_on_lm_head_falls_back_and_says_so(one_thread):
    adapted, wrapper = _peft("gpt2", targets=["c_attn", "lm_head"])
    assert wrapper.head is None and "LoRA on the output layer" in wrapper.head_note
    source = _batch(PROMPTS, wrapper.pad_id)
    s = sample(wrapper, source, 2, 5, generator=torch.Generator().manual_seed(1))
    c = torch.randn(len(s), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (c * _peft_reference(adapted, wrapper, s)).sum().backward()
    want = {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}
    wrapper.zero_grad(set_to_none=True)
    rescore_backward(wrapper, source, s, c, chunk_size=3)
    _assert_close_grads({n: p.grad for n, p in wrapper.named_parameters() if p.grad is not None}, want, EXACT)


def test_a_plain_model_is_not_unwrapped():
    model = hf_tiny.causal("gpt2")
    wrapper = HFCausalLM(model)
    assert wrapper.model is model and wrapper.adapter is None and wrapper.head_note is None
