"""Stochastic beam search (Kool, van Hoof & Welling, ICML 2019): K distinct sequences per source, drawn without
replacement from the model's distribution, with no autograd graph.

The Gumbel-top-k trick: perturb every complete sequence's log-probability phi_y with an independent Gumbel,
G_y = phi_y + Gumbel(0); the K largest G_y are, in decreasing order, an ordered sample without replacement from p
(Plackett-Luce). The sequences are never enumerated: the perturbation is drawn top-down over the prefix tree. The
root's G ~ Gumbel(0) (phi = log 1); a node with perturbed score T hands its children, of log-probabilities
phi_i = phi_parent + log p(token i | prefix), Gumbels conditioned on their maximum being T:

    g_i ~ Gumbel(phi_i),  Z = max_i g_i,  G_i = -log(exp(-T) - exp(-Z) + exp(-g_i)),

computed in the shifted form the paper's appendix gives, v = T - g_i + log(1 - exp(g_i - Z)),
G_i = T - max(v, 0) - log(1 + exp(-|v|)). A node's G is then the maximum of the G_y of the sequences below it, so
keeping the K largest G at each depth (a beam search over G instead of phi) keeps every ancestor of the K largest
G_y: the result is exactly the Gumbel-top-k of the whole space. The beam machinery is `search`'s
(blocked `advance`/`log_probs`, finished rows, compaction): only the choice of the K extensions differs.

A finished hypothesis has one child, pad_id, at log-probability 0, which the formula hands its own G: it keeps
competing with its final G. max_len truncates as beam search does: a hypothesis still open after max_len tokens is
returned as it is, scored by its prefix's log-probability. That is the same law on the truncated space, in which
an unfinished prefix of max_len tokens stands for the set of all its continuations (their probabilities sum to the
prefix's, which is its score, and which phase two's teacher-forced score of the row reproduces).

The threshold kappa of a source is the (K+1)-th largest G_y of all its sequences: the G_y of the candidates exceed
it, and q_y = P(G_y > kappa) = 1 - exp(-exp(phi_y - kappa)) is the inclusion probability of priority sampling
(`twophase.objectives.estimators`). A node that is not kept at some depth holds the maximum G of its subtree, so
kappa is the largest G among all candidate extensions ranked (K+1)-th at some step: the beam of K finds it without
an extra row.

Letters: B sources, K candidates per source, N = B*K rows, V vocabulary, n sources of a block.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..protocol import eval_mode
from ..samples import Samples
from .search import _beam_search, _finish


def stochastic_beam_search(model, source, num_samples: int, max_len: int,
                           generator: torch.Generator | None = None) -> Samples:
    """num_samples distinct sequences per source, drawn without replacement from the model (fewer where the
    space of sequences of length <= max_len is smaller), in decreasing order of their perturbed scores G_y (so an
    ordered sample: the first row of a source is an ordinary draw from p). Samples.scores are the model's
    log-probabilities, Samples.perturbed the G_y and Samples.threshold the source's kappa, both float64."""
    with eval_mode(model), torch.inference_mode():
        tokens, scores, owner, token_scores, gumbels = _stochastic_beam_search(model, source, num_samples, max_len,
                                                                               generator)
    return _finish(model, tokens, scores, owner, token_scores, perturbed=gumbels.perturbed.reshape(-1),
                   threshold=gumbels.threshold[owner])


def _stochastic_beam_search(model, source, num_samples: int, max_len: int, generator):
    """The loop under the caller's grad mode (`onephase` runs it with a graph): (tokens, scores, owner) as
    `_beam_search` returns them, and the `Gumbels` that chose them."""
    made = []

    def choose(B: int, K: int, device) -> Gumbels:
        made.append(Gumbels(B, K, device, generator))
        return made[0]
    found = _beam_search(model, source, num_samples, max_len, choose=choose)
    return (*found, made[0])


class Gumbels:
    """The beam's choice of extensions by perturbed scores, holding perturbed (B, K) (the beam's hypotheses' G,
    in the beam's row order) and threshold (B,) (kappa so far). Float64 whatever the model's dtype: the shifted
    formula subtracts nearby numbers."""

    def __init__(self, B: int, K: int, device, generator: torch.Generator | None):
        self.generator = generator
        self.perturbed = torch.full((B, K), float("-inf"), dtype=torch.float64, device=device)
        self.perturbed[:, 0] = self.gumbel((B,), device)  # the root, phi = 0; rows 1..K-1 start impossible
        self.threshold = torch.full((B,), float("-inf"), dtype=torch.float64, device=device)

    def gumbel(self, shape, device) -> Tensor:
        """Standard Gumbels on `device`: -log E with E ~ Exp(1) (E = 0 has probability 0), drawn on the
        generator's device (a CPU `torch.Generator()` serves a model on a GPU, at the cost of a copy)."""
        at = device if self.generator is None else self.generator.device
        e = torch.empty(shape, dtype=torch.float64, device=at).exponential_(generator=self.generator)
        # to an accelerator the copy need not block (fresh, nothing else holds it); to the CPU it must
        return (-e.log()).to(device, non_blocking=torch.device(device).type != "cpu")

    def __call__(self, cand: Tensor, K: int, sources: Tensor):
        """cand (n, K*V): the extensions' log-probabilities phi (with the search's graph under one-phase);
        sources (n,): their sources. Keeps the K largest G, updates kappa, returns ((n, K) phi, (n, K) flat)."""
        n, KV = cand.shape
        with torch.no_grad():
            phi = cand.detach().to(torch.float64).reshape(n, K, KV // K)  # (n, K, V)
            G = conditional_gumbels(phi, self.perturbed[sources], self.gumbel(phi.shape, phi.device))  # (n, K, V)
            top = G.reshape(n, KV).topk(min(K + 1, KV), dim=1)  # (n, K+1): the K kept, and the first left out
            flat = top.indices[:, :K]  # (n, K)
            self.perturbed[sources] = top.values[:, :K]
            if KV > K:
                self.threshold[sources] = torch.maximum(self.threshold[sources], top.values[:, K])
        # An extension of G = -inf is impossible (it fills a beam wider than the space): its score says so.
        return cand.gather(1, flat).masked_fill(torch.isneginf(top.values[:, :K]), float("-inf")), flat


def conditional_gumbels(phi: Tensor, parent: Tensor, noise: Tensor) -> Tensor:
    """(n, K, V) Gumbels of locations phi (n, K, V) conditioned on their maximum over V being parent (n, K), from
    standard Gumbels noise (n, K, V), in the numerically stable shifted form. Children with phi = -inf (and every
    child of an impossible parent) get -inf."""
    g = phi + noise  # (n, K, V) unconditioned Gumbel(phi)
    Z = g.amax(dim=2, keepdim=True)  # (n, K, 1)
    T = parent[..., None]  # (n, K, 1)
    # log(1 - exp(g - Z)) by expm1 alone: exact near g = Z, and far below it an absolute error < 1e-16 in v (the
    # argmax child has g = Z: v = -inf, G = T exactly)
    v = T - g + torch.log(-torch.expm1(g - Z))
    G = T - v.clamp(min=0) - torch.log1p(torch.exp(-v.abs()))
    return torch.where(torch.isfinite(phi) & torch.isfinite(T), G, torch.full_like(G, float("-inf")))


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate near 0 and for very negative x (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
