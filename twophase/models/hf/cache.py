"""Hugging Face key/value caches as trees of tensors, and back.

Search reorders a model's state by selecting rows of every tensor in it (`twophase.tree.select_rows`), so the
wrappers keep a decoder's cache as plain tuples, one (keys, values) pair of (N, heads, length, head_dim) tensors
per layer, and rebuild the library's `Cache` object around them for each forward. Building a `DynamicCache` from
tensors stores them as they are (its first `update` concatenates onto an empty tensor: one copy), which is what
`generate` itself does at every step.

transformers renamed the forward keyword `past_key_values` to `cache` in 5.x (the old name still works until
5.40 with a deprecation warning) and removed `from_legacy_cache`; both spellings are handled here, so the
wrappers need nothing newer than `EncoderDecoderCache` (4.42).
"""
from __future__ import annotations

import inspect

from transformers import DynamicCache, EncoderDecoderCache

Layers = tuple  # ((keys, values), ...) one pair per layer


def keyword(model) -> str:
    """The forward keyword that takes the cache: `cache` (transformers 5.x) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned(output):
    """The cache a forward returned (`cache` in 5.x outputs, `past_key_values` before)."""
    found = getattr(output, "cache", None)
    return found if found is not None else getattr(output, "past_key_values", None)


def _pairs(cache) -> Layers:
    if isinstance(cache, tuple):  # a model that still returns the legacy format
        return tuple((layer[0], layer[1]) for layer in cache)
    if hasattr(cache, "layers"):  # 4.56+: a list of layer objects
        return tuple((layer.keys, layer.values) for layer in cache.layers)
    return tuple(zip(cache.key_cache, cache.value_cache))


def _dynamic(pairs: Layers) -> DynamicCache:
    if hasattr(DynamicCache, "from_legacy_cache"):  # before 5.0
        return DynamicCache.from_legacy_cache(pairs)
    return DynamicCache(pairs) if pairs else DynamicCache()


def to_layers(cache) -> Layers:
    """A decoder-only cache as ((keys, values), ...)."""
    return _pairs(cache)


def from_layers(pairs: Layers) -> DynamicCache:
    return _dynamic(pairs)


def to_layers2(cache) -> tuple[Layers, Layers]:
    """An encoder-decoder cache as (self-attention pairs, cross-attention pairs)."""
    if isinstance(cache, tuple):  # legacy: (self keys, self values, cross keys, cross values) per layer
        return tuple((x[0], x[1]) for x in cache), tuple((x[2], x[3]) for x in cache)
    return _pairs(cache.self_attention_cache), _pairs(cache.cross_attention_cache)


def from_layers2(self_pairs: Layers, cross_pairs: Layers) -> EncoderDecoderCache:
    """The cross-attention entries count as computed when present: attention layers then read them instead of
    projecting the encoder output again."""
    return EncoderDecoderCache(_dynamic(self_pairs), _dynamic(cross_pairs))
