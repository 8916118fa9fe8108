"""The seed-style baseline, for the benchmark only: the code users post today.

`SeedStyleSeq2Seq` has `Seq2Seq`'s parameters (load its state dict), but the attention recomputes `U y` for every
beam at every step over a per-beam copy of the encoder outputs, with plain autograd ops throughout.

Letters used in shape comments:
    N  candidate rows    S  source length    H  hidden size    A  attention size (= H)    D  encoder output size
"""
from __future__ import annotations

import torch
from torch import Tensor

from twophase.models.seq2seq import Encoded, Seq2Seq


def seed_style_advance(model: Seq2Seq, beam_memory: tuple[Tensor, Tensor], prev: Tensor, state):
    """One decoder state update written the usual way. beam_memory = (matrix (N, S, D), pad (N, S)): the encoder
    outputs and padding mask copied once per beam. Returns the new state (h, c); the output layer and
    log-softmax are `Seq2Seq.log_probs`, the plain ops user code has too."""
    matrix, pad = beam_memory
    h, c = state
    U, W, v = model.attn_U, model.attn_W.weight, model.attn_v.weight  # (A, D) Linear with bias, (A, H), (1, A)
    # U y recomputed for every beam at every step: the graph saves an (N, S, A) tanh per step.
    pre = h.matmul(W.t()).unsqueeze(1) + U(matrix)  # (N, S, A)
    energy = torch.tanh(pre).matmul(v.t()).squeeze(-1).masked_fill(pad, float("-inf"))  # (N, S)
    alpha = torch.softmax(energy, dim=-1)  # (N, S)
    ctx = torch.bmm(alpha.unsqueeze(1), matrix).squeeze(1)  # (N, D)
    x = torch.cat([model.drop(model.tgt_embed(prev)), ctx], dim=-1)  # (N, E + D)
    return model.cell(x, (h, c))


class SeedStyleSeq2Seq(Seq2Seq):
    """`Seq2Seq`'s parameters with `seed_style_advance` as its state update (`advance`, which `step` and both
    search loops call), so the loops of `twophase.phase1.search` run it unchanged. `init_state` makes the per-beam copy
    of the encoder outputs, once per search, as user code does before its loop; `advance` reuses it while the
    search's owner tensor is the one it was made for."""

    @classmethod
    def from_model(cls, model: Seq2Seq) -> "SeedStyleSeq2Seq":
        seed = cls(**model.config)
        ref = next(model.parameters())
        seed.to(device=ref.device, dtype=ref.dtype).load_state_dict(model.state_dict())
        return seed.train(model.training)

    def init_state(self, enc: Encoded, owner: Tensor):
        # Expanded per beam (a copy, as `repeat`/`expand().reshape` give): what the step's U y runs over.
        self._beam_memory = (owner, enc.memory.index_select(0, owner), ~enc.mask.index_select(0, owner))
        return super().init_state(enc, owner)

    def advance(self, enc: Encoded, owner: Tensor, prev: Tensor, state):
        cached = getattr(self, "_beam_memory", None)
        if cached is None or cached[0] is not owner or cached[1].shape[0] != len(owner):
            self._beam_memory = cached = (owner, enc.memory.index_select(0, owner), ~enc.mask.index_select(0, owner))
        return seed_style_advance(self, cached[1:], prev, state)

    def release(self) -> None:
        """Drop the per-beam copy (and the graph it belongs to) once the search is back-propagated."""
        self._beam_memory = None
