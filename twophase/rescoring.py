"""Phase two: teacher-forced re-decoding of phase one's candidates, in chunks, with gradients.

For per-sequence coefficients c (fixed numbers from phase one) the surrogate loss is
    L = sum_i c_i * log p(y_i | x_owner(i)),
and since c carries no gradient, dL/dtheta is a sum over rows: each chunk of rows can be decoded,
back-propagated and freed before the next begins. The encoder is shared by all chunks, so its outputs are cut
out of the graph (`Encoded.detached`), the chunks accumulate the gradient at that boundary, and the encoder is
back-propagated once at the end. The result equals one backward over all rows, whatever the chunk size.

Letters: B sources, N candidate rows, C rows per chunk, T target length.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .model import Seq2Seq
from .search import Samples


def rescore_backward(model: Seq2Seq, src: Tensor, src_lengths: Tensor, samples: Samples,
                     coefficients: Tensor, chunk_size: int) -> float:
    """Accumulate into .grad the gradient of sum_i coefficients[i] * log p(samples.tokens[i] | src[owner[i]]),
    decoding at most chunk_size rows at a time. Returns the value of that sum."""
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
    with torch.enable_grad():
        enc = model.encode(src, src_lengths)
        boundary = enc.detached()
        total = 0.0
        for start in range(0, len(samples), chunk_size):
            rows = slice(start, start + chunk_size)
            T = int(samples.lengths[rows].max())  # no steps past the chunk's longest row
            tokens = samples.tokens[rows, :T]  # (C, T)
            log_p = model.score(boundary, tokens, samples.owner[rows])  # (C,)
            loss = (coefficients[rows].to(log_p.dtype) * log_p).sum()
            loss.backward()  # frees this chunk's graph before the next chunk is built
            total += loss.item()
        outputs, grads = [], []
        for x, leaf in zip(enc.float_tensors(), boundary.float_tensors()):
            if leaf.grad is not None:
                outputs.append(x)
                grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)
    return total
