"""LSTM encoder-decoder with additive attention (Bahdanau et al. 2015), the model twophase trains.

The decoder input at step t is the previous token's embedding concatenated with the attention context
computed from the previous decoder state; attention energies are `v . tanh(W h + U y)` with the source padding
masked. `U y` (the keys) depends only on the source, so it is computed once per source in `encode` and every
candidate row reaches it through `owner`, an index into the batch of sources: never a per-beam copy.

Letters used in shape comments:
    B  sources in the batch          S  source length
    N  candidate rows (any number per source; `owner` (N,) maps a row to its source)
    T  target length                 E  embedding size
    H  decoder hidden size           D  encoder output size (H, or 2H when bidirectional)
    A  attention size (= H)          V  target vocabulary size
    M  (row, step) positions holding a real (non-PAD) target

With a graph, `attend` (`attention.additive_attention`) and `score` go through the Functions of `fused`, which
save no (N, S, A), (N, S, D) or V-sized tensor per step; without one (search) the same helpers run directly, so
the numbers agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..phase2 import tokenweights
from ..vocab import BOS, EOS, PAD
from . import attention, deferred, outputlayer


@dataclass
class Encoded:
    """Everything the decoder needs from the source side; one row per source."""

    memory: Tensor  # (B, S, D) encoder outputs, the attention values
    keys: Tensor  # (B, S, A) U y, shared by every row of a source
    mask: Tensor  # (B, S) True on real source tokens
    h0: Tensor  # (B, H) initial decoder state
    c0: Tensor  # (B, H)


class Seq2Seq(nn.Module):
    """A `twophase.SequenceModel` whose source is the pair (src (B, S) right-padded with PAD, src_lengths (B,)).
    Beside the protocol's three methods it offers its fast paths: `advance`/`log_probs` (search builds V-sized
    temporaries per block) and `weighted_score_backward` (phase two's output layer differentiated by hand)."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, embed_dim: int = 256, hidden_size: int = 512,
                 dropout: float = 0.0, bidirectional: bool = False):
        super().__init__()
        H, E = hidden_size, embed_dim
        D = 2 * H if bidirectional else H
        self.config = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, embed_dim=E,
                           hidden_size=H, dropout=dropout, bidirectional=bidirectional)
        self.src_embed = nn.Embedding(src_vocab_size, E, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, E, padding_idx=PAD)
        self.encoder = nn.LSTM(E, H, batch_first=True, bidirectional=bidirectional)
        self.bridge = nn.Linear(D, H)
        self.attn_W = nn.Linear(H, H, bias=False)
        self.attn_U = nn.Linear(D, H)
        self.attn_v = nn.Linear(H, 1, bias=False)
        self.cell = nn.LSTMCell(E + D, H)
        self.out = nn.Linear(H, tgt_vocab_size)
        self.drop = nn.Dropout(dropout)
        # PAD and BOS are never generated: giving them probability zero keeps search and scoring consistent.
        banned = torch.zeros(tgt_vocab_size, dtype=torch.bool)
        banned[[PAD, BOS]] = True
        self.register_buffer("banned", banned, persistent=False)

    # ---------------------------------------------------------------- source side
    @property
    def vocab_size(self) -> int:
        return self.out.out_features

    def encode(self, source: tuple[Tensor, Tensor]) -> Encoded:
        src, src_lengths = source
        B, S = src.shape
        emb = self.drop(self.src_embed(src))  # (B, S, E)
        packed = pack_padded_sequence(emb, src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, (h_n, _) = self.encoder(packed)
        memory, _ = pad_packed_sequence(out, batch_first=True, total_length=S)  # (B, S, D)
        final = torch.cat(list(h_n), dim=-1)  # (B, D): last state of each direction
        # h0 (hence c0) in the parameters' precision, at least float32, even under autocast: phase one sums each
        # candidate's log-probabilities in h0's dtype, and on CPU the LSTM cell state then stays float32.
        h0 = torch.tanh(self.bridge(final)).to(outputlayer.sum_dtype(self.bridge.weight))  # (B, H)
        mask = torch.arange(S, device=src.device)[None, :] < src_lengths.to(src.device)[:, None]  # (B, S)
        return Encoded(memory=memory, keys=self.attn_U(memory), mask=mask, h0=h0, c0=torch.zeros_like(h0))

    # ---------------------------------------------------------------- one decoder step
    def init_state(self, enc: Encoded, owner: Tensor) -> tuple[Tensor, Tensor]:
        return enc.h0[owner], enc.c0[owner]  # (N, H) each

    def attend(self, enc: Encoded, owner: Tensor, h: Tensor) -> Tensor:
        """Context (N, D) for decoder states h (N, H); keys and values are read through owner, and with a graph
        only (N, A), (N, S) and the shared per-source tensors are saved (`attention.additive_attention`)."""
        return attention.additive_attention(self.attn_W(h), enc.keys, enc.memory, self.attn_v.weight, owner, enc.mask)

    def advance(self, enc: Encoded, owner: Tensor, prev: Tensor, state: tuple[Tensor, Tensor]):
        """Consume the previous tokens prev (N,) and return the new state (h, c), each (N, H)."""
        return self._advance_embedded(enc, owner, self.drop(self.tgt_embed(prev)), state)

    def _advance_embedded(self, enc: Encoded, owner: Tensor, emb: Tensor, state: tuple[Tensor, Tensor]):
        """`advance` from the previous tokens' embeddings emb (N, E), dropout applied."""
        ctx = self.attend(enc, owner, state[0])
        x = torch.cat([emb, ctx], dim=-1)  # (N, E + D)
        return _lstm_cell(self.cell, x, state)

    def log_probs(self, state: tuple[Tensor, Tensor]) -> Tensor:
        """Next-token log-probabilities (N, V) from decoder states (h, c), each (N, H)."""
        # the logits `score` computes
        logits = outputlayer.logits(self.drop(state[0]), self.out.weight, self.out.bias, self.banned)
        # Under autocast the logits come in bf16/fp16; normalised in float32, as phase two's logsumexp is.
        return F.log_softmax(logits.to(outputlayer.sum_dtype(self.out.weight)), dim=-1)

    def step(self, enc: Encoded, owner: Tensor, prev: Tensor, state):
        """One search step: new state and next-token log-probabilities (N, V)."""
        state = self.advance(enc, owner, prev, state)
        return state, self.log_probs(state)

    # ---------------------------------------------------------------- teacher forcing
    def decoder_states(self, enc: Encoded, tgt: Tensor, owner: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Teacher-forced states at the real (non-PAD) positions of tgt (N, T): the output layer's input h
        (M, H), dropout applied; the targets there (M,); and the row of each (M,)."""
        N, T = tgt.shape
        state = self.init_state(enc, owner)
        prev = torch.cat([torch.full((N, 1), BOS, dtype=torch.long, device=tgt.device), tgt[:, :-1]], dim=1)
        # Every step's input embedding at once: one embedding backward, not T dense (V, E) gradients to add up.
        embs = self.drop(self.tgt_embed(prev)).unbind(1)  # T x (N, E)
        hs = []
        for t in range(T):
            state = self._advance_embedded(enc, owner, embs[t], state)
            hs.append(state[0])
        # Only real targets are scored: PAD positions would cost V-sized work and contribute 0. (M is read on the
        # host: a sync per chunk.)
        valid = (tgt != PAD).reshape(-1).nonzero().squeeze(1)  # (M,) indices into the N*T positions
        h = torch.stack(hs, dim=1).reshape(N * T, -1).index_select(0, valid)  # (N, T, H) -> (N*T, H) -> (M, H)
        return self.drop(h), tgt.reshape(-1).index_select(0, valid), valid // T

    def score(self, enc: Encoded, tgt: Tensor, owner: Tensor) -> Tensor:
        """log p(tgt[i] | source owner[i]) for target rows tgt (N, T) = tokens, EOS, PAD...; returns (N,)."""
        h, target, row = self.decoder_states(enc, tgt, owner)
        tok = outputlayer.target_log_probs(h, self.out.weight, self.out.bias, target, self.banned)  # (M,)
        return tok.new_zeros(tgt.shape[0]).index_add_(0, row, tok)  # (N,): sum over each row's positions

    def token_scores(self, enc: Encoded, tgt: Tensor, owner: Tensor) -> Tensor:
        """(N, T) the per-token log-probabilities `score` sums, 0 at PAD positions."""
        N, T = tgt.shape
        h, target, _ = self.decoder_states(enc, tgt, owner)
        tok = outputlayer.target_log_probs(h, self.out.weight, self.out.bias, target, self.banned)  # (M,)
        valid = (tgt != PAD).reshape(-1).nonzero().squeeze(1)  # (M,) as decoder_states picks them
        return tok.new_zeros(N * T).index_copy(0, valid, tok).reshape(N, T)

    def head_states(self, enc: Encoded, tgt: Tensor, owner: Tensor) -> outputlayer.HeadStates:
        """The output layer and its inputs at every position of rows tgt (N, T), 0 at PAD positions: what another
        model's divergence from this one's distributions reads (`twophase.objectives.distill`)."""
        N, T = tgt.shape
        h, _, _ = self.decoder_states(enc, tgt, owner)  # (M, H)
        valid = (tgt != PAD).reshape(-1).nonzero().squeeze(1)  # (M,) as decoder_states picks them
        hidden = h.new_zeros(N * T, h.shape[1]).index_copy(0, valid, h).reshape(N, T, -1)  # (N, T, H)
        return outputlayer.HeadStates(hidden, self.out.weight, self.out.bias, self.banned)

    def sequence_log_probs(self, src: Tensor, src_lengths: Tensor, tgt: Tensor, owner: Tensor | None = None) -> Tensor:
        """(N,) log-probabilities, with grad, of target rows tgt (N, T) given src (B, S)."""
        if owner is None:
            owner = torch.arange(tgt.shape[0], device=tgt.device)
        return self.score(self.encode((src, src_lengths)), tgt, owner)

    def tree_decoder_states(self, enc: Encoded, nodes, weights: deferred.DeferredWeights | None = None) -> Tensor:
        """Teacher-forced states (M, H), dropout applied, of a `twophase.phase2.prefixtree.PrefixTree`'s nodes: depth
        t's rows are its distinct prefixes, each advanced from its parent's state by the parent's token. With
        `weights`, the LSTM cell's weight gradients are left to it (a few nodes per depth: see `deferred`)."""
        # Every node's input embedding at once: one embedding backward, as in decoder_states.
        embs = self.drop(self.tgt_embed(nodes.inputs(self.bos_id)))  # (M, E)
        hs, state = [], None
        for t in range(nodes.depth):
            here = nodes.level(t)
            owner = nodes.level_owner(t)  # (n_t,)
            if t == 0:
                state = self.init_state(enc, owner)
            else:
                parent = nodes.parent[here]  # (n_t,) into depth t - 1's nodes
                state = (state[0].index_select(0, parent), state[1].index_select(0, parent))
            if weights is None:
                state = self._advance_embedded(enc, owner, embs[here], state)
            else:
                x = torch.cat([embs[here], self.attend(enc, owner, state[0])], dim=-1)  # (n_t, E + D)
                state = _lstm_cell(self.cell, x, state, weights)
            hs.append(state[0])
        return self.drop(torch.cat(hs)) if hs else embs.new_zeros(0, self.out.in_features)

    def weighted_score_backward(self, enc: Encoded, tokens: Tensor, owner: Tensor, c: Tensor, inputs: list,
                                collect: bool):
        """Phase two's chunk (see `twophase.protocol`): sum_i c_i log p_i and its gradients with the output layer
        differentiated by hand. The coefficients are known before the decode, so
        `outputlayer.target_log_probs_and_grads` computes each logit block once (autograd would recompute it in
        backward) and the decoder's graph is back-propagated from its output h. Without collect, everything is
        added into .grad here and the returned gradient list is empty."""
        h, target, row = self.decoder_states(enc, tokens, owner)  # (M, H), (M,), (M,)
        col = (tokens != PAD).reshape(-1).nonzero().squeeze(1) % tokens.shape[1]  # (M,) as decoder_states
        # (M,) d loss / d log p of each position: its row's coefficient (or a token-level objective's, from the
        # position's log p), never rounded to a 16-bit h's dtype (fp16 loss scaling puts coefficients far above
        # fp16's range)
        w = tokenweights.weights(c, row, col, outputlayer.sum_dtype(self.out.weight))
        tok, grads = self._output_layer_backward(h, target, w, inputs, collect)
        with torch.no_grad():
            return tokenweights.loss(c, tok, row), grads

    def weighted_tree_backward(self, enc: Encoded, nodes, inputs: list, collect: bool):
        """`weighted_score_backward` over a prefix tree (`twophase.phase2.prefixtree`): every distinct prefix decoded
        once, its log-probability weighted by the summed coefficients of the rows through it. Nodes of weight
        exactly zero (a prefix every candidate of a beam objective shares) skip the output layer."""
        weights = deferred.DeferredWeights()
        h = self.tree_decoder_states(enc, nodes, weights)  # (M, H)
        w, target = nodes.weights, nodes.tokens
        if not tokenweights.is_token_level(w):  # a token-level objective's weights are known only from log p
            w = w.to(outputlayer.sum_dtype(self.out.weight))  # (M,)
            scored = (w != 0).nonzero().squeeze(1)  # its size is read on the host: the chunk's one sync
            if len(scored) < len(w):
                h, w, target = h.index_select(0, scored), w[scored], target[scored]
        tok, grads = self._output_layer_backward(h, target, w, inputs, collect, weights)
        return tokenweights.weighted_sum(w, tok), grads

    def _output_layer_backward(self, h: Tensor, target: Tensor, w: Tensor, inputs: list, collect: bool,
                               weights: deferred.DeferredWeights | None = None):
        """log p(target) at h (M,) and the gradients of sum_m w[m] log p_m with respect to inputs: the output
        layer's by hand, the rest back-propagated from h (and the `weights` backward left aside). Without collect
        they are added into .grad and the returned list is empty."""
        return outputlayer.backward_from_hidden(h, self.out.weight, self.out.bias, target, self.banned, w, inputs,
                                                collect, late=weights.gradients if weights is not None else None)


def _lstm_cell(cell: nn.LSTMCell, x: Tensor, state: tuple[Tensor, Tensor],
               weights: deferred.DeferredWeights | None = None):
    """`cell(x, state)` written out, its two weight products through `weights` where given: torch's CPU
    arithmetic, in its order (gates i, f, g, o). Every path (search, teacher forcing, the prefix tree) runs this
    one function rather than the fused `cell`: CUDA's autocast casts the fused cell's c to bf16/fp16 as well,
    while here under any device's autocast only the products do and c keeps its dtype, so search's scores are
    the log-probabilities phase two differentiates on every device."""
    h, c = state
    linear = weights.linear if weights is not None else F.linear
    gates = linear(h, cell.weight_hh, cell.bias_hh) + linear(x, cell.weight_ih, cell.bias_ih)
    i, f, g, o = gates.chunk(4, dim=1)  # (n, H) each
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c
