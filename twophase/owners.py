"""The row layout both searches decode in, remembered by the tensor that holds it.

Beam search and sampling decode N = B*K rows, K per source in order: owner = arange(B).repeat_interleave(K). A
model may use that layout (the Hugging Face wrappers fold each source's K rows into one attention call), but
checking that a given owner has it means reading the tensor, and on an accelerator every read makes the host
wait for the device, at every step. So the searches make their owner here (`repeated`), which remembers it, and
a model's step asks `known_blocks` first: an answer without a read for the search's own tensors (beam search's
compacted steps `remember` theirs, whose layout the host knows from its counts).

Letters: B sources, K rows per source.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

_KNOWN: dict[int, tuple[weakref.ref, int, int]] = {}  # id(owner) -> (the tensor, B, K), while it lives


def repeated(B: int, K: int, device) -> Tensor:
    """(B*K,) arange(B) with each source repeated K times, remembered as such (never write into it)."""
    return remember(torch.arange(B, device=device).repeat_interleave(K), B, K)


def remember(owner: Tensor, B: int, K: int) -> Tensor:
    """owner, remembered as K rows per source of B in order (K = 0: not that layout), as its maker knows without
    reading it (never write into it afterwards)."""
    key = id(owner)
    _KNOWN[key] = (weakref.ref(owner, lambda _, key=key: _KNOWN.pop(key, None)), B, K)
    return owner


def known_blocks(owner: Tensor, B: int) -> int | None:
    """K where owner was remembered as K rows per source of B (0: not that layout); None where it was not (the
    caller reads it)."""
    entry = _KNOWN.get(id(owner))
    if entry is None or entry[0]() is not owner or entry[1] != B:
        return None
    return entry[2]
