"""The one-phase baseline: search with the autograd graph of every decoding step kept, then one backward.

This is what sequence-level RL costs without twophase, kept for comparison (`benchmarks`; in the place of a run's
phase two: `benchmarks.baselines`): `one_phase_beam_search` / `one_phase_sample` /
`one_phase_stochastic_beam_search` run the very loops of phase one's `search` and `sbs` (same model functions,
same tie-breaking, same generator draws) with gradients enabled, so they return the same candidates as phase one
plus their sequence log-probabilities WITH the graph of the whole search, beam reorders included.
`one_phase_backward` then back-propagates sum_i c_i log p_i in one go: the same gradient `rescore_backward`
computes, but the graph of all N rows times T steps (each holding a (N, V) log-softmax) is alive at once.

Letters used in shape comments:
    B  sources in the batch          K  beam size / samples per source     N  = B*K candidate rows
    S  source length                 T  target length (max_len)             H  hidden size
    A  attention size (= H)          D  encoder output size                 V  target vocabulary size
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..protocol import scoring_mode
from .sbs import _stochastic_beam_search
from .search import Samples, _beam_search, _finish, _sample


def _with_graph(model, found: tuple, **extra: Tensor) -> tuple[Samples, Tensor]:
    """Split the loop's output into plain Samples (detached scores, as phase one gives them) and the graph."""
    samples = _finish(model, *found, **extra)
    log_probs = samples.scores  # (N,) with the search's graph
    samples.scores = log_probs.detach()
    return samples, log_probs


def one_phase_beam_search(model, source, beam_size: int, max_len: int) -> tuple[Samples, Tensor]:
    """`beam_search` with gradients: the same candidates, and their (N,) log-probabilities with graph."""
    with torch.enable_grad(), scoring_mode(model):
        return _with_graph(model, _beam_search(model, source, beam_size, max_len))


def one_phase_sample(model, source, num_samples: int, max_len: int, temperature: float = 1.0,
                     generator: torch.Generator | None = None) -> tuple[Samples, Tensor]:
    """`sample` with gradients: the same draws for the same generator state, and their (N,) log-probabilities
    with graph."""
    with torch.enable_grad(), scoring_mode(model):
        return _with_graph(model, _sample(model, source, num_samples, max_len, temperature, generator))


def one_phase_stochastic_beam_search(model, source, num_samples: int, max_len: int,
                                     generator: torch.Generator | None = None) -> tuple[Samples, Tensor]:
    """`sbs.stochastic_beam_search` with gradients: the same draws for the same generator state, and their (N,)
    log-probabilities with graph."""
    with torch.enable_grad(), scoring_mode(model):
        *found, g = _stochastic_beam_search(model, source, num_samples, max_len, generator)
        return _with_graph(model, tuple(found), perturbed=g.perturbed.reshape(-1), threshold=g.threshold[found[2]])


def one_phase_search(model, source, sampler: str, num: int, max_len: int, temperature: float = 1.0,
                     generator: torch.Generator | None = None) -> tuple[Samples, Tensor]:
    """--one-phase's phase one: `num` candidates per source from sampler 'beam', 'sample' or 'sbs', and their
    log-probabilities with the graph of the whole search."""
    if sampler == "beam":
        return one_phase_beam_search(model, source, num, max_len)
    if sampler == "sbs":
        return one_phase_stochastic_beam_search(model, source, num, max_len, generator)
    return one_phase_sample(model, source, num, max_len, temperature, generator)


def one_phase_backward(log_probs: Tensor, coefficients: Tensor) -> float:
    """Accumulate into .grad the gradient of sum_i coefficients[i] * log_probs[i] and free the search graph.
    Returns the value of that sum, as `rescore_backward` does."""
    coefficients = torch.as_tensor(coefficients, device=log_probs.device)
    if coefficients.shape != log_probs.shape:
        raise ValueError(f"expected {len(log_probs)} coefficients, got shape {tuple(coefficients.shape)}")
    loss = (coefficients.to(log_probs.dtype) * log_probs).sum()
    loss.backward()
    return loss.item()

