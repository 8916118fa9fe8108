"""A Karel program synthesiser after Bunel et al. (2018): a CNN reads each (input, output) grid pair of the
specification, the pairs' embeddings are max-pooled into one specification vector, and an LSTM writes the
program token by token, reading that vector at every step (and starting from a state computed from it).

The source is a float tensor (B, P, 32, R, C): for each of P pairs, the 16 channels of the input world
(`World.to_array`: hero facing N/E/S/W, wall, 0..10 markers) then the 16 of the output world. Max-pooling over
pairs makes the model indifferent to their order and count.

Letters: B sources, P pairs per source, F = 32 input channels, R x C grid, H hidden size (also the specification
vector's), E token embedding size, N decoder rows, T target length, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..protocol import target_mask, teacher_forced_inputs
from ..vocab import BOS, EOS, PAD

IN_CHANNELS = 32  # two worlds of 16 channels each


class KarelDecoding:
    """What both Karel models share (this one and `karel_paper.KarelPaperModel`): PAD and BOS banned from the
    output, the log-softmax search sums, `step` as `advance` then `log_probs`, and teacher forcing read from the
    model's one-pass `position_log_probs` (N, T, V) (which `twophase.constraints` also renormalises)."""

    def _ban_specials(self, vocab_size: int) -> None:
        # PAD and BOS are never generated: probability zero keeps search and scoring consistent.
        banned = torch.zeros(vocab_size, dtype=torch.bool)
        banned[[PAD, BOS]] = True
        self.register_buffer("banned", banned, persistent=False)

    def _log_softmax(self, logits: Tensor) -> Tensor:
        # Normalised in at least float32 under autocast, as search sums the scores.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.log_softmax(logits.masked_fill(self.banned, float("-inf")), dim=-1)

    def step(self, enc: dict, owner: Tensor, prev: Tensor, state):
        state = self.advance(enc, owner, prev, state)
        return state, self.log_probs(state)

    def score(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N,) log p(tokens[i] | source owner[i]) of rows tokens (N, T): tokens, EOS, PAD..., with gradients."""
        return self.token_scores(enc, tokens, owner).sum(1)

    def token_scores(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N, T) the per-token log-probabilities `score` sums, 0 past each row's end."""
        log_p = self.position_log_probs(enc, tokens, owner)  # (N, T, V)
        tok = log_p.gather(2, tokens[:, :, None]).squeeze(2)  # (N, T)
        mask = target_mask(tokens, self.pad_id, self.eos_id)
        # where, not a product: a PAD position gathers -inf, and -inf * 0 is NaN
        return torch.where(mask, tok, torch.zeros_like(tok))


class KarelModel(KarelDecoding, nn.Module):
    """A `twophase.SequenceModel` from specification grids to program tokens (see the module docstring), with
    `advance`/`log_probs` for search and a one-pass `score` (one nn.LSTM call over the whole target) for phase
    two; `step` runs the same nn.LSTM one position at a time, so both compute the same function."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, vocab_size: int, rows: int, cols: int, embed_dim: int = 64, hidden_size: int = 256,
                 channels: tuple[int, int] = (32, 64), dropout: float = 0.0):
        super().__init__()
        H, E = hidden_size, embed_dim
        c1, c2 = channels
        self.config = dict(vocab_size=vocab_size, rows=rows, cols=cols, embed_dim=E, hidden_size=H,
                           channels=tuple(channels), dropout=dropout)
        self.conv1 = nn.Conv2d(IN_CHANNELS, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.conv3 = nn.Conv2d(c2, c2, 3, padding=1)  # residual: a deeper view without a harder optimisation
        # Flattened, not globally pooled: where the hero stands relative to walls and markers is the signal.
        self.pair_fc = nn.Linear(c2 * rows * cols, H)
        self.init_fc = nn.Linear(H, 2 * H)
        self.embed = nn.Embedding(vocab_size, E)
        self.lstm = nn.LSTM(E + H, H, batch_first=True)
        self.out = nn.Linear(H, vocab_size)
        self.drop = nn.Dropout(dropout)
        self._ban_specials(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self.out.out_features

    # ---------------------------------------------------------------- specification side
    def encode(self, source: Tensor) -> dict:
        """{"spec": (B, H) pooled specification vectors, "h0", "c0": (B, H) initial decoder state}."""
        B, P = source.shape[:2]
        x = source.flatten(0, 1).to(self.conv1.weight.dtype)  # (B*P, F, R, C)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(x + self.conv3(x))
        pair = F.relu(self.pair_fc(x.flatten(1)))  # (B*P, H)
        spec = self.drop(pair.view(B, P, -1).amax(dim=1))  # (B, H): max over the pairs
        h0, c0 = self.init_fc(spec).chunk(2, dim=-1)
        return {"spec": spec, "h0": torch.tanh(h0), "c0": c0}

    # ---------------------------------------------------------------- one decoder step
    def init_state(self, enc: dict, owner: Tensor) -> tuple[Tensor, Tensor]:
        return enc["h0"][owner], enc["c0"][owner]  # (N, H) each

    def advance(self, enc: dict, owner: Tensor, prev: Tensor, state: tuple[Tensor, Tensor]):
        x = torch.cat([self.drop(self.embed(prev)), enc["spec"][owner]], dim=-1)  # (N, E + H)
        _, (h, c) = self.lstm(x[:, None], (state[0][None].contiguous(), state[1][None].contiguous()))
        return h[0], c[0]  # (N, H) each

    def log_probs(self, state: tuple[Tensor, Tensor]) -> Tensor:
        return self._log_softmax(self.out(self.drop(state[0])))  # (N, V)

    # ---------------------------------------------------------------- teacher forcing, one pass
    def position_log_probs(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N, T, V) the next-token log-probabilities at every position of rows tokens (N, T), one nn.LSTM pass."""
        N, T = tokens.shape
        prev = teacher_forced_inputs(tokens, self.bos_id)  # (N, T)
        spec = enc["spec"][owner][:, None].expand(N, T, -1)  # (N, T, H)
        x = torch.cat([self.drop(self.embed(prev)), spec], dim=-1)  # (N, T, E + H)
        h0, c0 = self.init_state(enc, owner)
        hs, _ = self.lstm(x, (h0[None].contiguous(), c0[None].contiguous()))  # (N, T, H)
        return self._log_softmax(self.out(self.drop(hs)))  # (N, T, V)
