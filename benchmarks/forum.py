"""The forum post's model in phase two: `examples/forum_model.py` (twophase's attention blocks) against the same
model written the obvious way, against a naive step, with sampled and with beam candidates.

    nice python benchmarks/forum.py                 # the targets' sizes (B 8, K 32, S 50, T 24, H 256, V 5k)

`ObviousForumSeq2Seq` is `ForumSeq2Seq` (load its state dict) with the attention a user writes first: every row's
keys and values copied through owner at every step, and the tanh kept for backward.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's twophase, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # forum_model

import torch  # noqa: E402

from forum_model import ForumSeq2Seq  # noqa: E402


class ObviousForumSeq2Seq(ForumSeq2Seq):
    """ForumSeq2Seq with its attention written the obvious way (the same parameters)."""

    def attend(self, enc, owner, h):
        Uy, y, mask = enc["Uy"][owner], enc["y"][owner], enc["mask"][owner]  # (N, S, H) copies, (N, S)
        energy = self.v(torch.tanh(self.W(h)[:, None, :] + Uy)).squeeze(-1)  # (N, S): the tanh kept for backward
        alpha = torch.softmax(energy.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.bmm(alpha[:, None, :], y).squeeze(1)  # (N, H)
