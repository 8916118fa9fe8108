"""Phase two's chunks, planned on the host before the first one runs.

`rescore_backward` decodes the candidate rows a chunk at a time. Where each chunk ends, how many prefix-tree nodes
it decodes and how its rows are laid out (their sources, their shared prefixes) are sizes the host needs; read
from the device per chunk, each would make the host wait for the device. So the rows' lengths, sources and (with
a tree) shared prefixes are read back once for the whole batch, and every chunk is cut from those host lists.

Letters: N rows, T the longest row.
"""
from __future__ import annotations

import bisect
import itertools

import torch

from .. import owners, protocol
from ..samples import Samples
from . import prefixtree


class ChunkPlan:
    """Where each chunk ends, and each chunk's layout, on the host: the rows' lengths and sources (and, with a
    tree, their shared prefixes) are read back once for the whole batch, so a chunk needs no size from the
    device. At most `size` rows a chunk; with a tree, rows sorted by `prefixtree.sort_rows` (so a source's shared
    prefixes fall in one chunk) and never more than size * T nodes."""

    def __init__(self, model, samples: Samples, tree: bool):
        # A row scores its `lengths` positions, but never past its first eos_id (a hand-made Samples' lengths may
        # count more). A row whose lengths stops short of that (one cut without eos_id while pad_id == eos_id,
        # see `Samples.from_completions`) would read its padding as an eos_id wherever its tokens are scored
        # alone: a chunk of rows then stops at its longest row, which must be such a row's own length.
        ends = protocol.target_mask(samples.tokens, model.pad_id, model.eos_id).sum(dim=1)  # (N,)
        lengths = torch.minimum(samples.lengths.to(ends.device), ends)  # (N,)
        self.tree, self.n = tree, len(samples)
        self.samples = Samples(samples.tokens, lengths, samples.owner, samples.scores)
        self.cut = None  # per row, whether it is cut (rows scored alone only; None: no row is)
        if tree:
            self.order = prefixtree.sort_rows(samples.tokens, samples.owner, lengths)  # (N,)
            self.samples = s = self.samples.select(self.order)
            common = prefixtree.common_prefix(s.tokens, s.owner, s.lengths)  # (N,)
            self.lengths, self.common, self.owners = torch.stack(
                [s.lengths, common, s.owner.to(s.lengths.dtype)]).tolist()
            self.T = max(self.lengths)
            self.added = list(itertools.accumulate(n - min(c, n) for n, c in zip(self.lengths, self.common)))
        else:  # one read for the three
            self.lengths, ends, self.owners = torch.stack([lengths, ends, samples.owner.to(lengths.dtype)]).tolist()
            if any(n < e for n, e in zip(self.lengths, ends)):
                self.cut = [n < e for n, e in zip(self.lengths, ends)]
        self.positions = sum(self.lengths)

    def chunk(self, start: int, size: int) -> tuple[int, int]:
        """(end, nodes) of the chunk that starts at row `start`; nodes = the positions it decodes."""
        if not self.tree:
            end = min(start + size, self.n)
            if self.cut is not None:
                end = self._uncut_end(start, end)
            return end, sum(self.lengths[start:end])
        # rows start..b have lengths[start] + added[b] - added[start] nodes; at least row `start` (<= T). At most
        # `size` rows too: a level of the tree holds up to one node per row, and a level's transients (attention
        # reads per node, say) must stay a row chunk's, so sharing saves work without raising the peak.
        limit = size * self.T - self.lengths[start] + self.added[start]
        end = min(bisect.bisect_right(self.added, limit, lo=start + 1), start + size)
        return end, self.lengths[start] + self.added[end - 1] - self.added[start]

    def _uncut_end(self, start: int, end: int) -> int:
        """The first row from `start` on (at most `end`) that would make a chunk longer than one of its cut rows:
        every cut row of a chunk must be as long as its longest row, which the chunk's width is."""
        longest, cut_length = self.lengths[start], self.lengths[start] if self.cut[start] else None
        for r in range(start + 1, end):
            longest_r = max(longest, self.lengths[r])
            if (self.cut[r] and self.lengths[r] != longest_r) or cut_length not in (None, longest_r):
                return r
            longest, cut_length = longest_r, self.lengths[r] if self.cut[r] else cut_length
        return end

    def shape(self, rows: slice) -> prefixtree.Shape:
        """The prefix tree's shape of a chunk's rows."""
        return prefixtree.shape(self.lengths[rows], self.common[rows], self.owners[rows])

    def longest(self, rows: slice) -> int:
        return max(self.lengths[rows])

    def groups(self, rows: slice) -> owners.Groups | None:
        """The layout of a chunk's rows' owners (`twophase.owners`)."""
        return owners.of_list(self.owners[rows])
