"""Row layouts known on the host, remembered by the tensor that holds them: which rows come as equal runs per source.

`owner` (N,) maps each candidate row to its source. Rows laid out as consecutive runs of G rows per source,
sources b0, b0 + 1, ... in order, are "grouped" (b0, G): both searches decode all their rows so (b0 = 0, G = K:
owner = arange(B).repeat_interleave(K)), and so does a chunk of them, or one depth of a prefix tree. A model may
use the layout (attention reads each source's keys and values as broadcast views, `twophase.models.fused`; the
Hugging Face wrappers fold each source's K rows into one attention call), but checking that a given owner has it
means reading the tensor, and on an accelerator every read makes the host wait for the device, at every step.
The code that makes an owner tensor usually knows its layout on the host already (a search's B and K, phase
two's plan of its chunks), so it records it here (`declare`, or `repeated` / `remember` for a search's B x K
rows), and a model asks `known` / `known_blocks` first: an answer without a read for those tensors.

A record lives exactly as long as its tensor object (never write into a recorded owner).

Letters: B sources, K (or G) rows per source, N rows.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

Groups = tuple  # (first source b0, rows per source G): owner == b0 + arange(N // G).repeat_interleave(G)

UNKNOWN = object()  # `known`'s answer for a tensor nobody recorded
# id(owner) -> (a weak reference to the tensor, its Groups or None); dropped when the tensor is freed, and the
# reference is checked, so an id reused by a new tensor never finds the old one's layout.
_KNOWN: dict[int, tuple[weakref.ref, Groups | None]] = {}


def declare(owner: Tensor, grp: Groups | None) -> Tensor:
    """owner, recorded as grouped grp (None: not grouped), as its maker knows without reading it. The caller
    vouches for grp: `of_list` of the same values on the host gives it."""
    key = id(owner)
    _KNOWN[key] = (weakref.ref(owner, lambda _, key=key: _KNOWN.pop(key, None)), grp)
    return owner


def known(owner: Tensor):
    """The recorded layout of this tensor object (Groups or None), or UNKNOWN where none was recorded."""
    entry = _KNOWN.get(id(owner))
    if entry is None or entry[0]() is not owner:
        return UNKNOWN
    return entry[1]


def repeated(B: int, K: int, device) -> Tensor:
    """(B*K,) arange(B) with each source repeated K times, recorded as such (never write into it)."""
    return remember(torch.arange(B, device=device).repeat_interleave(K), B, K)


def remember(owner: Tensor, B: int, K: int) -> Tensor:
    """owner, recorded as K rows per source of B in order (K = 0: not that layout), as its maker knows without
    reading it (never write into it afterwards)."""
    return declare(owner, (0, K) if K > 0 and owner.numel() == B * K else None)


def known_blocks(owner: Tensor, B: int) -> int | None:
    """K where owner was recorded as K rows per source of all B sources 0..B-1 in order (0: recorded, but not
    that layout); None where nothing was recorded (the caller reads it)."""
    grp = known(owner)
    if grp is UNKNOWN:
        return None
    if grp is None or grp[0] != 0 or owner.numel() != B * grp[1]:
        return 0
    return grp[1]


def of_list(owner: list[int]) -> Groups | None:
    """(b0, G) where the host list `owner` is consecutive equal runs of G per source b0, b0 + 1, ...; else None
    (also for an empty list)."""
    n = len(owner)
    if n == 0:
        return None
    b0, b1 = owner[0], owner[-1]
    nb = b1 - b0 + 1
    if nb <= 0 or n % nb:
        return None
    G = n // nb
    return (b0, G) if all(o == b0 + i // G for i, o in enumerate(owner)) else None


def of_counts(first: int, counts: list[int]) -> Groups | None:
    """The layout of rows that hold counts[j] rows of source first + j, in that order (sources with no row
    are left out); None unless the sources present are consecutive with equal counts."""
    present = [(first + j, n) for j, n in enumerate(counts) if n]
    if not present:
        return None
    (b0, G), (b1, _) = present[0], present[-1]
    if b1 - b0 + 1 != len(present) or any(n != G for _, n in present):
        return None
    return (b0, G)
