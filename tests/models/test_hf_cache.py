"""Phase one's key/value caches. Self-attention caches live in buffers with room (`growing`), the same
candidates as concatenating. Keys and values are kept once per source (`twophase.models.hf.grouped`): a seq2seq
model's cross-attention cache and a causal LM's prompt cache are not copied to the K rows of a source. The attention functions equal
transformers' own attention over per-row copies; searches give the per-row searches' candidates and scores
(which test_hf.py checks against one forward per row); a model whose attention cannot fold is found out at
wrap time and decodes per row; the model's configured attention is back in place after every step."""
import importlib.util

import pytest
import torch

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import beam_search, sample  # noqa: E402
from twophase.models.hf import HFCausalLM, HFSeq2Seq, grouped  # noqa: E402
from twophase.models.hf.seq2seq import PerSource  # noqa: E402
from twophase.phase1 import search  # noqa: E402

import hf_tiny  # noqa: E402
from test_hf import CASES, IDS, PROMPTS, _batch, _reference, _tolerance, _wrapped  # noqa: E402

G = torch.Generator().manual_seed(0)


def _sdpa(query, key, value, mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module = torch.nn.Module()
    module.is_causal = False
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=False)[0]


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_fold_equals_attention_over_copies(q, mask_kind):
    """B sources' keys (B, h, S, d), K rows each: folded = sdpa over each row's copy, mask per source given per
    row as the models give it."""
    B, K, h, S, d = 3, 4, 2, 5, 8
    query = torch.randn(B * K, h, q, d, dtype=torch.float64, generator=G)
    key, value = (torch.randn(B, h, S, d, dtype=torch.float64, generator=G) for _ in range(2))
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 3:] = keep[2, 1] = False
    mask = None if mask_kind is None else keep[:, None, None, :].expand(B, 1, q, S)
    if mask_kind == "float":
        mask = torch.zeros(B, 1, q, S, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    rows = torch.arange(B).repeat_interleave(K)
    per_row_mask = None if mask is None else mask.index_select(0, rows)
    want = _sdpa(query, key.index_select(0, rows), value.index_select(0, rows), per_row_mask)
    got, _ = grouped.fold(torch.nn.Module(), query, key, value, per_row_mask, inner=lambda m, *a, **k:
                          (_sdpa(*a), None))
    assert got.shape == want.shape == (B * K, q, h, d)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("per_row", [False, True])
def test_prefixed_equals_attention_over_prompt_and_completion(q, per_row):
    """Prompt (B, hk, P, d) once per source plus each row's completion (N, hk, t, d), grouped heads (h = 2 hk),
    the last q completion positions the queries' (causal among them): sdpa over each row's concatenation with
    its prompt mask and a causal mask on the completion."""
    B, K, h, hk, P, t, d = 2, 3, 4, 2, 5, 4, 8
    N = B * K
    query = torch.randn(N, h, q, d, dtype=torch.float64, generator=G)
    prompt = tuple(torch.randn(B, hk, P, d, dtype=torch.float64, generator=G) for _ in range(2))
    own = tuple(torch.randn(N, hk, t, d, dtype=torch.float64, generator=G) for _ in range(2))
    keep = torch.ones(B, P, dtype=torch.bool)
    keep[0, :2] = False  # left padding
    rows = torch.arange(B).repeat_interleave(K)
    full = [torch.cat([x.index_select(0, rows), y], dim=2).repeat_interleave(h // hk, dim=1)
            for x, y in zip(prompt, own)]  # (N, h, P + t, d)
    causal = torch.arange(t)[None, :] <= torch.arange(t - q, t)[:, None]  # (q, t)
    mask = torch.cat([keep.index_select(0, rows)[:, None, None, :].expand(N, 1, q, P),
                      causal.expand(N, 1, q, t)], dim=3)
    want = _sdpa(query, *full, mask)
    if per_row:
        prompt, keep = tuple(x.index_select(0, rows) for x in prompt), keep.index_select(0, rows)
    got, _ = grouped.prefixed(torch.nn.Module(), query, *own, prompt, keep, scaling=d ** -0.5)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    with pytest.raises(NotImplementedError):
        grouped.prefixed(torch.nn.Module(), query, *own, prompt, keep, sliding_window=4)


def _searches(wrapper, source):
    return (beam_search(wrapper, source, 4, 7),
            sample(wrapper, source, 4, 7, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("kind, left", CASES, ids=IDS)
def test_folded_search_gives_the_per_row_searchs_candidates(kind, left, one_thread, monkeypatch):
    """Every model folds; beam search (compact steps from the first finished row on: per-source keys gathered
    per row) and sampling find what per-row decoding finds, and the state holds the per-source keys once."""
    monkeypatch.setattr(search, "COMPACT_AT", 1e-9)
    wrapper = _wrapped(kind)
    assert wrapper._folding is not None
    source = _batch(PROMPTS, wrapper.pad_id, left)
    folded = _searches(wrapper, source)
    folding, wrapper._folding = wrapper._folding, None
    per_row = _searches(wrapper, source)
    # t5 and llama compute in float32 inside (folded and per-row attention: other shapes), so float32's portable
    # 1e-5 relative; the float64 models agree to 1e-10
    atol, rtol = (1e-6, 1e-5) if kind in ("t5", "llama") else (1e-10, 0)
    for got, want in zip(folded, per_row):
        assert torch.equal(got.tokens, want.tokens)
        assert torch.allclose(got.scores, want.scores, atol=atol, rtol=rtol)
    wrapper._folding = folding
    with torch.inference_mode():
        enc = wrapper.encode(source)
        owner = torch.arange(3).repeat_interleave(2)
        state = wrapper.init_state(enc, owner)
        for prev in (wrapper.bos_id, 5, 6):
            state, _ = wrapper.step(enc, owner, torch.full((6,), prev), state)
    if isinstance(wrapper, HFSeq2Seq):  # the cross-attention cache: B rows, not B*K
        assert isinstance(state["cross"], PerSource) and state["cross"].pairs[0][0].shape[0] == 3
    else:  # the rows' cache: their two completion tokens, not prompt + completion
        assert state["kv"][0][0].shape[0] == 6 and state["length"] == 2


@pytest.mark.parametrize("kind", ["t5", "gpt2"])
def test_eager_attention_folds_too(kind, one_thread):
    """With the model set to eager attention, folding hands the folded call to the model file's own eager
    function: the per-row search's candidates."""
    model = hf_tiny.seq2seq(kind, seed=1) if kind == "t5" else hf_tiny.causal(kind)
    model.set_attn_implementation("eager")
    wrapper = HFSeq2Seq(model) if kind == "t5" else HFCausalLM(model)
    assert wrapper._folding is not None
    source = _batch(PROMPTS, wrapper.pad_id)
    folded = _searches(wrapper, source)
    wrapper._folding = None
    for got, want in zip(folded, _searches(wrapper, source)):
        assert torch.equal(got.tokens, want.tokens)
        assert torch.allclose(got.scores, want.scores, atol=1e-6, rtol=1e-5)  # float32, other shapes
    assert model.config._attn_implementation == "eager"


def test_an_attention_that_cannot_fold_decodes_per_row(one_thread, monkeypatch):
    """The wrap-time probe compares folded and per-row steps: an attention that gives other numbers, or fails,
    leaves the wrapper decoding per row (and correct)."""
    honest = (grouped.fold, grouped.prefixed)
    for broken in ("wrong", "raises"):
        def wrong(fn):
            def attention(*args, **kwargs):
                if broken == "raises":
                    raise RuntimeError("this attention reads every row's keys")
                out, w = fn(*args, **kwargs)
                return out * 1.01, w
            return attention
        monkeypatch.setattr(grouped, "fold", wrong(honest[0]))
        monkeypatch.setattr(grouped, "prefixed", wrong(honest[1]))
        for wrapper in (HFSeq2Seq(hf_tiny.seq2seq("t5", seed=1)), HFCausalLM(hf_tiny.causal("llama"))):
            assert wrapper._folding is None, broken
            s = beam_search(wrapper, _batch(PROMPTS, wrapper.pad_id), 3, 5)
            with torch.no_grad():
                again = wrapper.score(wrapper.encode(_batch(PROMPTS, wrapper.pad_id)), s.tokens, s.owner)
            assert torch.allclose(s.scores, again, atol=1e-6, rtol=1e-5)  # float32: search against one pass


def test_the_models_attention_is_back_after_every_step(one_thread):
    """Folding switches the model's attention for one forward: afterwards (also after a failed forward) every
    config names what it named before, and `generate` runs as usual."""
    wrapper = HFSeq2Seq(hf_tiny.seq2seq("bart"))
    configs = {id(m.config): m.config for m in wrapper.model.modules() if hasattr(m, "config")}.values()
    before = [c._attn_implementation for c in configs]
    source = _batch(PROMPTS, wrapper.pad_id)
    beam_search(wrapper, source, 3, 4)
    assert [c._attn_implementation for c in configs] == before == ["sdpa"] * len(before)
    with pytest.raises(IndexError):
        with torch.no_grad():
            enc = wrapper.encode(source)
            wrapper.step(enc, torch.arange(3).repeat_interleave(2), torch.full((6,), 99), wrapper.init_state(
                enc, None))
    assert [c._attn_implementation for c in configs] == before
    out = wrapper.model.generate(**source, max_new_tokens=3, do_sample=False, num_beams=1)
    assert out.shape[0] == 3


@pytest.mark.parametrize("kind", ["t5", "llama"])
def test_buffered_cache_grows_and_gives_the_concatenated_caches_candidates(kind, one_thread, monkeypatch):
    """Phase one keeps the self-attention cache in buffers with room (`growing`), grown every step here (ROOM
    1): the same candidates and scores as concatenating each step (buffers off), scores = teacher-forced."""
    from twophase.models.hf import cache, growing
    wrapper = _wrapped(kind)
    source = _batch(PROMPTS, wrapper.pad_id, left=kind != "t5")
    runs = {}
    for buffered in (False, True):  # buffers on last: the state checked below is theirs
        monkeypatch.setattr(growing, "ROOM", 1)
        monkeypatch.setattr(cache.Caches, "buffered", lambda self, on=buffered: on and not torch.is_grad_enabled())
        runs[buffered] = (beam_search(wrapper, source, 3, 7),
                          sample(wrapper, source, 3, 7, generator=torch.Generator().manual_seed(1)))
    for got, want in zip(runs[True], runs[False]):
        assert torch.equal(got.tokens, want.tokens)
        assert torch.allclose(got.scores, want.scores, atol=1e-12, rtol=0)
        assert torch.allclose(got.scores, _reference(wrapper, got), atol=_tolerance(kind, got.scores), rtol=0)
    with torch.inference_mode():  # the state really holds buffers with room beyond the filled length
        enc = wrapper.encode(source)
        owner = torch.zeros(2, dtype=torch.long)
        state = wrapper.init_state(enc, owner)
        prev = torch.full((2,), wrapper.bos_id)
        room = []
        for _ in range(5):
            state, _ = wrapper.step(enc, owner, prev, state)
            prev = torch.full((2,), 5)
            buffers = state["kv"] if kind == "llama" else state["self"]
            if buffers:  # a causal LM's rows cache nothing after the first step: the prompt is shared
                room.append(buffers[0][0].shape[2] - state["length"])
    assert min(room) >= 0 and max(room) > 0, room
