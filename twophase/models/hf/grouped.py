"""Attention of many rows over one source's keys and values, kept once per source: rows folded into queries.

A search decodes K rows per source. `generate` (and twophase before this module) copies every source's
cross-attention keys and values to each of its K rows, (N, h, S, d) per layer, and every step reads them K
times over: on the HF bench's T5 (B 8, K 16, S 128, width 256) a third of a decode step was that attention,
all of it memory traffic. Here they stay (B, h, S, d): a step's N = B*K single-token queries, ordered source by
source, become K queries of their source, (B, h, K, d), one attention call over the source's keys, the same
numbers (each query's softmax is over its own scores; nothing mixes queries). The projections of the encoder
output into keys and values are also made once per source instead of once per row.

transformers' attention layers (T5, BART, Marian, GPT-2, Llama, ...) call the function their config names
(`config._attn_implementation`, looked up in `AttentionInterface`), so a `Folding` of the model points every
config of it at `twophase_fold:<its implementation>` for one forward and back: that function folds a call whose
keys have fewer rows than its queries and hands any other call, unchanged, to the implementation the model was
configured with (sdpa, eager, ...). `checked` compares folded and per-row steps on a probe at wrap time.

A causal LM's rows share their prompt the same way: `encode` keeps the prompts' keys and values once, (B, h, P,
d) per layer, and a step's cache holds the rows' completions only. Inside `Folding(...)(prefix=...)` a
self-attention layer attends over its source's prompt (`prefixed`: the K rows folded into its queries, as above)
and the row's own completion, one softmax over both. The copy of the prompt cache to every row (2/3 of phase
one's cache on the HF bench: P = 128 of 192 positions, K = 16 copies) is gone, and with it the reading of it K
times per step and beam search's reordering of it.

Letters: B sources, K rows per source, N = B*K rows, h heads, q query positions, S key positions, d head size.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ... import owners
from ...protocol import eval_mode

NAME = "twophase_fold"
_REGISTERED = set()  # the names registered so far
_PREFIX = None  # inside `Folding(...)(prefix=...)`, (pairs, mask) for the attention function (one thread)


def fold(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *, inner, **kwargs):
    """`inner`'s attention where key and value (B, h, S, d) hold one entry per source and query (N, h, q, d) the
    N = B*K rows, source by source. The mask (and T5's position bias), given per row or per source, must be
    the same for all rows of a source, as a cross-attention mask is."""
    N, B = query.shape[0], key.shape[0]
    if N == B:
        return inner(module, query, key, value, attention_mask, **kwargs)
    if N % B:
        raise ValueError(f"folded attention: {N} query rows are not a whole number of rows per source for {B} "
                         f"sources")
    K, (h, q, d) = N // B, query.shape[1:]
    folded = query.view(B, K, h, q, d).transpose(1, 2).reshape(B, h, K * q, d)  # (B, h, K*q, d)
    attention_mask = _per_source(attention_mask, N, K, q)
    if kwargs.get("position_bias") is not None:
        kwargs["position_bias"] = _per_source(kwargs["position_bias"], N, K, q)
    kwargs["is_causal"] = False  # the K*q folded queries are not positions of one sequence
    out, _ = inner(module, folded, key, value, attention_mask, **kwargs)  # (B, K*q, h, d)
    return out.reshape(B, K, q, h, d).reshape(N, q, h, d), None


UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks")  # attention variants `prefixed` does not compute


def prefixed(module, query: Tensor, key: Tensor, value: Tensor, prefix: tuple, prefix_mask: Tensor,
             scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """Attention of the rows' queries (N, h, q, d) over their source's prefix, prefix = (keys, values) (b, hk,
    P, d) with prefix_mask (b, P) (b = B sources, rows K per source in order, or b = N, one per row), followed by
    the rows' own keys and values (N, hk, t, d), the last q of them the queries' own positions (causal among
    them). hk divides h (grouped key/value heads). Returns (N, q, h, d), as transformers' attention functions."""
    if dropout or any(kwargs.get(k) is not None for k in UNSUPPORTED):
        raise NotImplementedError("prefixed attention: no dropout, sliding window, soft cap or sinks")
    (N, h, q, d), (b, hk, P, _), t = query.shape, prefix[0].shape, key.shape[2]
    K, g = N // b, h // hk
    scale = d ** -0.5 if scaling is None else scaling
    folded = query.reshape(b, K, hk, g * q, d).transpose(1, 2).reshape(b, hk, K * g * q, d)  # (b, hk, K*g*q, d)
    on_prefix = torch.matmul(folded, prefix[0].transpose(-1, -2)) * scale  # (b, hk, K*g*q, P)
    on_prefix = on_prefix.masked_fill(~prefix_mask.bool()[:, None, None, :], float("-inf"))
    on_prefix = on_prefix.reshape(b, hk, K, g * q, P).transpose(1, 2).reshape(N, hk, g * q, P)
    own = torch.matmul(query.reshape(N, hk, g * q, d), key.transpose(-1, -2)) * scale  # (N, hk, g*q, t)
    if q > 1:  # query i sits at own position t - q + i and sees own positions up to it
        i = torch.arange(g * q, device=query.device) % q
        own = own.masked_fill(torch.arange(t, device=query.device) > (t - q + i)[:, None], float("-inf"))
    scores = torch.cat([on_prefix, own], dim=-1)  # (N, hk, g*q, P + t); softmax at least in float32, as sdpa's
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    w_prefix = weights[..., :P].reshape(b, K, hk, g * q, P).transpose(1, 2).reshape(b, hk, K * g * q, P)
    out = torch.matmul(w_prefix, prefix[1]).reshape(b, hk, K, g * q, d).transpose(1, 2)  # (b, K, hk, g*q, d)
    out = out.reshape(N, hk, g * q, d) + torch.matmul(weights[..., P:], value)  # (N, hk, g*q, d)
    return out.reshape(N, h, q, d).transpose(1, 2), None  # (N, q, h, d)


def _per_source(mask: Tensor | None, N: int, K: int, q: int) -> Tensor | None:
    """A (rows, ., q, S) mask or bias for the folded queries: one row per source (the first of its K where it
    is given per row), its q query positions repeated for each of the K rows when q > 1."""
    if mask is None:
        return None
    if mask.shape[0] == N:
        mask = mask[::K]  # (B, ., q or 1, S): the rows of a source share it
    if q > 1 and mask.shape[2] > 1:
        b, c, _, S = mask.shape
        mask = mask[:, :, None].expand(b, c, K, q, S).reshape(b, c, K * q, S)
    return mask


def blocked(owner: Tensor, B: int) -> int:
    """K where owner (N,) is arange(B) with each source repeated K times in order (the layout both searches
    decode all rows in), else 0."""
    N = owner.numel()
    if B == 0 or N % B:
        return 0
    known = owners.known_blocks(owner, B)  # the searches' own owner: known without reading it
    if known is not None:
        return known
    K = N // B
    expected = torch.arange(B, device=owner.device).repeat_interleave(K)
    return K if torch.equal(owner, expected) else 0


class Folding:
    """The configs of one model, and the attention implementation each was set to."""

    def __init__(self, model):
        configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
        self.configs = [c for c in configs.values() if hasattr(c, "_attn_implementation")]
        _register()

    @contextlib.contextmanager
    def __call__(self, prefix: tuple | None = None, prefix_mask: Tensor | None = None):
        """Attention folded for the block; with `prefix` (one (keys, values) pair per layer, in layer order)
        and its mask, every self-attention layer attends over its pair first (`prefixed`)."""
        global _PREFIX
        before = [c._attn_implementation for c in self.configs]
        try:
            for c, name in zip(self.configs, before):
                c._attn_implementation_internal = f"{NAME}:{name or 'eager'}"
            _PREFIX = None if prefix is None else (prefix, prefix_mask)
            yield
        finally:
            _PREFIX = None
            for c, name in zip(self.configs, before):
                c._attn_implementation_internal = name


def checked(wrapper, caches) -> Folding | None:
    """A `Folding` for the wrapper's model if folded steps give its per-row steps' log-probabilities on a probe
    (two sources of two tokens, one padded, two rows each, four steps: the first fills the cross-attention
    cache, the others read it; a causal LM's prompt read beside a growing completion); None where transformers
    predates the attention interface or the model's attention does not go through it or computes what `fold`
    and `prefixed` do not (a folded step then fails or differs)."""
    try:
        from transformers import AttentionInterface  # noqa: F401  (4.48+)
    except ImportError:
        return None
    if not caches.objects:
        return None
    folding = Folding(wrapper.model)
    device = next(wrapper.model.parameters()).device
    ids = torch.tensor([[wrapper.eos_id, wrapper.bos_id], [wrapper.bos_id, wrapper.eos_id]], device=device)
    source = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1], [1, 0]], device=device)}
    owner = torch.tensor([0, 0, 1, 1], device=device)
    tokens = torch.tensor([[wrapper.eos_id, wrapper.bos_id, wrapper.eos_id, wrapper.pad_id]] * 2, device=device)
    found = []
    try:
        with torch.no_grad(), eval_mode(wrapper.model):
            for use in (folding, None):
                wrapper._folding = use
                enc = wrapper.encode(source)
                state, logps = wrapper.init_state(enc, owner), []
                for prev in tokens:
                    state, logp = wrapper.step(enc, owner, prev, state)
                    logps.append(logp)
                found.append(torch.stack(logps))
    except Exception:  # noqa: BLE001  an attention that cannot read per-source keys: per-row steps
        return None
    finally:
        wrapper._folding = None
    return folding if torch.allclose(found[0], found[1], rtol=1e-4, atol=1e-4) else None



def _register() -> None:
    """`twophase_fold:<inner>` for every implementation transformers knows, each folding over that one and
    building its masks as that one does (a name without a mask function gets no mask at all)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    for name in ["eager", *ALL_ATTENTION_FUNCTIONS.keys()]:
        key = f"{NAME}:{name}"
        if name.startswith(NAME) or key in _REGISTERED:
            continue
        AttentionInterface.register(key, _folding_over(name))
        if name in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(key, ALL_MASK_ATTENTION_FUNCTIONS[name])
        _REGISTERED.add(key)


def _folding_over(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, **kwargs):
        if _PREFIX is not None:  # a causal LM's step: the model's own mask covers the completion only
            pairs, mask = _PREFIX
            return prefixed(module, query, key, value, pairs[module.layer_idx], mask, **kwargs)
        inner = _eager(module) if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
        return fold(module, query, key, value, attention_mask, inner=inner, **kwargs)
    return attention


def _eager(module):
    """The eager attention of the module's own model file (each family writes its own)."""
    import sys
    return sys.modules[type(module).__module__].eager_attention_forward
