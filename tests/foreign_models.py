"""Models that are not the built-in LSTM, written only against `twophase.SequenceModel`: the tests run the same
exactness checks on them as on the LSTM, so nothing in the library may assume the LSTM's ids, trees or shapes.

- `FeatureDecoder`: a `torch.nn.TransformerDecoder` over a dict of float features {"feats", "mask"} (no token
  source); enc is a dict holding a float and a bool tensor; the state is the prefix of token ids, which GROWS by
  one column a step; no `score` (phase two runs `step`). `ScoredFeatureDecoder` adds a one-pass `score` and
  `position_log_probs`.
- `DigitGRU`: a GRU without attention, ids pad 5, bos 3, eos 0; the source is a plain list of int lists; enc a
  dataclass (float + long tensors); the state a dict of a float hidden and a long counter; `advance`/`log_probs`.
- `EndIsPadRNN`: an Elman RNN over a float tensor, pad_id == eos_id (GPT-2 style), enc and state bare tensors.

Broken on purpose (`twophase.check_model` must refuse it, see tests/core/test_modelcheck.py):
- `RowMixingDecoder`: a `torch.nn.TransformerEncoderLayer` left at batch_first=False run on an (N, t, H) state:
  it attends across the N rows at each position (a common real bug). Reversing the rows changes nothing, so a
  reordering test alone misses it; search then scores each row by its neighbours.

All have dropout, so a search or phase two that forgot evaluation mode would score with noise.

Letters: B sources, P feature positions, F features, N rows, t steps so far, T target length, H hidden, V vocab.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from twophase import objectives
from twophase.protocol import target_mask, teacher_forced_inputs


def _masked_log_softmax(logits: Tensor, banned: list[int]) -> Tensor:
    """log-probabilities with the ids search must never propose (pad, bos) at probability zero."""
    banned_ids = torch.tensor(banned, dtype=torch.long, device=logits.device)
    return logits.index_fill(-1, banned_ids, float("-inf")).log_softmax(-1)


def _scaled(model: nn.Module, scale: float) -> nn.Module:
    """fp64 with the initial weights times `scale`: > 1 gives peaked, varied distributions, < 1 flat ones."""
    model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


class FeatureDecoder(nn.Module):
    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, feat_dim: int = 3, vocab: int = 6, hidden: int = 8, max_len: int = 6, dropout: float = 0.3,
                 mask_specials: bool = True):
        super().__init__()
        self.feat_proj = nn.Linear(feat_dim, hidden)  # used by the encoder only
        layer = nn.TransformerDecoderLayer(hidden, nhead=2, dim_feedforward=16, dropout=dropout, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=1)
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len + 1, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.banned = [self.pad_id, self.bos_id] if mask_specials else []

    def encode(self, source: dict) -> dict:
        return {"memory": torch.tanh(self.feat_proj(source["feats"])), "pad": ~source["mask"]}  # (B, P, H), (B, P)

    def init_state(self, enc: dict, owner: Tensor) -> dict:
        return {"prefix": torch.empty(len(owner), 0, dtype=torch.long, device=owner.device)}  # (N, 0)

    def hidden(self, enc: dict, owner: Tensor, inputs: Tensor) -> Tensor:
        """(N, t, H) the decoder's output at every position of inputs (N, t), causally."""
        t = inputs.shape[1]
        x = self.embed(inputs) + self.pos.weight[:t]  # (N, t, H)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=inputs.device), diagonal=1)
        return self.decoder(x, enc["memory"][owner], tgt_mask=causal, memory_key_padding_mask=enc["pad"][owner])

    def step(self, enc: dict, owner: Tensor, prev: Tensor, state: dict):
        prefix = torch.cat([state["prefix"], prev[:, None]], dim=1)  # (N, t + 1)
        h = self.hidden(enc, owner, prefix)[:, -1]  # (N, H)
        return {"prefix": prefix}, _masked_log_softmax(self.out(h), self.banned)


class ScoredFeatureDecoder(FeatureDecoder):
    """The same function with a `score` that decodes every position in one causal pass."""

    def position_log_probs(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        h = self.hidden(enc, owner, teacher_forced_inputs(tokens, self.bos_id))  # (N, T, H)
        return _masked_log_softmax(self.out(h), self.banned)  # (N, T, V)

    def score(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        logp = self.position_log_probs(enc, tokens, owner).gather(2, tokens[..., None]).squeeze(2)  # (N, T)
        return torch.where(target_mask(tokens, self.pad_id, self.eos_id), logp, torch.zeros_like(logp)).sum(1)


@dataclass
class Summary:
    start: Tensor  # (B, H) float: the decoder's initial hidden state
    length: Tensor  # (B,) long: each source's length


class DigitGRU(nn.Module):
    pad_id, bos_id, eos_id = 5, 3, 0
    vocab_size = 7
    COUNTED = 6  # the state counts how often a row produced this token

    def __init__(self, src_vocab: int = 6, hidden: int = 12, dropout: float = 0.3, mask_specials: bool = True):
        super().__init__()
        self.src_embed = nn.Embedding(src_vocab, hidden)  # encoder only
        self.src_proj = nn.Linear(hidden, hidden)  # encoder only
        self.embed = nn.Embedding(self.vocab_size, hidden)
        self.count_embed = nn.Embedding(4, hidden)
        self.length_embed = nn.Embedding(8, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, self.vocab_size)
        self.banned = [self.pad_id, self.bos_id] if mask_specials else []

    def encode(self, source: list[list[int]]) -> Summary:
        device = self.out.weight.device
        length = torch.tensor([len(s) for s in source], device=device)  # (B,)
        src = torch.zeros(len(source), int(length.max()), dtype=torch.long, device=device)  # (B, S)
        for i, s in enumerate(source):
            src[i, :len(s)] = torch.tensor(s)
        mask = (torch.arange(src.shape[1], device=device) < length[:, None]).to(self.out.weight.dtype)  # (B, S)
        mean = (self.src_embed(src) * mask[..., None]).sum(1) / length[:, None]  # (B, H)
        return Summary(torch.tanh(self.src_proj(self.drop(mean))), length)

    def init_state(self, enc: Summary, owner: Tensor) -> dict:
        return {"h": enc.start[owner], "count": torch.zeros(len(owner), dtype=torch.long, device=owner.device)}

    def advance(self, enc: Summary, owner: Tensor, prev: Tensor, state: dict) -> dict:
        x = self.embed(prev) + self.count_embed(state["count"].clamp(max=3)) + self.length_embed(enc.length[owner])
        return {"h": self.cell(x, state["h"]), "count": state["count"] + (prev == self.COUNTED).long()}

    def log_probs(self, state: dict) -> Tensor:
        return _masked_log_softmax(self.out(self.drop(state["h"])), self.banned)

    def step(self, enc: Summary, owner: Tensor, prev: Tensor, state: dict):
        state = self.advance(enc, owner, prev, state)
        return state, self.log_probs(state)


class EndIsPadRNN(nn.Module):
    pad_id, bos_id, eos_id = 0, 1, 0

    def __init__(self, feat_dim: int = 4, vocab: int = 5, hidden: int = 10, dropout: float = 0.3):
        super().__init__()
        self.feat_proj = nn.Linear(feat_dim, hidden)  # encoder only
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.RNNCell(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, vocab)

    def encode(self, source: Tensor) -> Tensor:
        return torch.tanh(self.feat_proj(source))  # (B, H)

    def init_state(self, enc: Tensor, owner: Tensor) -> Tensor:
        return enc[owner]  # (N, H)

    def step(self, enc: Tensor, owner: Tensor, prev: Tensor, state: Tensor):
        h = self.cell(self.embed(prev), state)
        return h, _masked_log_softmax(self.out(self.drop(h)), [self.bos_id])


class RowMixingDecoder(nn.Module):
    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, feat_dim: int = 4, vocab: int = 6, hidden: int = 8, max_len: int = 6, dropout: float = 0.3):
        super().__init__()
        self.feat_proj = nn.Linear(feat_dim, hidden)  # encoder only
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len + 1, hidden)
        self.layer = nn.TransformerEncoderLayer(hidden, nhead=2, dim_feedforward=16, dropout=dropout)  # (S, B, E)
        self.out = nn.Linear(hidden, vocab)

    def encode(self, source: Tensor) -> Tensor:
        return torch.tanh(self.feat_proj(source))  # (B, H)

    def init_state(self, enc: Tensor, owner: Tensor) -> Tensor:
        return enc[owner][:, None, :]  # (N, 1, H): the source, then one embedding per token fed

    def step(self, enc: Tensor, owner: Tensor, prev: Tensor, state: Tensor):
        t = torch.full_like(prev, state.shape[1] - 1)
        state = torch.cat([state, (self.embed(prev) + self.pos(t))[:, None, :]], dim=1)  # (N, t + 1, H)
        h = self.layer(state)  # read as (S = N, B = t + 1, H): attention over the rows
        return state, _masked_log_softmax(self.out(h[:, -1]), [self.pad_id, self.bos_id])


NAMES = ("transformer", "gru", "end-is-pad")
ENCODER_ONLY = {"transformer": "feat_proj", "gru": "src_proj", "end-is-pad": "feat_proj"}


def make(name: str, scale: float = 2.0, seed: int = 0, **kwargs) -> nn.Module:
    """A tiny fp64 model, left in TRAINING mode: the library must switch dropout off itself."""
    torch.manual_seed(seed)
    cls = {"transformer": FeatureDecoder, "scored-transformer": ScoredFeatureDecoder, "gru": DigitGRU,
           "end-is-pad": EndIsPadRNN, "row-mixing": RowMixingDecoder}[name]
    return _scaled(cls(**kwargs), scale).train()


def sources(name: str, B: int = 3, seed: int = 1):
    """B sources of the model's kind, of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    if name.endswith("transformer"):
        P = 4
        mask = torch.arange(P) < torch.tensor([P - i % P for i in range(B)])[:, None]  # (B, P), >= 1 real each
        return {"feats": torch.randn(B, P, 3, generator=g, dtype=torch.float64), "mask": mask}
    if name == "gru":
        return [torch.randint(1, 6, (1 + (2 * i) % 5,), generator=g).tolist() for i in range(B)]
    return torch.randn(B, 4, generator=g, dtype=torch.float64)


def coefficients(objective: str, s, B: int) -> Tensor:
    """Coefficients of `objective` for the rows of Samples s, from seeded random rewards."""
    g = torch.Generator().manual_seed(5)
    r = torch.rand(len(s), generator=g, dtype=torch.float64)
    if objective == "mle":
        return objectives.mle(s.owner, B)
    if objective.startswith("reinforce-"):
        greedy = torch.rand(B, generator=g, dtype=torch.float64)
        return objectives.reinforce(r, s.owner, B, objective.split("-")[1], greedy_rewards=greedy)
    fn, extra = (objectives.beam, {}) if objective == "beam" else (objectives.mrt, {"alpha": 0.5})
    if "tokens" in inspect.signature(fn).parameters:  # Q over distinct candidates, where objectives has it
        extra["tokens"] = s.tokens
    return fn(r, s.scores, s.owner, B, **extra)


OBJECTIVES = ("mle", "reinforce-none", "reinforce-mean", "reinforce-loo", "reinforce-greedy", "beam", "mrt")
