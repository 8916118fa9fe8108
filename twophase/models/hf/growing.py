"""A search's self-attention cache in preallocated buffers, as a transformers `DynamicLayer`.

`DynamicLayer.update` concatenates each new token's keys and values onto the cache: every step copies the
whole cache into a fresh allocation (on CPU, fresh pages, hence page faults too). That copy was the largest
single cost of a causal decode step, `generate`'s as well as ours (docs/results/). `BufferedLayer` keeps the
cache in buffers with room for more tokens: a step writes its token in place and hands attention a view of the
filled part, [:, :, :length]. When the room runs out the buffers are copied into larger ones, with room for half
as many completion tokens again as are cached (at least ROOM): a search of T tokens copies its cache O(log T)
times, not T times, and holds at most half the completion's length of unused room.

The search state keeps the buffers and the filled length (`Caches.argument`, `Caches.buffered`); beam search's
row selection copies the buffers whole, room included. In-place writes into tensors autograd may have saved are
wrong, so the buffers are only used without gradients (phase one under inference mode; one-phase, which
samples with a graph, keeps concatenating).

Letters: N rows, heads h, n cached positions, L new ones, d head size.
"""
from __future__ import annotations

from transformers.cache_utils import DynamicLayer

ROOM = 32  # positions of room at least, when a buffer is made or grown


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of the first `length` positions of `buffers` (N, h,
    capacity, d); with no buffers, they are made at the first update. `base`: the length it was built with (the
    prompt's, for a causal LM), which sets how much room growing adds."""

    def __init__(self, buffers: tuple | None = None, length: int = 0):
        super().__init__()
        self.buffers, self.base = buffers, length
        if buffers is not None:
            self.lazy_initialization(*buffers)  # device, dtype, is_initialized
            self.keys, self.values = (b[:, :, :length] for b in buffers)

    def update(self, key_states, value_states, *args, **kwargs):
        n, L = self.get_seq_length(), key_states.shape[-2]
        if self.buffers is None or n + L > self.buffers[0].shape[-2]:
            self._grow(key_states, value_states, n + L)
        for buffer, new in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, n:n + L].copy_(new)
        self.keys, self.values = (b[:, :, :n + L] for b in self.buffers)  # (N, h, n + L, d) views
        return self.keys, self.values

    def _grow(self, key_states, value_states, need: int):
        """Buffers with room for `need` positions and more; the cached ones copied in, the old buffers dropped."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        capacity = need + max(ROOM, (need - self.base) // 2)
        n = self.get_seq_length()
        grown = []
        for old, new in ((self.keys if n else None, key_states), (self.values if n else None, value_states)):
            N, h, _, d = new.shape
            buffer = new.new_empty(N, h, capacity, d)
            if old is not None:
                buffer[:, :, :n].copy_(old)
            grown.append(buffer)
        self.buffers = tuple(grown)
        self.keys, self.values = (b[:, :, :n] for b in self.buffers)
