"""The sampler's law at one step: what ancestral sampling draws from (`truncate`: --min-len, --top-k, --top-p)
and the draw itself (`draw`: one uniform per row by blocks, in float64). Search's scores stay the model's own
log-probabilities whatever the truncation (`twophase.phase1.search.sample`).

Letters: N rows, V vocabulary.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def truncate(logits: Tensor, eos_id: int, t: int, top_k: int | None, top_p: float | None,
             min_len: int) -> Tensor:
    """(N, V) the draw's logits at step t (0-based): -inf on eos while t < min_len, then outside each row's
    top_k, then outside its nucleus (the most probable tokens whose mass, before the last of them, is below
    top_p; at least one token). Ties at the k-th logit are all kept, as `generate`'s TopKLogitsWarper keeps them."""
    if t < min_len:
        logits = logits.index_fill(1, torch.tensor([eos_id], device=logits.device), float("-inf"))
    if top_k is not None and top_k < logits.shape[1]:
        kth = logits.topk(top_k, dim=1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=1, descending=True)  # (N, V)
        probs = torch.softmax(sorted_logits, dim=1)
        before = running_sum(probs) - probs  # (N, V) mass of the more probable tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, order, before >= top_p)  # vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


NO_MASS = "draw: a row of probabilities has no positive mass (or holds NaN)"


def draw(probs: Tensor, generator: torch.Generator | None = None, block: int = 64) -> Tensor:
    """(N,) one token per row of probs (N, V) (non-negative, each row's mass positive, not necessarily 1), by
    inverting the row's cumulative distribution at one uniform draw: first among blocks of `block` tokens, then
    within the chosen block. `torch.multinomial` draws V exponential variates per row for one sample: on CPU a
    quarter of a sampling step's time with a small model (14 of 60 ms at N = 32, V = 8000); one cumulative sum
    over V still took 3 ms there, the blocks' sums 0.5. The sums are in float64, so each token's probability is
    kept to about 1e-16 of its row's mass, and a token (a block) of probability 0 is never drawn: the uniform
    stays strictly below the mass it is compared with. ValueError where a row has no positive mass (also NaN):
    as torch.multinomial, refuse rather than draw anything. `generator` may be on any device: the uniforms are
    drawn on its device and moved to probs'."""
    tokens, has_mass = draw_unchecked(probs, generator, block)
    if not bool(has_mass.all()):
        raise ValueError(NO_MASS)
    return tokens


def draw_unchecked(probs: Tensor, generator: torch.Generator | None = None,
                   block: int = 64) -> tuple[Tensor, Tensor]:
    """`draw` without reading whether every row has mass (a read makes the host wait for the device): (N,)
    tokens and (N,) has_mass, each row's. A row without mass gets some token in range(V), which means nothing."""
    N, V = probs.shape
    p = torch.nn.functional.pad(probs, (0, (-V) % block)).double().reshape(N, -1, block)  # (N, V / block, block)
    mass = p.sum(dim=2)  # (N, V / block) each block's
    cdf = running_sum(mass)
    has_mass = cdf[:, -1] > 0  # False also for NaN
    u = uniforms((N, 1), generator, probs.device) * cdf[:, -1:]  # (N, 1)
    u = torch.minimum(u, torch.nextafter(cdf[:, -1:], torch.zeros_like(u)))
    # the first block whose cumulative mass exceeds u; the clamps only act on a row without mass (its u may be
    # NaN), whose indices must stay in range: out of range, a CUDA gather stops the process
    j = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)  # (N, 1)
    u = u - (cdf.gather(1, j) - mass.gather(1, j))  # (N, 1) what is left of u past the blocks before
    inner = running_sum(p[torch.arange(N, device=probs.device), j.squeeze(1)])  # (N, block)
    u = torch.minimum(u.clamp_min(0), torch.nextafter(inner[:, -1:], torch.zeros_like(u)))
    within = torch.searchsorted(inner, u, right=True).clamp_(max=block - 1)  # (N, 1)
    return (j * block + within).squeeze(1).clamp_(max=V - 1), has_mass


def running_sum(x: Tensor) -> Tensor:
    """(N, M) the running sums of x (N, M) along its rows: x.cumsum(dim=1), unless deterministic algorithms are
    on. Then CUDA refuses a floating-point cumsum (its threads add in whatever order they finish), so the sums are
    made without one: within blocks of about sqrt(M) columns, then over the blocks' totals, each a column at a time,
    in float64. The same numbers to rounding (cumsum's own order is not fixed either), nondecreasing where x is
    non-negative, and a column where x is 0 repeats the sum before it exactly, as the draw needs."""
    if not torch.are_deterministic_algorithms_enabled():
        return x.cumsum(dim=1)
    N, M = x.shape
    b = max(1, math.isqrt(max(M - 1, 0)) + 1)  # columns per block: ceil(sqrt(M)) or more
    blocks = torch.nn.functional.pad(x.double(), (0, (-M) % b)).reshape(N, -1, b)  # (N, M / b, b)
    inner = _column_by_column(blocks)  # (N, M / b, b) within each block
    before = _column_by_column(inner[:, :, -1], exclusive=True)  # (N, M / b) the total of the blocks before each
    return (inner + before[:, :, None]).reshape(N, -1)[:, :M].to(x.dtype)


def _column_by_column(x: Tensor, exclusive: bool = False) -> Tensor:
    """x's running sums along its last dimension, one addition per column: each sum is the one before plus the
    column; `exclusive`: the sums before each column (0 before the first)."""
    sums, total = [], torch.zeros_like(x[..., 0])
    for j in range(x.shape[-1]):
        if exclusive:
            sums.append(total)
        total = total + x[..., j]
        if not exclusive:
            sums.append(total)
    return torch.stack(sums, dim=-1)


def uniforms(shape: tuple, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Float64 uniforms in [0, 1) on `device`, drawn on the generator's device (the default generator: on
    `device`'s): a CPU `torch.Generator()` serves a model on a GPU, at the cost of a copy."""
    at = device if generator is None else generator.device
    u = torch.rand(shape, dtype=torch.float64, device=at, generator=generator)
    # to an accelerator the copy need not block (u is fresh, nothing else holds it); to the CPU it must
    return u.to(device, non_blocking=torch.device(device).type != "cpu")
