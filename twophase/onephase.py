"""The one-phase baseline: search with the autograd graph of every decoding step kept, then one backward.

This is what sequence-level RL costs without twophase, kept for comparison (`--one-phase`, `twophase.bench`):
`one_phase_beam_search` / `one_phase_sample` run the very loops of `twophase.search` (same `Seq2Seq` functions,
same tie-breaking, same generator draws) with gradients enabled, so they return the same candidates as phase one
plus their sequence log-probabilities WITH the graph of the whole search, beam reorders included.
`one_phase_backward` then back-propagates sum_i c_i log p_i in one go: the same gradient `rescore_backward`
computes, but the graph of all N rows times T steps (each holding a (N, V) log-softmax) is alive at once.

`SeedStyleSeq2Seq` is the code users post today, for the benchmark only: the same parameters (load a
`Seq2Seq` state dict), but the attention recomputes `U y` for every beam at every step over a per-beam copy of
the encoder outputs, with plain autograd ops throughout.

Letters used in shape comments:
    B  sources in the batch          K  beam size / samples per source     N  = B*K candidate rows
    S  source length                 T  target length (max_len)             H  hidden size
    A  attention size (= H)          D  encoder output size                 V  target vocabulary size
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .model import Encoded, Seq2Seq
from .search import Samples, _beam_search, _finish, _sample


def _with_graph(found: tuple[Tensor, Tensor, Tensor]) -> tuple[Samples, Tensor]:
    """Split the loop's output into plain Samples (detached scores, as phase one gives them) and the graph."""
    samples = _finish(*found)
    log_probs = samples.scores  # (N,) with the search's graph
    samples.scores = log_probs.detach()
    return samples, log_probs


def one_phase_beam_search(model: Seq2Seq, src: Tensor, src_lengths: Tensor, beam_size: int,
                          max_len: int) -> tuple[Samples, Tensor]:
    """`beam_search` with gradients: the same candidates, and their (N,) log-probabilities with graph."""
    with torch.enable_grad():
        return _with_graph(_beam_search(model, src, src_lengths, beam_size, max_len))


def one_phase_sample(model: Seq2Seq, src: Tensor, src_lengths: Tensor, num_samples: int, max_len: int,
                     temperature: float = 1.0, generator: torch.Generator | None = None) -> tuple[Samples, Tensor]:
    """`sample` with gradients: the same draws for the same generator state, and their (N,) log-probabilities
    with graph."""
    with torch.enable_grad():
        return _with_graph(_sample(model, src, src_lengths, num_samples, max_len, temperature, generator))


def one_phase_search(model: Seq2Seq, src: Tensor, src_lengths: Tensor, sampler: str, num: int, max_len: int,
                     temperature: float = 1.0, generator: torch.Generator | None = None) -> tuple[Samples, Tensor]:
    """--one-phase's phase one: `num` candidates per source from sampler 'beam' or 'sample', and their
    log-probabilities with the graph of the whole search."""
    if sampler == "beam":
        return one_phase_beam_search(model, src, src_lengths, num, max_len)
    return one_phase_sample(model, src, src_lengths, num, max_len, temperature, generator)


def one_phase_backward(log_probs: Tensor, coefficients: Tensor) -> float:
    """Accumulate into .grad the gradient of sum_i coefficients[i] * log_probs[i] and free the search graph.
    Returns the value of that sum, as `rescore_backward` does."""
    coefficients = torch.as_tensor(coefficients, device=log_probs.device)
    if coefficients.shape != log_probs.shape:
        raise ValueError(f"expected {len(log_probs)} coefficients, got shape {tuple(coefficients.shape)}")
    loss = (coefficients.to(log_probs.dtype) * log_probs).sum()
    loss.backward()
    return loss.item()


# ---------------------------------------------------------------- the seed's code, for the benchmark
def seed_style_advance(model: Seq2Seq, beam_memory: tuple[Tensor, Tensor], prev: Tensor, state):
    """One decoder state update written the usual way. beam_memory = (matrix (N, S, D), pad (N, S)): the encoder
    outputs and padding mask copied once per beam. Returns the new state (h, c); the output layer and
    log-softmax are `Seq2Seq.log_probs`, the plain ops user code has too."""
    matrix, pad = beam_memory
    h, c = state
    U, W, v = model.attn_U, model.attn_W.weight, model.attn_v.weight  # (A, D) Linear with bias, (A, H), (1, A)
    # U y recomputed for every beam at every step: the graph saves an (N, S, A) tanh per step.
    pre = h.matmul(W.t()).unsqueeze(1) + U(matrix)  # (N, S, A)
    energy = torch.tanh(pre).matmul(v.t()).squeeze(-1).masked_fill(pad, float("-inf"))  # (N, S)
    alpha = torch.softmax(energy, dim=-1)  # (N, S)
    ctx = torch.bmm(alpha.unsqueeze(1), matrix).squeeze(1)  # (N, D)
    x = torch.cat([model.drop(model.tgt_embed(prev)), ctx], dim=-1)  # (N, E + D)
    return model.cell(x, (h, c))


class SeedStyleSeq2Seq(Seq2Seq):
    """`Seq2Seq`'s parameters with `seed_style_advance` as its state update (`advance`, which `step` and both
    search loops call), so the loops of `twophase.search` run it unchanged. `init_state` makes the per-beam copy
    of the encoder outputs, once per search, as user code does before its loop; `advance` reuses it while the
    search's owner tensor is the one it was made for."""

    @classmethod
    def from_model(cls, model: Seq2Seq) -> "SeedStyleSeq2Seq":
        seed = cls(**model.config)
        ref = next(model.parameters())
        seed.to(device=ref.device, dtype=ref.dtype).load_state_dict(model.state_dict())
        return seed.train(model.training)

    def init_state(self, enc: Encoded, owner: Tensor):
        # Expanded per beam (a copy, as `repeat`/`expand().reshape` give): what the step's U y runs over.
        self._beam_memory = (owner, enc.memory.index_select(0, owner), ~enc.mask.index_select(0, owner))
        return super().init_state(enc, owner)

    def advance(self, enc: Encoded, owner: Tensor, prev: Tensor, state):
        cached = getattr(self, "_beam_memory", None)
        if cached is None or cached[0] is not owner or cached[1].shape[0] != len(owner):
            self._beam_memory = cached = (owner, enc.memory.index_select(0, owner), ~enc.mask.index_select(0, owner))
        return seed_style_advance(self, cached[1:], prev, state)

    def release(self) -> None:
        """Drop the per-beam copy (and the graph it belongs to) once the search is back-propagated."""
        self._beam_memory = None
