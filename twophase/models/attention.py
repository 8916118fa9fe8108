"""Attention for your own model's `step`: additive (`v . tanh(W h + U y)`) and dot-product attention over each
source's encoder outputs, as lean in phase two as the built-in LSTM's.

    from twophase import additive_attention, dot_attention

    keys = self.U(y)                                               # in encode: (B, S, A), once per source
    ctx = additive_attention(self.W(h), keys, y, self.v.weight, owner, mask)   # in step: (N, D)
    ctx = dot_attention(self.Q(h), y, y, owner, mask)              # or: scores q . y (scale q yourself)

The obvious way, `torch.tanh(self.W(h)[:, None] + keys[owner])`, copies (N, S, A) keys and (N, S, D) values per
row at every step, and autograd keeps the tanh and the copied values for backward: in phase two, where each
step's graph lives until the chunk's backward, that is 3 x (N, S, H) floats per step. These blocks read each
source's keys and values once for all its rows (as broadcast views where the rows come as equal runs per
source, which phase one and phase two record in `twophase.owners`; through a transient gather otherwise), and
keep for backward only their inputs and the (N, S) attention weights: the tanh is recomputed in backward
(`fused.AttentionEnergies`). Without a graph (search) they run the same helpers directly, so search's scores
and phase two's log-probabilities are the same numbers.

Your model keeps its own parameters: the blocks take the query (your W h), the keys (your U y, computed once in
`encode`), the values and v as tensors.

Letters: B sources, S source length, N rows (owner (N,) maps a row to its source), A attention size,
D value size.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import fused


def additive_attention(query: Tensor, keys: Tensor, values: Tensor, v: Tensor, owner: Tensor,
                       mask: Tensor | None = None) -> Tensor:
    """(N, D) sum_s alpha[n, s] values[owner[n], s], alpha = softmax_s(v . tanh(query[n] + keys[owner[n], s]))
    over the real tokens: query (N, A) (W h), keys (B, S, A) (U y), values (B, S, D), v (1, A) or (A,),
    owner (N,), mask (B, S) True on real source tokens (None: all real)."""
    v = v.reshape(1, -1)  # (1, A): an nn.Linear(A, 1)'s weight or a vector, as a view (its gradient flows back)
    grp = fused.groups(owner)  # read once per owner tensor; phase one and two record theirs (no read)
    if _recording(query, keys, values, v):
        energy = fused.AttentionEnergies.apply(query, keys, v, owner, grp)  # saves no (N, S, A)
    else:
        energy = fused.energies(query, keys, v, owner, grp)
    return _context(_masked(energy, mask, owner), values, owner, grp)


def dot_attention(query: Tensor, keys: Tensor, values: Tensor, owner: Tensor, mask: Tensor | None = None) -> Tensor:
    """(N, D) sum_s alpha[n, s] values[owner[n], s], alpha = softmax_s(query[n] . keys[owner[n], s]) over the
    real tokens: query (N, A), keys (B, S, A), values (B, S, D) (keys may be values), owner (N,), mask (B, S)
    True on real source tokens (None: all real). Scale the query yourself for scaled dot-product attention."""
    grp = fused.groups(owner)
    # q . keys[owner[n], s] is the context of "weights" q over keys read as (B, A, S): one Function for both
    # products, saving q and the shared keys, never a per-row (N, A, S) copy
    keys_t = keys.transpose(1, 2)  # (B, A, S), a view
    if _recording(query, keys):
        energy = fused.AttentionContext.apply(query, keys_t, owner, grp)  # (N, S)
    else:
        energy = fused.context(query, keys_t, owner, grp)
    return _context(_masked(energy, mask, owner), values, owner, grp)


def mask_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, S) 0 on real source tokens, -inf on padding: added to the energies, it saves nothing for backward
    (masked_fill would keep an (N, S) mask per step)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _masked(energy: Tensor, mask: Tensor | None, owner: Tensor) -> Tensor:
    """(N, S) attention weights: the energies' softmax over each row's real source tokens."""
    if mask is not None:
        energy = energy + mask_bias(mask, energy.dtype).index_select(0, owner)
    return torch.softmax(energy, dim=-1)


def _context(alpha: Tensor, values: Tensor, owner: Tensor, grp) -> Tensor:
    """(N, D) the weighted sum of each row's source's values, saving alpha and the shared values only."""
    if _recording(alpha, values):
        return fused.AttentionContext.apply(alpha, values, owner, grp)
    return fused.context(alpha, values, owner, grp)


def _recording(*tensors: Tensor) -> bool:
    """Whether autograd will build a graph through an op on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
