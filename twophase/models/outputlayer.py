"""The output layer (projection, log-softmax, the target's log-probability) without a V-sized graph.

Teacher forcing with plain ops saves the logits and the log-softmax (V floats each) per decoding step and row.
`TargetLogProbs` saves the hidden states and each row's logsumexp and recomputes a block of logits at a time in
backward; `target_log_probs_and_grads` is its forward and backward in one pass, for phase two, which knows the
incoming gradient (the coefficients) before it decodes; `backward_from_hidden` adds the rest of the model's
backward to it (the LSTM's and the Hugging Face wrappers' phase two). Search normalises the same `logits`, so
phase one's scores are phase two's log-probabilities. Under autocast the matmuls run in its dtype and every normalisation
and sum in float32 (`sum_dtype`).

Letters used in shape comments:
    H  hidden size      V  vocabulary size     M  flattened (row, step) positions with a real target
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import blocks
from . import fused
from .fused import amp_backward, amp_forward


def sum_dtype(weight: Tensor) -> torch.dtype:
    """Where log-softmax, logsumexp and gradient sums are computed: the parameters' dtype, at least float32, so
    autocast's bf16/fp16 logits are normalised (and log-probabilities summed) in float32."""
    return torch.promote_types(weight.dtype, torch.float32)


def _matmul_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype of the output layer's big matmuls: autocast's on h's device when it is on there (float64 is
    left alone, as autocast leaves it), the weight's own otherwise."""
    kind = h.device.type
    if torch.is_autocast_enabled(kind) and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(kind)
    return weight.dtype


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with the product in a's dtype. addmm_ needs one dtype, so a low-precision (autocast) product
    goes through one temporary, summed into the float32 accumulator; same dtypes stay in place."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def _block_rows(M: int, V: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per logit block: as many as fit in a block on `device` (fused.BLOCK_BYTES on the CPU, larger on an
    accelerator: `blocks.block_bytes`), at least one."""
    itemsize = (torch.finfo(dtype).bits + 7) // 8
    return max(1, min(M, blocks.block_bytes(device, fused.BLOCK_BYTES) // max(1, V * itemsize)))


def logits(h: Tensor, weight: Tensor, bias: Tensor, banned: Tensor) -> Tensor:
    """(..., V) logits at h (..., H), banned tokens at -inf, as both search and scoring normalise them. The ban
    rides in the bias (-inf + finite = -inf): one (V,) fill instead of a pass over the whole (..., V)."""
    return F.linear(h, weight, bias.masked_fill(banned, float("-inf")))


class TargetLogProbs(torch.autograd.Function):
    """log softmax(h W^T + b)[target] per row, in row blocks, never keeping an (M, V) tensor.

    Saves h (M, H), weight, bias, target (M,), banned (V,) and the per-row logsumexp (M,); backward recomputes
    each block's logits, so the graph holds nothing V-sized per row."""

    @staticmethod
    @amp_forward
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor, target: Tensor, banned: Tensor,
                block: int | None = None) -> Tensor:
        M, V = h.shape[0], weight.shape[0]
        acc, mm = sum_dtype(weight), _matmul_dtype(h, weight)
        hm, wm = h.to(mm), weight.to(mm)
        block = block or _block_rows(M, V, acc, h.device)
        lse = h.new_empty(M, dtype=acc)
        picked = h.new_empty(M, dtype=acc)
        for i in range(0, M, block):
            # the matmul in autocast's dtype, as search computes the logits; normalised in at least float32
            block_logits = logits(hm[i:i + block], wm, bias, banned).to(acc)  # (m, V)
            lse[i:i + block] = torch.logsumexp(block_logits, dim=1)
            picked[i:i + block] = block_logits.gather(1, target[i:i + block, None]).squeeze(1)
            del block_logits  # freed before the next block's are made
        ctx.block = block
        ctx.save_for_backward(h, weight, bias, target, banned, lse)
        return picked - lse

    @staticmethod
    @amp_backward
    def backward(ctx, g: Tensor):
        h, weight, bias, target, banned, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        mm = _matmul_dtype(h, weight)  # backward runs in forward's autocast state (amp_backward)
        hm, wm = h.to(mm), weight.to(mm)
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros_like(bias) if need_b else None
        for i in range(0, h.shape[0], ctx.block):
            rows = slice(i, i + ctx.block)
            # d log p(target) / d logits = onehot(target) - softmax; softmax recomputed from the saved lse
            dlogits = logits(hm[rows], wm, bias, banned).to(lse.dtype)  # (m, V)
            dlogits.sub_(lse[rows, None]).exp_().neg_()
            dlogits.scatter_add_(1, target[rows, None], torch.ones_like(dlogits[:, :1]))
            dlogits.masked_fill_(banned, 0.0)  # as masked_fill's backward: banned logits are constants
            dlogits.mul_(g[rows, None])
            if need_b:
                db += dlogits.sum(dim=0)
            dlogits = dlogits.to(mm)
            if need_h:
                dh[rows] = dlogits @ wm  # (m, H)
            if need_w:
                _add_product(dw, dlogits.t(), hm[rows])  # (V, H)
            del dlogits  # freed before the next block's are made
        return dh, dw, db, None, None, None


def target_log_probs(h: Tensor, weight: Tensor, bias: Tensor, target: Tensor, banned: Tensor,
                     block: int | None = None) -> Tensor:
    """(M,) log-probabilities of target (M,) under the output layer (weight (V, H), bias (V,)) at h (M, H)."""
    return TargetLogProbs.apply(h, weight, bias, target, banned, block)


def target_log_probs_and_grads(h: Tensor, weight: Tensor, bias: Tensor, target: Tensor, banned: Tensor,
                               w: Tensor, block: int | None = None, dw: Tensor | None = None,
                               db: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`target_log_probs` and, in the same pass over the logits, the gradients of sum_m w[m] log p(target[m]).

    Returns (log p (M,), d/dh (M, H), d/dweight (V, H), d/dbias (V,)), the numbers TargetLogProbs' forward and
    backward give for an incoming gradient w, without autograd. Phase two knows w (the coefficients) before it
    decodes, so it needs each logit block once, where forward-then-backward computes it twice. Given dw / db,
    the weight and bias gradients are added into them (e.g. the parameters' .grad) instead of fresh tensors.
    w may also be a function of the log-probabilities (`twophase.phase2.tokenweights.PositionWeights`: a token-level
    objective), called once per block with the block's rows and log p; where it has an `entropy(rows)` (an
    entropy bonus's weights), the gradient of those weights times each row's entropy joins in the same block pass
    (one more block-sized tensor), its value handed to `w.add_loss`; where it has a `logit_gradient(rows, z)` (a
    divergence from another model's distributions, `twophase.objectives.distill`), the (m, V) gradient it
    returns for the block's logits z joins the block's, its value added by w itself."""
    M, V = h.shape[0], weight.shape[0]
    # Under autocast the three matmuls run in its dtype; logsumexp, softmax, log p and dw / db in float32.
    acc, mm = sum_dtype(weight), _matmul_dtype(h, weight)
    dynamic = callable(w)  # each block's weights from its log-probabilities
    # an entropy bonus's weights per entry (`PositionWeights.entropy`): its gradient in the same block pass
    entropy = getattr(w, "entropy", None) if dynamic else None
    # a divergence's gradient with respect to each block's logits (`PositionWeights.logit_gradient`)
    divergence = getattr(w, "logit_gradient", None) if dynamic else None
    hm, wm = h.to(mm), weight.to(mm)
    if not dynamic:
        w = w.to(acc)
    block = block or _block_rows(M, V, acc, h.device)
    tok, dh = h.new_empty(M, dtype=acc), torch.empty_like(h)
    dw = torch.zeros_like(weight) if dw is None else dw
    db = torch.zeros_like(bias) if db is None else db
    # A banned target has log p = -inf and, as in TargetLogProbs, no gradient: its one-hot term is dropped.
    w_target = None if dynamic else w.masked_fill(banned[target], 0.0)
    for i in range(0, M, block):
        rows = slice(i, i + block)
        z = logits(hm[rows], wm, bias, banned).to(acc)  # (m, V)
        lse = torch.logsumexp(z, dim=1)  # (m,)
        tok[rows] = z.gather(1, target[rows, None]).squeeze(1) - lse
        ew = extra = None
        if divergence is not None:  # before z is normalised in place below
            extra = divergence(rows, z)  # (m, V) or None
        if dynamic:
            w_rows = w(rows, tok[rows]).to(acc)  # (m,)
            w_tgt = w_rows.masked_fill(banned[target[rows]], 0.0)
            ew = entropy(rows) if entropy is not None else None
        else:
            w_rows, w_tgt = w[rows], w_target[rows]
        if ew is None:
            # w * (onehot(target) - softmax), in place over the block; banned columns have softmax exactly 0
            dz = z.sub_(lse[:, None]).exp_().mul_(-w_rows[:, None])
        else:
            # + ew * H, H = -sum p log p: d/dz = w (onehot - p) - ew p (log p + H); banned columns: p = 0, log p
            # set to 0 so that no -inf meets a 0. One more (m, V) block (p) beside z.
            ew = ew.to(acc)
            logp = z.sub_(lse[:, None]).masked_fill_(banned, 0.0)  # (m, V)
            p = logp.exp().masked_fill_(banned, 0.0)  # (m, V)
            H = -(p * logp).sum(dim=1)  # (m,)
            w.add_loss((ew * H).sum())
            if hasattr(w, "add_entropy"):  # adaptive entropy control's measured sum, on the device
                w.add_entropy(rows, H)
            dz = logp.add_(H[:, None]).mul_(ew[:, None]).add_(w_rows[:, None]).mul_(p).neg_()
            del logp, p  # (dz is logp's block, in z's)
        dz.scatter_add_(1, target[rows, None], w_tgt[:, None])
        if extra is not None:
            dz.add_(extra)
        del extra  # (m, V): freed before the matmuls
        db += dz.sum(dim=0)
        dz = dz.to(mm)
        dh[rows] = dz @ wm  # (m, H)
        _add_product(dw, dz.t(), hm[rows])  # (V, H)
        # this block's (m, V) tensors go now, not when the next block's replace them: one block's set at a time
        del z, dz
    return tok, dh, dw, db


@dataclass
class HeadStates:
    """A model's output layer and its inputs at every position of N teacher-forced rows, without a graph: what
    another model's divergence from these distributions reads a block of logits at a time (`logits`), never the
    (N, T, V) logits themselves."""

    hidden: Tensor  # (N, T, H): 0 where a row scores nothing
    weight: Tensor  # (V, H)
    bias: Tensor  # (V,)
    banned: Tensor  # (V,) bool

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def logits(self, row: Tensor, col: Tensor) -> Tensor:
        """(m, V) the logits at positions (row (m,), col (m,)), banned tokens at -inf."""
        return logits(self.hidden[row, col].to(self.weight.dtype), self.weight, self.bias, self.banned)


def grad_buffer(x: Tensor) -> Tensor:
    """x.grad, created as zeros if it does not exist yet: a buffer to accumulate into."""
    if x.grad is None:
        x.grad = torch.zeros_like(x)
    return x.grad


def backward_from_hidden(h: Tensor, weight: Tensor, bias: Tensor, target: Tensor, banned: Tensor, w: Tensor,
                         inputs: list, collect: bool, late=None) -> tuple[Tensor, list]:
    """log p(target) at h (M,) and the gradients of sum_m w[m] log p_m with respect to inputs: the output layer's
    by hand (`target_log_probs_and_grads`), the rest back-propagated from h. Without collect the gradients are
    added into .grad and the returned list is empty. `late()` (optional) gives (parameter, gradient) pairs known
    only once that backward ran (the LSTM's deferred weights). The weight may also be an input embedding (tied):
    h's backward adds the embedding's share to the same gradient."""
    with torch.no_grad():
        into = [None if collect or not p.requires_grad else grad_buffer(p) for p in (weight, bias)]
        tok, dh, dweight, dbias = target_log_probs_and_grads(h, weight, bias, target, banned, w, dw=into[0],
                                                             db=into[1])
    if not collect:
        if h.requires_grad:
            torch.autograd.backward(h, dh, inputs=inputs)
        with torch.no_grad():
            for param, extra in late() if late is not None else ():
                grad_buffer(param).add_(extra)
        return tok, []
    grads = [None] * len(inputs)
    if h.requires_grad:
        grads = list(torch.autograd.grad(h, inputs, dh, allow_unused=True))  # frees the graph
    for param, extra in [(weight, dweight), (bias, dbias)] + (late() if late is not None else []):
        for j, x in enumerate(inputs):
            if x is param:
                grads[j] = extra if grads[j] is None else grads[j] + extra
    return tok, grads
