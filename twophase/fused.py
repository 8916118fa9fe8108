"""Custom autograd Functions that keep phase two's graph independent of the vocabulary and source sizes.

Teacher forcing with plain ops saves, per decoding step and row, the attention's tanh (S x A floats), the
per-row copy of the attention values (S x D) and the logits / log-softmax (V floats, twice). The Functions here
save only their inputs (shared, per-source or per-row H-sized tensors) and recompute the large intermediates
in backward. Their forward passes call the same helpers as the graph-free path (`energies`, `context`), so
search scores and teacher-forced log-probabilities are the same numbers.

Letters used in shape comments:
    B  sources          S  source length       N  rows (owner (N,) maps a row to its source)
    A  attention size   D  attention value size (encoder output)
    H  hidden size      V  vocabulary size     M  flattened (row, step) positions with a real target
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Logit blocks up to this size: big enough to keep the output matmuls efficient, small enough to be transient.
BLOCK_BYTES = 32 * 2**20


def sum_by_owner(x: Tensor, owner: Tensor, B: int) -> Tensor:
    """(B, ...) sums of the rows x (N, ...) of each source: the gradient of a read through owner."""
    out = x.new_zeros((B,) + x.shape[1:])
    if x.device.type == "cpu":
        # CPU index_add_ always enters a parallel region, which stalls ~60 ms when another process holds a
        # core; index_put_'s serial accumulation (what autograd of x[owner] uses) has no such cliff.
        return out.index_put_((owner,), x, accumulate=True)
    return out.index_add_(0, owner, x)


def energies(q: Tensor, keys: Tensor, v: Tensor, owner: Tensor) -> Tensor:
    """e[n, s] = v . tanh(q[n] + keys[owner[n], s]): q (N, A), keys (B, S, A), v (1, A) -> (N, S)."""
    t = torch.tanh(q[:, None, :] + keys.index_select(0, owner))  # (N, S, A), transient
    return F.linear(t, v).squeeze(-1)


def context(alpha: Tensor, memory: Tensor, owner: Tensor) -> Tensor:
    """sum_s alpha[n, s] memory[owner[n], s]: alpha (N, S), memory (B, S, D) -> (N, D)."""
    return torch.bmm(alpha[:, None, :], memory.index_select(0, owner)).squeeze(1)


class AttentionEnergies(torch.autograd.Function):
    """`energies` saving q, keys, v and owner instead of the (N, S, A) tanh, which backward recomputes."""

    @staticmethod
    def forward(ctx, q: Tensor, keys: Tensor, v: Tensor, owner: Tensor) -> Tensor:
        ctx.save_for_backward(q, keys, v, owner)
        return energies(q, keys, v, owner)

    @staticmethod
    def backward(ctx, g: Tensor):
        q, keys, v, owner = ctx.saved_tensors
        t = torch.tanh(q[:, None, :] + keys.index_select(0, owner))  # (N, S, A)
        dq = dkeys = dv = None
        if ctx.needs_input_grad[2]:
            dv = torch.einsum("ns,nsa->a", g, t)[None, :]  # (1, A), before t is overwritten
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # d e / d(q + key) = v * (1 - t^2), weighted by the incoming g (N, S); in place, t is ours
            dpre = t.square_().neg_().add_(1).mul_(v[0]).mul_(g[:, :, None])  # (N, S, A)
            if ctx.needs_input_grad[0]:
                dq = dpre.sum(dim=1)  # (N, A)
            if ctx.needs_input_grad[1]:
                dkeys = sum_by_owner(dpre, owner, keys.shape[0])  # (B, S, A)
        return dq, dkeys, dv, None


class AttentionContext(torch.autograd.Function):
    """`context` saving alpha (N, S) and the shared memory (B, S, D) instead of a per-row (N, S, D) copy."""

    @staticmethod
    def forward(ctx, alpha: Tensor, memory: Tensor, owner: Tensor) -> Tensor:
        ctx.save_for_backward(alpha, memory, owner)
        return context(alpha, memory, owner)

    @staticmethod
    def backward(ctx, g: Tensor):
        alpha, memory, owner = ctx.saved_tensors
        dalpha = dmemory = None
        if ctx.needs_input_grad[0]:
            values = memory.index_select(0, owner)  # (N, S, D), transient
            dalpha = torch.bmm(values, g[:, :, None]).squeeze(-1)  # (N, S)
        if ctx.needs_input_grad[1]:
            outer = alpha[:, :, None] * g[:, None, :]  # (N, S, D): row n's gradient for its source's values
            dmemory = sum_by_owner(outer, owner, memory.shape[0])  # (B, S, D)
        return dalpha, dmemory, None


def _block_rows(M: int, V: int, dtype: torch.dtype) -> int:
    """Rows per logit block: as many as fit in BLOCK_BYTES, at least one."""
    itemsize = (torch.finfo(dtype).bits + 7) // 8
    return max(1, min(M, BLOCK_BYTES // max(1, V * itemsize)))


def logits(h: Tensor, weight: Tensor, bias: Tensor, banned: Tensor) -> Tensor:
    """(..., V) logits at h (..., H), banned tokens at -inf, as both search and scoring normalise them. The ban
    rides in the bias (-inf + finite = -inf): one (V,) fill instead of a pass over the whole (..., V)."""
    return F.linear(h, weight, bias.masked_fill(banned, float("-inf")))


class TargetLogProbs(torch.autograd.Function):
    """log softmax(h W^T + b)[target] per row, in row blocks, never keeping an (M, V) tensor.

    Saves h (M, H), weight, bias, target (M,), banned (V,) and the per-row logsumexp (M,); backward recomputes
    each block's logits, so the graph holds nothing V-sized per row."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor, target: Tensor, banned: Tensor,
                block: int | None = None) -> Tensor:
        M, V = h.shape[0], weight.shape[0]
        block = block or _block_rows(M, V, h.dtype)
        lse = h.new_empty(M)
        picked = h.new_empty(M)
        for i in range(0, M, block):
            block_logits = logits(h[i:i + block], weight, bias, banned)  # (m, V)
            lse[i:i + block] = torch.logsumexp(block_logits, dim=1)
            picked[i:i + block] = block_logits.gather(1, target[i:i + block, None]).squeeze(1)
        ctx.block = block
        ctx.save_for_backward(h, weight, bias, target, banned, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, g: Tensor):
        h, weight, bias, target, banned, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros_like(bias) if need_b else None
        for i in range(0, h.shape[0], ctx.block):
            rows = slice(i, i + ctx.block)
            # d log p(target) / d logits = onehot(target) - softmax; softmax recomputed from the saved lse
            dlogits = logits(h[rows], weight, bias, banned).sub_(lse[rows, None]).exp_().neg_()  # (m, V)
            dlogits.scatter_add_(1, target[rows, None], torch.ones_like(dlogits[:, :1]))
            dlogits.masked_fill_(banned, 0.0)  # as masked_fill's backward: banned logits are constants
            dlogits.mul_(g[rows, None])
            if need_h:
                dh[rows] = dlogits @ weight  # (m, H)
            if need_w:
                dw.addmm_(dlogits.t(), h[rows])  # (V, H)
            if need_b:
                db += dlogits.sum(dim=0)
        return dh, dw, db, None, None, None


def target_log_probs(h: Tensor, weight: Tensor, bias: Tensor, target: Tensor, banned: Tensor,
                     block: int | None = None) -> Tensor:
    """(M,) log-probabilities of target (M,) under the output layer (weight (V, H), bias (V,)) at h (M, H)."""
    return TargetLogProbs.apply(h, weight, bias, target, banned, block)
