"""Hugging Face models through the protocol (`twophase.models.hf`): search scores are the model's own
teacher-forced log-probabilities, the chunked phase-two gradient equals one backward over all rows, computed
independently (one HF forward per row over its unpadded source or prompt + completion), in float64."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("transformers") is None:  # only a missing extra skips: a broken install fails
    pytest.skip("transformers is not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import beam_search, rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM, HFSeq2Seq  # noqa: E402
from twophase.phase1.onephase import one_phase_backward, one_phase_beam_search  # noqa: E402

import hf_tiny  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [4, 8, 11, 6]]  # word ids, of different lengths


def _batch(rows, pad_id, left=False):
    """A tokenizer-style batch of rows padded to the longest, on the left or the right."""
    P = max(map(len, rows))
    ids = torch.full((len(rows), P), pad_id)
    mask = torch.zeros(len(rows), P, dtype=torch.long)
    for i, r in enumerate(rows):
        at = slice(P - len(r), P) if left else slice(0, len(r))
        ids[i, at], mask[i, at] = torch.tensor(r), 1
    return {"input_ids": ids, "attention_mask": mask}


# T5 and Llama normalise in float32 whatever the model's dtype (T5LayerNorm's variance, LlamaRMSNorm): two
# computations of one quantity that differ in the last float64 bits may round to float32 differently, so their
# results agree to about 1e-7 relative, not 1e-15. BART, Marian and GPT-2 run in float64 throughout.
TOLERANCE = {"t5": 1e-6, "llama": 1e-6}
EXACT = 1e-10
SEEDS = {"t5": 1}  # seed 0's T5 ends no row within 6 tokens: the tests must see rows that end with eos


def _tolerance(kind, scores):
    # transformers 4.x's Llama returns float32 logits whatever the model's dtype
    return 1e-4 if scores.dtype == torch.float32 else TOLERANCE.get(kind, EXACT)


def _wrapped(kind):
    if kind in hf_tiny.SEQ2SEQ:
        model = hf_tiny.seq2seq(kind, seed=SEEDS.get(kind, 0))
        if hasattr(model, "final_logits_bias"):  # zeros as built; seed 5's bias still lets rows end with eos
            with torch.no_grad():
                model.final_logits_bias.normal_(generator=torch.Generator().manual_seed(5))
        return HFSeq2Seq(model)
    return HFCausalLM(hf_tiny.causal(kind, seed=SEEDS.get(kind, 0)))


def _assert_close_grads(got, want, tol):
    """Per parameter tensor, |got - want| <= tol (|want| + |all of want| / 100) (L2 norms): a gradient that is
    zero in exact arithmetic (an attention key bias: softmax ignores a shift shared by all keys) is rounding
    noise in both, so its own norm cannot be the scale."""
    assert got.keys() == want.keys()
    scale = float(torch.stack([g.norm() for g in want.values()]).norm()) / 100
    for n in want:
        assert float((got[n] - want[n]).norm()) <= tol * (float(want[n].norm()) + scale), n


def _reference(wrapper, samples):
    """(N,) log p of each candidate from one forward per row without padding: the seq2seq model on its real
    source tokens, the causal model on its real prompt tokens followed by the completion."""
    model, out = wrapper.model, []
    for tokens, n, o in zip(samples.tokens, samples.lengths.tolist(), samples.owner.tolist()):
        src, row = torch.tensor(PROMPTS[o])[None], tokens[:n][None]
        if isinstance(wrapper, HFSeq2Seq):
            start = torch.full((1, 1), wrapper.bos_id)
            logits = model(input_ids=src, decoder_input_ids=torch.cat([start, row[:, :-1]], 1)).logits[0]
        else:
            P = src.shape[1]
            logits = model(input_ids=torch.cat([src, row[:, :-1]], 1)).logits[0, P - 1:]  # (n, V)
        out.append(torch.log_softmax(logits, -1).gather(1, row.T).sum())
    return torch.stack(out)


CASES = [("t5", False), ("bart", False), ("marian", False), ("gpt2", False), ("gpt2", True), ("llama", False),
         ("llama", True)]
IDS = [k + ("-left" if left else "") for k, left in CASES]


@pytest.mark.parametrize("kind, left", CASES, ids=IDS)
def test_search_scores_are_the_models_log_probs(kind, left, one_thread):
    wrapper = _wrapped(kind)
    source = _batch(PROMPTS, wrapper.pad_id, left)
    ended = False
    for s in (beam_search(wrapper, source, 4, 6),
              sample(wrapper, source, 4, 6, generator=torch.Generator().manual_seed(0))):
        assert torch.allclose(s.scores, _reference(wrapper, s), atol=_tolerance(kind, s.scores), rtol=0)
        specials = {wrapper.pad_id, wrapper.bos_id} - {wrapper.eos_id}
        for row, n in zip(s.tokens.tolist(), s.lengths.tolist()):
            assert not specials & set(row[:n])
            assert all(t == wrapper.pad_id for t in row[n:])
        ended |= bool((s.lengths < 6).any())
    assert ended  # rows end with eos_id, which search never bans (GPT-2 pads with it, BART starts with it)


@pytest.mark.parametrize("kind, left", CASES, ids=IDS)
def test_chunked_gradient_equals_one_backward(kind, left, one_thread):
    wrapper = _wrapped(kind)
    source = _batch(PROMPTS, wrapper.pad_id, left)
    s = beam_search(wrapper, source, 4, 5)
    c = torch.randn(len(s), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    c[1] = 0.0  # a row phase two skips
    wrapper.zero_grad(set_to_none=True)
    (c * _reference(wrapper, s)).sum().backward()
    want = {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}
    wrapper.zero_grad(set_to_none=True)
    rescore_backward(wrapper, source, s, c, chunk_size=3)
    got = {n: p.grad for n, p in wrapper.named_parameters() if p.grad is not None}
    _assert_close_grads(got, want, TOLERANCE.get(kind, EXACT))


def test_one_phase_gradient_through_the_cache_equals_phase_two(one_thread):
    """The search graph runs through the cache's reordering: one backward over it gives phase two's gradient."""
    for kind in ("bart", "gpt2"):
        wrapper = _wrapped(kind)
        source = _batch(PROMPTS, wrapper.pad_id, left=True)
        s, log_p = one_phase_beam_search(wrapper, source, 3, 4)
        c = torch.linspace(-1, 1, len(s), dtype=torch.float64)
        one_phase_backward(log_p, c)
        one = {n: p.grad.clone() for n, p in wrapper.named_parameters()}
        wrapper.zero_grad(set_to_none=True)
        rescore_backward(wrapper, source, s, c, chunk_size=4)
        _assert_close_grads({n: p.grad for n, p in wrapper.named_parameters()}, one, EXACT)


def test_padding_side_does_not_change_candidates(one_thread):
    wrapper = _wrapped("gpt2")
    right, left = (beam_search(wrapper, _batch(PROMPTS, wrapper.pad_id, side), 4, 5) for side in (False, True))
    assert torch.equal(right.tokens, left.tokens)
    assert torch.allclose(right.scores, left.scores, atol=1e-10, rtol=0)


def test_special_ids_come_from_the_config():
    t5, bart, gpt2, llama = (_wrapped(k) for k in ("t5", "bart", "gpt2", "llama"))
    assert (t5.pad_id, t5.bos_id, t5.eos_id) == (hf_tiny.PAD, hf_tiny.PAD, hf_tiny.EOS)  # T5 starts with pad
    assert (bart.pad_id, bart.bos_id, bart.eos_id) == (hf_tiny.PAD, hf_tiny.EOS, hf_tiny.EOS)  # BART with eos
    assert gpt2.pad_id == gpt2.eos_id == hf_tiny.EOS  # no pad token: eos pads
    assert (llama.pad_id, llama.bos_id, llama.eos_id) == (hf_tiny.EOS, hf_tiny.BOS, hf_tiny.EOS)
    tok = hf_tiny.tokenizer()
    assert HFCausalLM(hf_tiny.causal("gpt2"), tok).pad_id == tok.pad_token_id == hf_tiny.PAD


def test_bad_models_and_prompts_are_refused():
    import transformers as T
    t5 = T.T5ForConditionalGeneration(T.T5Config(vocab_size=8, d_model=8, d_kv=4, d_ff=8, num_layers=1,
                                                 num_heads=2))  # a fresh T5Config has no decoder start token
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        HFSeq2Seq(t5)
    wrapper = _wrapped("gpt2")
    source = _batch(PROMPTS, wrapper.pad_id)
    source["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="no token"):
        beam_search(wrapper, source, 2, 3)
    source = _batch(PROMPTS, wrapper.pad_id)
    s = beam_search(wrapper, source, 2, 3)
    model = wrapper.model
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # 5.x name
    wrapper.train()  # MLE rows scored with dropout: HF's gradient checkpointing then drops the cache
    with pytest.raises(ValueError, match="no key/value cache"):
        rescore_backward(wrapper, source, s, torch.ones(len(s)), 2, keep_mode=True)


def test_tokenizer_and_model_reload_offline(tmp_path, one_thread):
    """save_pretrained / from_pretrained of a tiny model and tokenizer from a local folder, hub offline; the
    tokenizer's batches feed the wrapper and the reloaded model scores the same candidates identically."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok, model = hf_tiny.tokenizer(padding_side="left"), hf_tiny.causal("llama")
    tok.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        tok2 = AutoTokenizer.from_pretrained(tmp_path)
        dtype = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5.0
        model2 = AutoModelForCausalLM.from_pretrained(tmp_path, **{dtype: torch.float64}).eval()
    finally:
        for k, v in env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    source = tok2(["a b c", "d"], return_tensors="pt", padding=True)  # a BatchEncoding, as it comes
    assert source["input_ids"][1].tolist() == [hf_tiny.PAD, hf_tiny.PAD, 7]  # <pad> <pad> d, left-padded
    s = beam_search(HFCausalLM(model, tok), source, 3, 4)
    again = beam_search(HFCausalLM(model2, tok2), source, 3, 4)
    assert torch.equal(s.tokens, again.tokens)
    assert torch.allclose(s.scores, again.scores, atol=1e-12, rtol=0)


def test_the_core_never_imports_transformers():
    """Nor does the training command, the built-in tasks or twophase.tasks.hf until --hf-model is given."""
    code = ("import sys, twophase, twophase.phase1.search, twophase.phase2.rescoring, twophase.phase1.onephase, "
            "twophase.objectives, "
            "twophase.train.cli, twophase.train.decode, twophase.tasks.text, twophase.tasks.hf; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ)).returncode == 0


def test_token_log_probs_by_hand():
    """The hand-differentiated log-softmax-and-gather: float64 gradcheck, and 16-bit logits scored in float32
    with a gradient in their own dtype."""
    from twophase.models.hf.common import token_log_probs
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 3, 7, dtype=torch.float64, generator=g)).requires_grad_()
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(token_log_probs, (logits, tokens))
    want = torch.log_softmax(logits, -1).gather(2, tokens[:, :, None]).squeeze(2)
    assert torch.allclose(token_log_probs(logits, tokens), want, atol=1e-12, rtol=0)
    half = logits.detach().bfloat16().requires_grad_()
    got = token_log_probs(half, tokens)
    assert got.dtype == torch.float32
    assert torch.allclose(got, torch.log_softmax(half.float(), -1).gather(2, tokens[:, :, None]).squeeze(2))
    got.sum().backward()
    assert half.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["t5", "gpt2"])
def test_recomputed_source_keeps_no_activations_and_the_same_gradient(kind, one_thread):
    """recompute_source (the default) runs the source's forward again in the backward: encode saves nothing of
    it for backward but its inputs, and phase two's gradient is unchanged."""
    from twophase.system.memory import SavedTensorMeter
    wrapper = _wrapped(kind)
    source = _batch(PROMPTS, wrapper.pad_id, left=kind == "gpt2")
    s = beam_search(wrapper, source, 3, 4)
    c = torch.linspace(-1, 1, len(s), dtype=torch.float64)
    grads, saved = [], []
    for recompute in (True, False):
        wrapper.recompute_source = recompute
        with torch.enable_grad(), SavedTensorMeter(list(wrapper.parameters())) as meter:
            wrapper.encode(source)
        saved.append(meter.total_bytes)
        wrapper.zero_grad(set_to_none=True)
        rescore_backward(wrapper, source, s, c, chunk_size=2)
        grads.append({n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None})
    inputs = sum(x.numel() * x.element_size() for x in source.values())
    assert saved[0] <= inputs < 10 * inputs < saved[1]  # the checkpoint saves its inputs, ids and mask
    _assert_close_grads(grads[0], grads[1], TOLERANCE.get(kind, EXACT))


def _grads(wrapper):
    out = {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}
    wrapper.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", hf_tiny.SEQ2SEQ + hf_tiny.CAUSAL)
def test_score_from_hidden_states_is_the_models_log_probs(kind, one_thread):
    """`score` through the known head (`outputlayer.target_log_probs`, autograd; phase two itself goes through
    `weighted_score_backward`): the reference's values and, in one backward, its gradient."""
    wrapper = _wrapped(kind)
    assert wrapper.head is not None
    source = _batch(PROMPTS, wrapper.pad_id)
    s = beam_search(wrapper, source, 3, 5)
    c = torch.randn(len(s), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = _reference(wrapper, s)
    (c * want).sum().backward()
    want_grads = _grads(wrapper)
    log_p = wrapper.score(wrapper.encode(source), s.tokens, s.owner)
    assert torch.allclose(log_p, want.detach(), atol=_tolerance(kind, log_p), rtol=0)
    (c * log_p).sum().backward()
    _assert_close_grads(_grads(wrapper), want_grads, TOLERANCE.get(kind, EXACT))


@pytest.mark.parametrize("kind", hf_tiny.SEQ2SEQ + hf_tiny.CAUSAL)
def test_phase_two_keeps_no_logits_where_the_head_is_known(kind, one_thread):
    """Each family the tests cover has a known head, and phase two then saves nothing V-sized per row for
    backward, not even a (C, V) tensor (the causal LM's first tokens go through the head from the prompts'
    last states like every other position); the full-logits path (head None) saves the chunk's logits."""
    from twophase.system.memory import SavedTensorMeter
    V = 8000
    wrapper = (HFSeq2Seq(hf_tiny.seq2seq(kind, vocab=V)) if kind in hf_tiny.SEQ2SEQ else
               HFCausalLM(hf_tiny.causal(kind, vocab=V)))
    expected = {"t5": (0.25, None), "bart": (1.0, "final_logits_bias"), "marian": (1.0, "final_logits_bias")}
    assert (wrapper.head.scale, wrapper.head.buffer) == expected.get(kind, (1.0, None))  # T5: d_model ** -0.5
    source = _batch(PROMPTS, wrapper.pad_id)
    s = sample(wrapper, source, 2, 6, generator=torch.Generator().manual_seed(0))
    peaks = []
    for head in (wrapper.head, None):
        wrapper.head = head
        with SavedTensorMeter(list(wrapper.parameters())) as meter:
            rescore_backward(wrapper, source, s, torch.ones(len(s), dtype=torch.float64), chunk_size=len(s))
        peaks.append(meter.peak_bytes)
    logits = s.tokens.numel() * V * 8  # float64
    assert peaks[0] < len(s) * V * 8 and peaks[1] >= logits, (peaks, len(s) * V * 8)



def test_unknown_heads_fall_back_to_the_full_logits(one_thread):
    """No head where it cannot be known: a subclass (its forward may differ), a hook on lm_head, a T5 whose
    forward scales its logits otherwise than its config says (caught by the wrap-time check). The fallback
    scores and differentiates the model's own logits: search scores and the chunked gradient still equal the
    reference."""
    gpt2 = hf_tiny.causal("gpt2")
    gpt2.__class__ = type("MyGPT2", (type(gpt2),), {})
    hooked = hf_tiny.causal("llama")
    hooked.lm_head.register_forward_hook(lambda module, args, out: out)
    t5 = hf_tiny.seq2seq("t5", seed=SEEDS["t5"])
    t5.model_dim *= 4  # lm_head(h / (2 d_model ** 0.5)): logits scaled by 1/2
    assert HFCausalLM(hooked).head is None
    for wrapper in (HFCausalLM(gpt2), HFSeq2Seq(t5)):
        assert wrapper.head is None and wrapper.weighted_score_backward is None
        source = _batch(PROMPTS, wrapper.pad_id)
        s = beam_search(wrapper, source, 3, 5)
        want = _reference(wrapper, s)
        assert torch.allclose(s.scores, want.detach(), atol=TOLERANCE["t5"], rtol=0)
        c = torch.linspace(-1, 1, len(s), dtype=torch.float64)
        (c * want).sum().backward()
        want_grads = _grads(wrapper)
        rescore_backward(wrapper, source, s, c, chunk_size=2)
        _assert_close_grads(_grads(wrapper), want_grads, TOLERANCE["t5"])


def test_causal_rows_of_one_token(one_thread):
    """A chunk whose rows score only their first token (from the prompts' logits): no forward after it."""
    from twophase.samples import Samples
    wrapper = _wrapped("gpt2")
    source = _batch(PROMPTS, wrapper.pad_id)
    s = beam_search(wrapper, source, 2, 4)
    s = Samples(s.tokens[:, :1], torch.ones(len(s), dtype=torch.long), s.owner, s.scores)
    c = torch.linspace(-1, 1, len(s), dtype=torch.float64)
    (c * _reference(wrapper, s)).sum().backward()
    want = _grads(wrapper)
    rescore_backward(wrapper, source, s, c, chunk_size=3)
    _assert_close_grads(_grads(wrapper), want, EXACT)
