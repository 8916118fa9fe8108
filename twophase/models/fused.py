"""Custom autograd Functions that keep phase two's attention graph independent of the source size.

Teacher forcing with plain ops saves, per decoding step and row, the attention's tanh (S x A floats) and a
per-row copy of the attention values (S x D). The Functions here save only their inputs (shared per-source or
per-row H-sized tensors) and recompute the large intermediates in backward. Their forward passes call the same
helpers as the graph-free path (`energies`, `context`), so search scores and teacher-forced log-probabilities
are the same numbers. The output layer's counterpart is `twophase.outputlayer`.

Letters used in shape comments:
    B  sources          S  source length       N  rows (owner (N,) maps a row to its source)
    A  attention size   D  attention value size (encoder output)   H  hidden size
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import blocks, owners

# Logit (and attention tanh) blocks on the CPU up to this size (on an accelerator `blocks.block_bytes` makes them
# larger): big enough to keep the matmuls efficient, small enough to
# be transient: 8 MB blocks cost no time against larger ones and lower the tensor peak (docs/results/).
BLOCK_BYTES = 8 * 2**20


Groups = owners.Groups  # (first source b0, rows per source G)


def groups(owner: Tensor) -> Groups | None:
    """(b0, G) when the rows come as consecutive runs of G rows per source, sources b0, b0 + 1, ... in order (a
    beam search's B x K layout, or a chunk of it); None for any other owner. Grouped rows read their sources'
    keys and values as broadcast views (and their gradients are plain sums and matmuls) instead of per-row
    gathers and scatter-adds. None while torch.compile traces (`twophase.compiled`): the general path, the
    same numbers, needs no host read of owner, so the step stays one graph and the compiler fuses its gathers.

    A layout `owners.declare`d for this tensor (phase two's chunks, planned on the host) is taken as it is;
    otherwise owner is read (three host syncs on an accelerator) and the answer kept for this tensor object,
    so a search that passes the same owner at every step reads it once."""
    if torch.compiler.is_compiling():
        return None
    found = owners.known(owner)
    if found is not owners.UNKNOWN:
        return found
    found = None
    n = owner.numel()
    if n and owner.dim() == 1:
        b0, b1 = int(owner[0]), int(owner[-1])
        nb = b1 - b0 + 1
        if nb > 0 and n % nb == 0:
            expect = torch.arange(b0, b1 + 1, device=owner.device).repeat_interleave(n // nb)
            found = (b0, n // nb) if torch.equal(owner, expect) else None
    owners.declare(owner, found)
    return found


def sum_by_owner(x: Tensor, owner: Tensor, B: int) -> Tensor:
    """(B, ...) sums of the rows x (N, ...) of each source: the gradient of a read through owner."""
    # index_add_, not index_put_(accumulate=True) (autograd's choice for x[owner]): several times faster on the
    # CPU, and more so with more threads (docs/results/).
    return x.new_zeros((B,) + x.shape[1:]).index_add_(0, owner, x)


def _grouped_sum(x: Tensor, grp: Groups, B: int) -> Tensor:
    """sum_by_owner for grouped rows: (N, ...) -> (B, ...), one reduction over each run of G rows."""
    b0, G = grp
    out = x.new_zeros((B,) + x.shape[1:])
    out[b0:b0 + x.shape[0] // G] = x.view((-1, G) + x.shape[1:]).sum(dim=1)
    return out


def _tanh_pre(q: Tensor, keys: Tensor, owner: Tensor, grp: Groups | None) -> Tensor:
    """tanh(q[n] + keys[owner[n], s]) as a fresh (N, S, A) tensor the caller may overwrite."""
    N, A = q.shape
    if grp is None:
        pre = keys.index_select(0, owner).add_(q[:, None, :])  # the gather's copy takes the sum in place
    else:
        b0, G = grp
        pre = torch.add(keys[b0:b0 + N // G, None], q.view(-1, G, 1, A)).view(N, -1, A)  # (nb, G, S, A)
    return pre.tanh_()


def energies(q: Tensor, keys: Tensor, v: Tensor, owner: Tensor, grp: Groups | None = None) -> Tensor:
    """e[n, s] = v . tanh(q[n] + keys[owner[n], s]): q (N, A), keys (B, S, A), v (1, A) -> (N, S).
    grp = groups(owner) or None (the general path); both give the same numbers.

    The (N, S, A) tanh is only a temporary, built for at most a block's worth of rows at a time (BLOCK_BYTES on
    the CPU, `blocks.block_bytes` on q's device): in a wide search (N = B*K rows every step) it would otherwise
    be the largest tensor of phase one."""
    N, (S, A) = q.shape[0], keys.shape[1:]
    rows = max(1, blocks.block_bytes(q.device, BLOCK_BYTES) // max(1, S * A * q.element_size()))
    if grp is not None:
        rows = max(grp[1], rows // grp[1] * grp[1])  # whole groups per block, so each block stays grouped
    if N <= rows:
        return F.linear(_tanh_pre(q, keys, owner, grp), v).squeeze(-1)
    out = []
    for i in range(0, N, rows):
        block_grp = None if grp is None else (grp[0] + i // grp[1], grp[1])
        out.append(F.linear(_tanh_pre(q[i:i + rows], keys, owner[i:i + rows], block_grp), v).squeeze(-1))
    return torch.cat(out)  # (N, S)


def context(alpha: Tensor, memory: Tensor, owner: Tensor, grp: Groups | None = None) -> Tensor:
    """sum_s alpha[n, s] memory[owner[n], s]: alpha (N, S), memory (B, S, D) -> (N, D)."""
    N, S = alpha.shape
    if grp is None:
        return torch.bmm(alpha[:, None, :], memory.index_select(0, owner)).squeeze(1)
    b0, G = grp
    return torch.bmm(alpha.view(-1, G, S), memory[b0:b0 + N // G]).view(N, -1)  # (nb, G, S) @ (nb, S, D)


def _for_device_type(decorate, method):
    """`decorate` (torch.amp.custom_fwd or custom_bwd) for the device type of each call: torch's decorators fix
    one type when the class is defined, and these Functions run on CPU and CUDA alike. forward records the type
    of its first tensor on ctx; backward then runs in the autocast state forward saw there (autograd's CUDA
    thread has autocast off, so without this the low-precision tensors saved would meet float32 ones)."""
    made = {}

    @functools.wraps(method)
    def run(ctx, *args):
        if decorate is torch.amp.custom_fwd:
            ctx.amp_device_type = args[0].device.type
        kind = ctx.amp_device_type
        if kind not in made:
            made[kind] = decorate(method, device_type=kind)
        return made[kind](ctx, *args)

    return run


amp_forward = functools.partial(_for_device_type, torch.amp.custom_fwd)
amp_backward = functools.partial(_for_device_type, torch.amp.custom_bwd)


class AttentionEnergies(torch.autograd.Function):
    """`energies` saving q, keys, v and owner instead of the (N, S, A) tanh, which backward recomputes."""

    @staticmethod
    @amp_forward
    def forward(ctx, q: Tensor, keys: Tensor, v: Tensor, owner: Tensor, grp: Groups | None = None) -> Tensor:
        ctx.save_for_backward(q, keys, v, owner)
        ctx.grp = grp
        return energies(q, keys, v, owner, grp)

    @staticmethod
    @amp_backward
    def backward(ctx, g: Tensor):
        q, keys, v, owner = ctx.saved_tensors
        t = _tanh_pre(q, keys, owner, ctx.grp)  # (N, S, A)
        dq = dkeys = dv = None
        if ctx.needs_input_grad[2]:
            dv = torch.einsum("ns,nsa->a", g, t)[None, :]  # (1, A), before t is overwritten
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # d e / d(q + key) = v * (1 - t^2), weighted by the incoming g (N, S): tanh_backward does the
            # (1 - t^2) product in one pass, written over t (ours). v in g's dtype: under autocast g is bf16/fp16
            # and g * v would otherwise be a float32 (N, S, A)
            dpre = torch.ops.aten.tanh_backward.grad_input(g[:, :, None] * v[0].to(g.dtype), t, grad_input=t)
            if ctx.needs_input_grad[0]:
                dq = dpre.sum(dim=1)  # (N, A)
            if ctx.needs_input_grad[1]:
                B = keys.shape[0]
                dkeys = sum_by_owner(dpre, owner, B) if ctx.grp is None else _grouped_sum(dpre, ctx.grp, B)
        return dq, dkeys, dv, None, None


class AttentionContext(torch.autograd.Function):
    """`context` saving alpha (N, S) and the shared memory (B, S, D) instead of a per-row (N, S, D) copy."""

    @staticmethod
    @amp_forward
    def forward(ctx, alpha: Tensor, memory: Tensor, owner: Tensor, grp: Groups | None = None) -> Tensor:
        ctx.save_for_backward(alpha, memory, owner)
        ctx.grp = grp
        return context(alpha, memory, owner, grp)

    @staticmethod
    @amp_backward
    def backward(ctx, g: Tensor):
        alpha, memory, owner = ctx.saved_tensors
        if ctx.grp is not None:
            return _grouped_context_backward(ctx, alpha, memory, g) + (None, None)
        dalpha = dmemory = None
        if ctx.needs_input_grad[0]:
            values = memory.index_select(0, owner)  # (N, S, D), transient
            dalpha = torch.bmm(values, g[:, :, None]).squeeze(-1)  # (N, S)
        if ctx.needs_input_grad[1]:
            outer = alpha[:, :, None] * g[:, None, :]  # (N, S, D): row n's gradient for its source's values
            dmemory = sum_by_owner(outer, owner, memory.shape[0])  # (B, S, D)
        return dalpha, dmemory, None, None


def _grouped_context_backward(ctx, alpha: Tensor, memory: Tensor, g: Tensor) -> tuple:
    """AttentionContext's gradients for grouped rows: two batched matmuls per source, no (N, S, D) tensor."""
    (b0, G), (N, S) = ctx.grp, alpha.shape
    values = memory[b0:b0 + N // G]  # (nb, S, D), a view
    gg = g.view(-1, G, g.shape[1])  # (nb, G, D)
    dalpha = dmemory = None
    if ctx.needs_input_grad[0]:
        dalpha = torch.bmm(gg, values.transpose(1, 2)).view(N, S)  # (nb, G, S)
    if ctx.needs_input_grad[1]:
        dmemory = torch.zeros_like(memory)
        dmemory[b0:b0 + N // G] = torch.bmm(alpha.view(-1, G, S).transpose(1, 2), gg)  # (nb, S, D)
    return dalpha, dmemory
