"""Phase two: teacher-forced re-decoding of phase one's candidates, in chunks, with gradients.

For per-sequence coefficients c (fixed numbers from phase one) the surrogate loss is
    L = sum_i c_i * log p(y_i | x_owner(i)),
and since c carries no gradient, dL/dtheta is a sum over rows: each chunk of rows can be decoded,
back-propagated and freed before the next begins. The encoder is shared by all chunks, so its outputs are cut
out of the graph (`Encoded.detached`), the chunks accumulate the gradient at that boundary, and the encoder is
back-propagated once at the end. The result equals one backward over all rows, whatever the chunk size.

A chunk's gradient is computed with `torch.autograd.grad` and only then added to `.grad`: if the GPU runs out of
memory half-way through a chunk, nothing of it has been accumulated, so the chunk is redone at half the size
and the step's gradient stays exact.

Letters: B sources, N candidate rows, C rows per chunk, T target length.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .model import Seq2Seq
from .search import Samples


def rescore_backward(model: Seq2Seq, src: Tensor, src_lengths: Tensor, samples: Samples,
                     coefficients: Tensor, chunk_size: int, profiler=None) -> float:
    """Accumulate into .grad the gradient of sum_i coefficients[i] * log p(samples.tokens[i] | src[owner[i]]),
    decoding at most chunk_size rows at a time. Returns the value of that sum.

    On CUDA out-of-memory inside a chunk, the chunk is freed and redone with half as many rows (down to one).
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
    section = profiler.section if profiler is not None else (lambda name: contextlib.nullcontext())
    with torch.enable_grad():
        with section("phase 2: encoder forward"):
            enc = model.encode(src, src_lengths)
        boundary = enc.detached()
        params = [p for p in model.parameters() if p.requires_grad]
        total, start, size = 0.0, 0, chunk_size
        while start < len(samples):
            rows = slice(start, start + size)
            try:
                with section(f"phase 2: chunk of {min(size, len(samples) - start)} rows"):
                    total += _chunk(model, boundary, samples, coefficients, rows, params)
            except torch.cuda.OutOfMemoryError:
                if size == 1:
                    raise
                size //= 2  # the failed chunk's graph is unreachable now; the cache is returned to the GPU
                torch.cuda.empty_cache()
                continue
            start += size
        with section("phase 2: encoder backward"):
            outputs, grads = [], []
            for x, leaf in zip(enc.float_tensors(), boundary.float_tensors()):
                if leaf.grad is not None:
                    outputs.append(x)
                    grads.append(leaf.grad)
            if outputs:
                torch.autograd.backward(outputs, grads)
    return total


def _chunk(model: Seq2Seq, boundary, samples: Samples, coefficients: Tensor, rows: slice, params) -> float:
    """Decode rows, then add d(sum c_i log p_i)/d(params, boundary) into their .grad; returns the sum."""
    T = int(samples.lengths[rows].max())  # no steps past the chunk's longest row
    log_p = model.score(boundary, samples.tokens[rows, :T], samples.owner[rows])  # (C,)
    loss = (coefficients[rows].to(log_p.dtype) * log_p).sum()
    inputs = params + [x for x in boundary.float_tensors() if x.requires_grad]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # frees this chunk's graph
    with torch.no_grad():
        for x, g in zip(inputs, grads):
            if g is None:
                continue
            if x.grad is None:
                x.grad = g
            else:
                x.grad.add_(g)
    return loss.item()
