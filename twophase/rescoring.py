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

A model may do a chunk's forward and backward itself (`weighted_score_backward`, see `twophase.protocol`): the
built-in LSTM differentiates its output layer by hand, computing each V-sized logit block once. Otherwise
autograd differentiates the model's `score`, or `step` run over the rows when it has no `score`.

Letters: B sources, N candidate rows, C rows per chunk, T target length.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import protocol, tree
from .samples import Samples


def rescore_backward(model, source, samples: Samples, coefficients: Tensor, chunk_size: int, profiler=None,
                     oom_retry: bool | None = None, keep_mode: bool = False) -> float:
    """Accumulate into .grad the gradient of sum_i coefficients[i] * log p(samples.tokens[i] | source[owner[i]]),
    decoding at most chunk_size rows at a time. Returns the value of that sum.

    On CUDA out-of-memory inside a chunk, the chunk is freed and redone with half as many rows (down to one).
    oom_retry (default: on for CUDA tensors) chooses that retry-safe accumulation; off, an out-of-memory error
    propagates and the chunk's gradient goes straight into .grad, saving a chunk-time copy of the gradients.
    The model runs in evaluation mode, as search ran it, unless keep_mode (e.g. MLE rows with dropout).
    `profiler` (optional, see twophase.train.profiling) gets a section per encoder pass and per chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = samples.tokens.device
    coefficients = torch.as_tensor(coefficients, device=device)
    if coefficients.shape != (len(samples),):
        raise ValueError(f"expected {len(samples)} coefficients, got shape {tuple(coefficients.shape)}")
    # Rows with a zero coefficient add nothing to the gradient (e.g. every candidate of a source equally good).
    live = (coefficients != 0).nonzero().squeeze(1)  # (N',)
    if len(live) == 0:
        return 0.0
    samples, coefficients = samples.select(live), coefficients[live]
    if oom_retry is None:
        oom_retry = device.type == "cuda"
    section = profiler.section if profiler is not None else (lambda name: contextlib.nullcontext())
    with torch.enable_grad(), protocol.scoring_mode(model, keep=keep_mode):
        with section("phase 2: encoder forward"):
            enc = model.encode(source)
        boundary = tree.cut_floating(enc)
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
            for i, (x, leaf) in enumerate(zip(tree.floating(enc), tree.floating(boundary))):
                g = sums[i].to(x.dtype) if i in sums else leaf.grad
                if g is not None and x.requires_grad:
                    outputs.append(x)
                    grads.append(g)
            if outputs:
                torch.autograd.backward(outputs, grads)
    return total


def _bank_boundary_grads(boundary, sums: dict) -> None:
    """Under autocast the encoder outputs, hence their leaves' .grad, are 16-bit: summed over many chunks they
    would round at every addition, so each chunk's share moves into a float32 sum (sums: index -> tensor)."""
    for i, leaf in enumerate(tree.floating(boundary)):
        if leaf.grad is not None and leaf.grad.dtype in (torch.float16, torch.bfloat16):
            g = leaf.grad.float()
            sums[i] = sums[i].add_(g) if i in sums else g
            leaf.grad = None


def _chunk(model, boundary, samples: Samples, coefficients: Tensor, rows: slice, params, collect: bool) -> float:
    """Decode rows, then add d(sum c_i log p_i)/d(params, boundary) into their .grad; returns the sum. With
    collect, the whole chunk's gradient exists before any of it is added (see the module docstring)."""
    T = int(samples.lengths[rows].max())  # no steps past the chunk's longest row
    inputs = params + [x for x in tree.floating(boundary) if x.requires_grad]
    loss, grads = chunk_gradients(model, boundary, samples.tokens[rows, :T], samples.owner[rows], coefficients[rows],
                                  inputs, collect)
    with torch.no_grad():
        for x, g in zip(inputs, grads):
            if g is None:
                continue
            if x.grad is None:
                x.grad = g
            else:
                x.grad.add_(g)
    return loss.item()


def chunk_gradients(model, enc, tokens: Tensor, owner: Tensor, c: Tensor, inputs: list, collect: bool):
    """loss = sum_i c_i log p(tokens[i] | enc[owner[i]]) and, with collect, its gradients with respect to inputs
    (without, they go into .grad and the list is empty): the model's `weighted_score_backward`, or autograd
    through its `score` (through `step` where it has none)."""
    by_hand = getattr(model, "weighted_score_backward", None)
    if by_hand is not None:
        return by_hand(enc, tokens, owner, c, inputs, collect)
    log_p = protocol.score(model, enc, tokens, owner)  # (C,)
    loss = (c.to(log_p.dtype) * log_p).sum()
    if collect:
        return loss, torch.autograd.grad(loss, inputs, allow_unused=True)  # frees this chunk's graph
    loss.backward(inputs=inputs)
    return loss, []
