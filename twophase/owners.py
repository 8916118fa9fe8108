"""Owner layouts known on the host: which rows come as equal runs per source, without reading `owner` back.

`owner` (N,) maps each candidate row to its source. Rows laid out as consecutive runs of G rows per source,
sources b0, b0 + 1, ... in order (a beam search's B x K rows, or one depth of a prefix tree) let attention read
each source's keys and values as broadcast views instead of per-row gathers (`twophase.models.fused`). Finding
that out from the tensor costs reads of its values, a host sync each on an accelerator, at every decoding step
that meets a new owner tensor. The code that builds an owner tensor usually knows its layout on the host
already (phase two plans its chunks there), so it `declare`s it, and `known` answers for that tensor object
without a read. A declaration lives exactly as long as the tensor object it describes.
"""
from __future__ import annotations

import weakref

from torch import Tensor

Groups = tuple  # (first source b0, rows per source G): owner == b0 + arange(N // G).repeat_interleave(G)

UNKNOWN = object()  # `known`'s answer for a tensor nobody declared
# id(owner tensor) -> its Groups or None; an entry is dropped when its tensor is freed, so an id that is reused
# by a new tensor never finds the old one's layout. Owners are index tensors nobody writes into.
_declared: dict[int, Groups | None] = {}


def declare(owner: Tensor, grp: Groups | None) -> Tensor:
    """Record that `owner` has layout grp (None: not grouped) for as long as this tensor object lives; returns
    owner. The caller vouches for grp: `of_list` on the same values on the host gives it."""
    key = id(owner)
    if key not in _declared:
        weakref.finalize(owner, _declared.pop, key, None)
    _declared[key] = grp
    return owner


def known(owner: Tensor):
    """The declared layout of this tensor object (Groups or None), or `UNKNOWN` where none was declared."""
    return _declared.get(id(owner), UNKNOWN)


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
