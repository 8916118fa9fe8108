"""The row layout both searches decode in, remembered by the tensor that holds it.

Beam search and sampling decode N = B*K rows, K per source in order: owner = arange(B).repeat_interleave(K). A
model may use that layout (the Hugging Face wrappers fold each source's K rows into one attention call), but
checking that a given owner has it means reading the tensor, and on an accelerator every read makes the host
wait for the device, at every step. So the searches make their owner here (`repeated`), which remembers it, and
a model's step asks first (`known_blocks`: K per source of all B; `known_runs`: G per source of a range of
sources): an answer without a read for the search's own tensors (beam search's compacted steps `remember`
theirs, whose layout the host knows from its counts).

Letters: B sources, K rows per source; runs (b0, nb, G): sources b0 .. b0 + nb - 1, G rows each.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

_KNOWN: dict[int, tuple[weakref.ref, tuple | None]] = {}  # id(owner) -> (the tensor, its runs), while it lives


def repeated(B: int, K: int, device) -> Tensor:
    """(B*K,) arange(B) with each source repeated K times, remembered as such (never write into it)."""
    return remember(torch.arange(B, device=device).repeat_interleave(K), (0, B, K))


def remember(owner: Tensor, runs: tuple[int, int, int] | None) -> Tensor:
    """owner, remembered as its maker knows it without reading it (never write into it afterwards): runs
    (b0, nb, G) where it is arange(b0, b0 + nb) with each source repeated G times, None where it is not."""
    key = id(owner)
    _KNOWN[key] = (weakref.ref(owner, lambda _, key=key: _KNOWN.pop(key, None)), runs)
    return owner


def known_runs(owner: Tensor):
    """(b0, nb, G) or None as `remember` was told; UNKNOWN for a tensor it was not told of (the caller reads it)."""
    entry = _KNOWN.get(id(owner))
    if entry is None or entry[0]() is not owner:
        return UNKNOWN
    return entry[1]


def known_blocks(owner: Tensor, B: int) -> int | None:
    """K where owner is known to be K rows per source of all B sources in order, 0 where it is known not to be;
    None where it is not known (the caller reads it)."""
    runs = known_runs(owner)
    if runs is UNKNOWN:
        return None
    return runs[2] if runs is not None and runs[:2] == (0, B) else 0


UNKNOWN = object()
