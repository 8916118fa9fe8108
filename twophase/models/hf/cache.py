"""Hugging Face key/value caches as trees of tensors, and back.

Search reorders a model's state by selecting rows of every tensor in it (`twophase.nested.select_rows`), so the
wrappers keep a decoder's cache as plain tuples, one (keys, values) pair of (N, heads, length, head_dim) tensors
per layer (cross-attention pairs apart), and rebuild what the model's forward takes around them: a `Cache`
object (`DynamicCache`, `EncoderDecoderCache`), or the legacy tuples for a 4.x model class that predates them
(`_supports_cache_class` False: GPT-2 and T5 before about 4.45). Building a `DynamicCache` from tensors copies
them once (its first `update` concatenates onto an empty tensor): one copy per step more than `generate` makes,
time but not memory, as the lists are drained layer by layer (`Caches.argument`).

transformers 5 renamed the forward keyword `past_key_values` to `cache` (the old name still works until 5.40,
with a warning), renamed the output field likewise and removed `from_legacy_cache`; both spellings are handled.
"""
from __future__ import annotations

import inspect

import torch

Layers = tuple  # ((keys, values), ...) one pair per layer


class Caches:
    """How one model takes and returns its cache."""

    def __init__(self, model):
        self.keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.objects = getattr(model, "_supports_cache_class", True)  # the attribute is gone in 5.x: all do

    def buffered(self) -> bool:
        """Whether a search step keeps the self-attention cache in `growing.BufferedLayer`s (written in place,
        no copy per step): where the model takes layered Cache objects and no graph is being built."""
        return self.objects and _layered() and not torch.is_grad_enabled()

    def argument(self, self_pairs: list, cross_pairs: list | None = None, length: int | None = None) -> dict:
        """The forward's cache keyword argument for a decoder-only cache (cross_pairs None) or an encoder-decoder
        one. Cross-attention pairs, when present, are read instead of projecting the encoder output again.

        The lists are emptied as the cache object copies them, a layer at a time: with the caller's state
        consumed (`step` may consume it, see twophase.protocol) each layer's old tensors are freed as its copy
        is made and again as the forward extends it, so a step holds one copy of the cache and a layer, not two
        copies (the previous state and the new one)."""
        if not self.objects:
            if not self_pairs:
                return {}
            if cross_pairs is None:
                return {self.keyword: tuple(self_pairs)}
            return {self.keyword: tuple(s + c for s, c in zip(self_pairs, cross_pairs))}
        own = _dynamic(self_pairs) if length is None else _buffered(self_pairs, length)
        if cross_pairs is None:
            return {self.keyword: own}
        from transformers import EncoderDecoderCache
        return {self.keyword: EncoderDecoderCache(own, _dynamic(cross_pairs))}

    @staticmethod
    def buffers(output, encoder_decoder: bool = False) -> tuple[Layers, int]:
        """The self-attention buffers a forward given `argument(..., length=...)` returned, and their filled
        length."""
        found = _returned(output)
        layers = (found.self_attention_cache if encoder_decoder else found).layers
        return tuple(layer.buffers for layer in layers), layers[0].get_seq_length()

    @staticmethod
    def layers(output) -> Layers:
        """The decoder-only cache a forward returned, as ((keys, values), ...)."""
        return _pairs(_returned(output))

    @staticmethod
    def layers2(output) -> tuple[Layers, Layers]:
        """The encoder-decoder cache a forward returned, as (self-attention pairs, cross-attention pairs)."""
        found = _returned(output)
        if isinstance(found, tuple):  # legacy: (keys, values, cross keys, cross values) per layer
            return tuple((x[0], x[1]) for x in found), tuple((x[2], x[3]) for x in found)
        return _pairs(found.self_attention_cache), _pairs(found.cross_attention_cache)


def _returned(output):
    # 5.x outputs have `cache` (their past_key_values is an alias that warns); 4.x ones past_key_values
    name = "cache" if "cache" in getattr(output, "__dataclass_fields__", ()) else "past_key_values"
    found = getattr(output, name, None)
    if found is None:
        raise ValueError("the model returned no key/value cache although use_cache=True (gradient checkpointing "
                         "turns it off in training mode: disable it, or score in evaluation mode)")
    return found


def _pairs(cache) -> Layers:
    if isinstance(cache, tuple):
        return tuple((layer[0], layer[1]) for layer in cache)
    if hasattr(cache, "layers"):  # 4.56+: a list of layer objects
        return tuple((layer.keys, layer.values) for layer in cache.layers)
    return tuple(zip(cache.key_cache, cache.value_cache))


def _dynamic(pairs: list):
    from transformers import DynamicCache
    if hasattr(DynamicCache, "from_legacy_cache"):  # 4.x
        return DynamicCache.from_legacy_cache(tuple(pairs) if pairs else None)
    if not pairs:
        return DynamicCache()
    return _wrapped(pairs) or DynamicCache(_drain(pairs))


def _wrapped(pairs: list):
    """A `DynamicCache` whose layers hold the pairs' tensors themselves (no copy), the list emptied; None where
    this transformers' cache is not a list of `DynamicLayer`s built by `Cache(layers=...)` (then the constructor
    copies them)."""
    from transformers.cache_utils import Cache, DynamicCache
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # before 4.56: no layer objects
        return None
    layers = []
    for keys, values in _drain(pairs):
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)  # device, dtype, is_initialized (and empty tensors, replaced)
        layer.keys, layer.values = keys, values
        layers.append(layer)
    out = DynamicCache.__new__(DynamicCache)
    Cache.__init__(out, layers=layers)  # what DynamicCache(pairs) ends with, less the copies
    return out


def _layered() -> bool:
    try:
        from transformers.cache_utils import DynamicLayer  # noqa: F401  (4.56+: caches are lists of layers)
    except ImportError:
        return False
    return True


def _buffered(buffers: list, length: int):
    """A cache of `growing.BufferedLayer`s over the buffers (made at the first update where there are none)."""
    from transformers.cache_utils import Cache, DynamicCache
    from .growing import BufferedLayer
    out = DynamicCache.__new__(DynamicCache)
    if buffers:
        Cache.__init__(out, layers=[BufferedLayer(pair, length) for pair in _drain(buffers)])
    else:
        Cache.__init__(out, layer_class_to_replicate=BufferedLayer)
    return out


def _drain(pairs: list):
    """The pairs, each removed from the list as it is handed over: once the cache has copied a layer, nothing
    but the caller's state (if it was not consumed) holds the original."""
    while pairs:
        yield pairs.pop(0)
