"""Phase two: teacher-forced re-decoding of phase one's candidates, in chunks, with gradients.

For per-sequence coefficients c (fixed numbers from phase one) the surrogate loss is
    L = sum_i c_i * log p(y_i | x_owner(i)),
and since c carries no gradient, dL/dtheta is a sum over rows: each chunk of rows can be decoded,
back-propagated and freed before the next begins. The encoder is shared by all chunks, so its outputs are cut
out of the graph (`Encoded.detached`), the chunks accumulate the gradient at that boundary, and the encoder is
back-propagated once at the end. The result equals one backward over all rows, whatever the chunk size.

On a GPU a chunk's gradient is computed with `torch.autograd.grad` and only then added to `.grad`: if the GPU
runs out of memory half-way through a chunk, nothing of it has been accumulated, so the chunk is redone at half
the size and the step's gradient stays exact. That costs a second, transient copy of the gradients. Where no
out-of-memory error can be caught and retried (the CPU, whose allocator failures are not CUDA's), autograd adds
each chunk's gradient straight into `.grad` instead, and the output layer's by hand into the same tensors.

Because c is known before a chunk is decoded, the output layer's forward and backward run together by hand
(each V-sized logit block computed once) and autograd walks the decoder from its output states; a model whose
`score` is replaced is differentiated through that `score` instead.

Letters: B sources, N candidate rows, C rows per chunk, T target length.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .models import outputlayer
from .models.seq2seq import Seq2Seq
from .search import Samples


def rescore_backward(model: Seq2Seq, src: Tensor, src_lengths: Tensor, samples: Samples,
                     coefficients: Tensor, chunk_size: int, profiler=None, oom_retry: bool | None = None) -> float:
    """Accumulate into .grad the gradient of sum_i coefficients[i] * log p(samples.tokens[i] | src[owner[i]]),
    decoding at most chunk_size rows at a time. Returns the value of that sum.

    On CUDA out-of-memory inside a chunk, the chunk is freed and redone with half as many rows (down to one).
    oom_retry (default: on for CUDA tensors) chooses that retry-safe accumulation; off, an out-of-memory error
    propagates and the chunk's gradient goes straight into .grad, saving a chunk-time copy of the gradients.
    `profiler` (optional, see twophase.profiling) gets a section per encoder pass and per chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    coefficients = torch.as_tensor(coefficients, device=src.device)
    if coefficients.shape != (len(samples),):
        raise ValueError(f"expected {len(samples)} coefficients, got shape {tuple(coefficients.shape)}")
    # Rows with a zero coefficient add nothing to the gradient (e.g. every candidate of a source equally good).
    live = (coefficients != 0).nonzero().squeeze(1)  # (N',)
    if len(live) == 0:
        return 0.0
    samples, coefficients = samples.select(live), coefficients[live]
    if oom_retry is None:
        oom_retry = src.device.type == "cuda"
    section = profiler.section if profiler is not None else (lambda name: contextlib.nullcontext())
    with torch.enable_grad():
        with section("phase 2: encoder forward"):
            enc = model.encode(src, src_lengths)
        boundary = enc.detached()
        params = [p for p in model.parameters() if p.requires_grad]
        total, start, size, sums = 0.0, 0, chunk_size, {}
        while start < len(samples):
            rows = slice(start, start + size)
            try:
                with section(f"phase 2: chunk of {min(size, len(samples) - start)} rows"):
                    total += _chunk(model, boundary, samples, coefficients, rows, params, oom_retry)
            except torch.cuda.OutOfMemoryError:
                if size == 1 or not oom_retry:
                    raise
                size //= 2  # the failed chunk's graph is unreachable now; the cache is returned to the GPU
                torch.cuda.empty_cache()
                continue
            _bank_boundary_grads(boundary, sums)
            start += size
        with section("phase 2: encoder backward"):
            outputs, grads = [], []
            for i, (x, leaf) in enumerate(zip(enc.float_tensors(), boundary.float_tensors())):
                g = sums[i].to(x.dtype) if i in sums else leaf.grad
                if g is not None:
                    outputs.append(x)
                    grads.append(g)
            if outputs:
                torch.autograd.backward(outputs, grads)
    return total


def _bank_boundary_grads(boundary, sums: dict) -> None:
    """Under autocast the encoder outputs, hence their leaves' .grad, are 16-bit: summed over many chunks they
    would round at every addition, so each chunk's share moves into a float32 sum (sums: index -> tensor)."""
    for i, leaf in enumerate(boundary.float_tensors()):
        if leaf.grad is not None and leaf.grad.dtype in (torch.float16, torch.bfloat16):
            g = leaf.grad.float()
            sums[i] = sums[i].add_(g) if i in sums else g
            leaf.grad = None


def _chunk(model: Seq2Seq, boundary, samples: Samples, coefficients: Tensor, rows: slice, params,
           collect: bool) -> float:
    """Decode rows, then add d(sum c_i log p_i)/d(params, boundary) into their .grad; returns the sum. With
    collect, the whole chunk's gradient exists before any of it is added (see the module docstring)."""
    T = int(samples.lengths[rows].max())  # no steps past the chunk's longest row
    tokens, owner, c = samples.tokens[rows, :T], samples.owner[rows], coefficients[rows]
    inputs = params + [x for x in boundary.float_tensors() if x.requires_grad]
    # A model (or a wrapper such as memstats.graph_bytes) that replaces `score` is differentiated through it.
    if type(model).score is Seq2Seq.score and "score" not in vars(model):
        loss, grads = _fused_output_grads(model, boundary, tokens, owner, c, inputs, collect)
    else:
        log_p = model.score(boundary, tokens, owner)  # (C,)
        loss = (c.to(log_p.dtype) * log_p).sum()
        if collect:
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # frees this chunk's graph
        else:
            grads = []
            loss.backward(inputs=inputs)
    with torch.no_grad():
        for x, g in zip(inputs, grads):
            if g is None:
                continue
            if x.grad is None:
                x.grad = g
            else:
                x.grad.add_(g)
    return loss.item()


def _grad_of(x: Tensor) -> Tensor:
    """x.grad, created as zeros if it does not exist yet: a buffer to accumulate into."""
    if x.grad is None:
        x.grad = torch.zeros_like(x)
    return x.grad


def _fused_output_grads(model: Seq2Seq, boundary, tokens: Tensor, owner: Tensor, c: Tensor, inputs: list,
                        collect: bool):
    """`Seq2Seq.score`'s loss and gradients with the output layer differentiated by hand: the coefficients are
    known before the decode, so `outputlayer.target_log_probs_and_grads` computes each logit block once (autograd
    would recompute it in backward) and the decoder's graph is back-propagated from its output h. Without
    collect, everything is added into .grad here and the returned gradient list is empty."""
    h, target, row = model.decoder_states(boundary, tokens, owner)  # (M, H), (M,), (M,)
    out = model.out
    with torch.no_grad():
        # (M,) d loss / d log p of each position: its row's coefficient, never rounded to a 16-bit h's dtype
        # (fp16 loss scaling puts coefficients far above fp16's range)
        w = c.to(outputlayer.sum_dtype(out.weight)).index_select(0, row)
        into = [None if collect or not p.requires_grad else _grad_of(p) for p in (out.weight, out.bias)]
        tok, dh, dweight, dbias = outputlayer.target_log_probs_and_grads(
            h, out.weight, out.bias, target, model.banned, w, dw=into[0], db=into[1])
        log_p = tok.new_zeros(len(c)).index_add_(0, row, tok)  # (C,), as `score` sums it
        loss = (c.to(log_p.dtype) * log_p).sum()
    if not collect:
        if h.requires_grad:
            h.backward(dh, inputs=[x for x in inputs if x is not out.weight and x is not out.bias])
        return loss, []
    grads = [None] * len(inputs)
    if h.requires_grad:
        grads = list(torch.autograd.grad(h, inputs, dh, allow_unused=True))  # frees this chunk's graph
    for extra, param in ((dweight, out.weight), (dbias, out.bias)):
        for j, x in enumerate(inputs):
            if x is param:
                grads[j] = extra if grads[j] is None else grads[j] + extra
    return loss, grads
