"""Bunel et al.'s Karel model (ICLR 2018; GandRL_for_NPS `IOs2Seq`): a CNN embeds each (input, output) pair, an
LSTM decoder runs once per pair, and the pairs' top-layer outputs are max-pooled at every step before the output
layer ("late pooling"): each pair proposes, the program token is what some pair argues for most strongly.

Encoder (their `IOsEncoder`): the input world and the output world each go through their own 3x3 convolution
(16 -> c/2 channels, ReLU), the two are stacked (c channels), then `blocks` residual blocks (three 3x3
convolutions of c channels, ReLU between, the block's input added before the last ReLU), flattened (where the hero
stands relative to walls and markers is the signal) and projected linearly to the pair embedding (D). Their paper
model: c = 64, 2 blocks, D = 512, on 18x18 worlds.

Decoder (their `MultiIOProgramDecoder`): an L-layer LSTM whose input at every step is the previous token's
embedding concatenated with the pair's embedding; each pair's decoder starts from the same learned initial state.
The logits are Linear(max over pairs of the top layer's output). PAD and BOS get probability zero. Max-pooling
over pairs keeps the model indifferent to their order and count.

`score` (phase two) runs one nn.LSTM call over the whole target; `advance` (search) the same nn.LSTM one position
at a time, so both compute the same function.

Letters: B sources, P pairs per source, F = 32 input channels (two worlds of 16), R x C grid, c conv channels,
D pair embedding, E token embedding, H hidden size, L LSTM layers, N decoder rows, T target length, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..protocol import teacher_forced_inputs
from ..vocab import BOS, EOS, PAD
from .karel import IN_CHANNELS, KarelDecoding

WORLD_CHANNELS = IN_CHANNELS // 2  # one world's channels: hero facing N/E/S/W, wall, 0..10 markers
# The paper's sizes (GandRL_for_NPS README: --conv_stack 64,64,64 --fc_stack 512 --tgt_embedding_size 256
# --lstm_hidden_size 256 --nb_lstm_layers 2): 12.45 M parameters on 18x18 worlds.
PAPER_SIZES = dict(embed_dim=256, hidden_size=256, channels=64, blocks=2, pair_dim=512, layers=2)


class ResBlock(nn.Module):
    """Three 3x3 convolutions of c channels, ReLU between; the input is added before the last ReLU."""

    def __init__(self, c: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.convs[0](x))
        y = F.relu(self.convs[1](y))
        return F.relu(x + self.convs[2](y))


class PairEncoder(nn.Module):
    """(B, P, F, R, C) grids -> (B, P, D) pair embeddings."""

    def __init__(self, rows: int, cols: int, channels: int, blocks: int, pair_dim: int):
        super().__init__()
        if channels % 2:
            raise ValueError(f"conv channels must be even (half from each world), got {channels}")
        self.in_conv = nn.Conv2d(WORLD_CHANNELS, channels // 2, 3, padding=1)
        self.out_conv = nn.Conv2d(WORLD_CHANNELS, channels // 2, 3, padding=1)
        self.blocks = nn.Sequential(*(ResBlock(channels) for _ in range(blocks)))
        self.fc = nn.Linear(channels * rows * cols, pair_dim)  # linear: their fc_stack of one layer

    def forward(self, grids: Tensor) -> Tensor:
        B, P = grids.shape[:2]
        x = grids.flatten(0, 1).to(self.fc.weight.dtype)  # (B*P, F, R, C)
        x = torch.cat([F.relu(self.in_conv(x[:, :WORLD_CHANNELS])),
                       F.relu(self.out_conv(x[:, WORLD_CHANNELS:]))], dim=1)  # (B*P, c, R, C)
        x = self.blocks(x)
        return self.fc(x.flatten(1)).view(B, P, -1)  # (B*P, c*R*C) -> (B, P, D)


class KarelPaperModel(KarelDecoding, nn.Module):
    """A `twophase.SequenceModel` from specification grids (B, P, F, R, C) to program tokens (see the module
    docstring). State: (h, c), each (N, P, L, H): every row's L-layer LSTM state for each of its P pairs."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, vocab_size: int, rows: int, cols: int, embed_dim: int = 256, hidden_size: int = 256,
                 channels: int = 64, blocks: int = 2, pair_dim: int = 512, layers: int = 2, dropout: float = 0.0):
        super().__init__()
        E, H, D, L = embed_dim, hidden_size, pair_dim, layers
        self.config = dict(vocab_size=vocab_size, rows=rows, cols=cols, embed_dim=E, hidden_size=H,
                           channels=channels, blocks=blocks, pair_dim=D, layers=L, dropout=dropout)
        self.encoder = PairEncoder(rows, cols, channels, blocks, D)
        self.embed = nn.Embedding(vocab_size, E)
        self.lstm = nn.LSTM(E + D, H, num_layers=L, batch_first=True)
        self.init_h = nn.Parameter(torch.empty(L, H))  # learned, shared by every pair (theirs too)
        self.init_c = nn.Parameter(torch.empty(L, H))
        self.out = nn.Linear(H, vocab_size)
        self.drop = nn.Dropout(dropout)
        # their init_weights for the initial state (uniform in +-0.1) and the output bias (zero); the embeddings keep
        # torch's N(0, 1), not their U(-0.1, 0.1): with theirs, the tokens barely reach the gates at first and 150
        # MLE steps at 2e-3 ended at 43 nats per program instead of 34 (docs/karel.md)
        for p in (self.init_h, self.init_c):
            nn.init.uniform_(p, -0.1, 0.1)
        nn.init.zeros_(self.out.bias)
        self._ban_specials(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self.out.out_features

    # ---------------------------------------------------------------- specification side
    def encode(self, source: Tensor) -> dict:
        """{"pairs": (B, P, D)}: one embedding per specification pair, read by that pair's decoder."""
        return {"pairs": self.drop(self.encoder(source))}

    # ---------------------------------------------------------------- one decoder step
    def init_state(self, enc: dict, owner: Tensor) -> tuple[Tensor, Tensor]:
        N, P = len(owner), enc["pairs"].shape[1]
        shape = (N, P) + tuple(self.init_h.shape)  # (N, P, L, H)
        return self.init_h.expand(shape), self.init_c.expand(shape)

    def advance(self, enc: dict, owner: Tensor, prev: Tensor, state: tuple[Tensor, Tensor]):
        pairs = enc["pairs"].index_select(0, owner)  # (N, P, D)
        N, P, _ = pairs.shape
        emb = self.drop(self.embed(prev))[:, None].expand(N, P, -1)  # (N, P, E): one token, every pair's decoder
        x = torch.cat([emb, pairs], dim=-1).view(N * P, 1, -1)  # (N*P, 1, E + D)
        _, (h, c) = self.lstm(x, tuple(_to_lstm(s) for s in state))
        return _from_lstm(h, N, P), _from_lstm(c, N, P)  # (N, P, L, H) each

    def log_probs(self, state: tuple[Tensor, Tensor]) -> Tensor:
        return self._log_softmax(self.out(self.drop(state[0][:, :, -1].amax(dim=1))))  # top layer, max over pairs

    # ---------------------------------------------------------------- teacher forcing, one pass
    def position_log_probs(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N, T, V) the next-token log-probabilities at every position of rows tokens (N, T): one nn.LSTM pass
        over every pair's decoder, max-pooled per position (`score` and `token_scores` read it, KarelDecoding)."""
        N, T = tokens.shape
        pairs = enc["pairs"].index_select(0, owner)  # (N, P, D)
        P = pairs.shape[1]
        emb = self.drop(self.embed(teacher_forced_inputs(tokens, self.bos_id)))  # (N, T, E)
        x = torch.cat([emb[:, None].expand(N, P, T, -1), pairs[:, :, None].expand(N, P, T, -1)], dim=-1)
        h0, c0 = (_to_lstm(s) for s in self.init_state(enc, owner))  # (L, N*P, H)
        hs, _ = self.lstm(x.view(N * P, T, -1), (h0, c0))  # (N*P, T, E + D) -> (N*P, T, H)
        pooled = hs.view(N, P, T, -1).amax(dim=1)  # (N, T, H): late pooling, at every position
        return self._log_softmax(self.out(self.drop(pooled)))  # (N, T, V)


def _to_lstm(s: Tensor) -> Tensor:
    """(N, P, L, H) -> nn.LSTM's (L, N*P, H), contiguous: cuDNN refuses any other state ("rnn: hx is not
    contiguous"), and `init_state`'s expanded state (stride 0 over rows and pairs) reshapes to a view."""
    N, P, L, H = s.shape
    return s.permute(2, 0, 1, 3).reshape(L, N * P, H).contiguous()  # a no-op after a step: the LSTM's own layout


def _from_lstm(s: Tensor, N: int, P: int) -> Tensor:
    """nn.LSTM's (L, N*P, H) -> (N, P, L, H)."""
    return s.view(s.shape[0], N, P, -1).permute(1, 2, 0, 3)
