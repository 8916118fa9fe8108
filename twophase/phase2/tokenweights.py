"""Phase two's weights d loss / d log p for a token-level objective, read from the log-probabilities it decodes.

With per-sequence coefficients c, every scored position of row i has weight c_i, known before the decode. With
a token-level objective (`twophase.objectives.policy.PolicyLoss`: each position's loss a function of its own current
log-probability), position (r, t) has weight dl_rt/dlogp evaluated at that log-probability, so a by-hand path
(`outputlayer.target_log_probs_and_grads`) asks for a block's weights once it has the block's log-probs, and
still computes each logit block once. In a prefix tree a node holds one log-probability that every row through
it reads: its weight is the sum of those rows' derivatives.

What `rescore_backward` accepts in place of per-sequence coefficients is named here: a `TokenObjective` (a loss
at each position; `PolicyLoss`), possibly one that also `DecodesChunks` (another model's states at a chunk's
rows; `DistillationLoss`), or an `UnboundObjective` that becomes one when bound to the batch (`Distillation`).

`ChunkLoss` is the objective bound to one chunk's C rows, handed to the model in place of its (C,) coefficients;
`weights(c, ...)` / `loss(c, ...)` let a model's fast path treat both alike. The chunk's loss and statistics
(clipped positions, summed KL) accumulate on the device as the weights are read, for phase two to read back once
per batch: each entry must be read exactly once.

Letters: C rows of a chunk, M entries (scored positions, or tree nodes), P scored positions.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class TokenObjective(Protocol):
    """A token-level objective over N rows, what `rescore_backward` back-propagates in place of coefficients.
    Its loss is a sum over the rows' scored positions, each a function of that position's current
    log-probability (and, with `divergence`, of its whole next-token distribution), every normaliser a constant
    of the batch: so the chunks stay exact.

    Optional, read where present: `terms(logp, row, col)` (the positions' losses with autograd's graph, for a
    model without a by-hand output layer); `divergence(z, row, col)` (a loss of the whole distribution at
    logits z); `entropy_weight`, `entropy_weights`, `entropy_rows`, `entropy_counts` (an entropy bonus, the
    measured entropy); and, where `needs_row_statistics()`, `row_statistic_terms`, `with_row_statistics`,
    `needs_entropies`, `with_entropies` (`twophase.objectives.policyloss.PolicyLoss` has them all)."""

    def __len__(self) -> int:
        """N, the rows."""

    def __getitem__(self, rows) -> "TokenObjective":
        """The objective of rows (an index tensor or a slice) alone, its normalisers unchanged."""

    def live(self) -> Tensor:
        """(N,) bool: the rows whose loss is not identically zero (the others are not decoded)."""

    def needs_row_statistics(self) -> bool:
        """Whether the weights need each row's sums first (a pass without a graph, `with_row_statistics`)."""

    def derivative(self, logp: Tensor, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor, dict]:
        """(loss (P,), d loss / d logp (P,), statistics) at positions (row (P,), col (P,)) whose target
        log-probabilities are logp (P,), without a graph."""


@runtime_checkable
class DecodesChunks(Protocol):
    """A `TokenObjective` that reads another model's states at each chunk's positions (a teacher's)."""

    def decoded(self, tokens: Tensor, owner: Tensor) -> TokenObjective:
        """This chunk's objective with those states at every position of rows tokens (C, T) of sources
        owner (C,), computed without a graph."""


@runtime_checkable
class UnboundObjective(Protocol):
    """An objective before it meets a batch (`twophase.objectives.distill.Distillation`): `rescore_backward`
    binds it to the batch's rows first."""

    def bind(self, model, source, samples) -> TokenObjective:
        """The `TokenObjective` of samples' N rows, for model (the student) on source."""


_METHODS = ("__len__", "__getitem__", "live", "needs_row_statistics", "derivative")


def missing(objective) -> list[str]:
    """The `TokenObjective` methods objective lacks."""
    return [name for name in _METHODS if not callable(getattr(objective, name, None))]


class ChunkLoss:
    """A `TokenObjective` over a chunk's rows (see `twophase.objectives.policyloss.PolicyLoss`)."""

    def __init__(self, objective: TokenObjective):
        self.objective = objective
        self.total = torch.zeros((), dtype=torch.float64)
        self.sums = {"tokens": 0, "clip_low": 0, "clip_high": 0, "kl": 0.0, "entropy": 0.0, "entropy_tokens": 0.0}

    def __len__(self) -> int:
        return len(self.objective)

    def _add(self, loss: Tensor, sums: dict, tokens: int) -> None:
        self.total = self.total.to(loss.device) + loss.detach().sum().to(torch.float64)
        self.sums["tokens"] += tokens
        for key, value in sums.items():
            self.sums[key] += value

    def at(self, row: Tensor, col: Tensor, node: Tensor | None = None, size: int | None = None) -> "PositionWeights":
        """The weights of M entries: the positions (row (P,), col (P,)) themselves, or with node (P,) the size
        nodes they read."""
        return PositionWeights(self, row, col, node, size)

    def has_entropy(self) -> bool:
        """Whether the objective needs each position's whole distribution: an entropy bonus, or a divergence
        from another model's distributions (`has_divergence`)."""
        return self.has_bonus() or self.has_divergence()

    def has_bonus(self) -> bool:
        """Whether the objective has an entropy bonus."""
        return getattr(self.objective, "entropy_weight", None) is not None

    def has_divergence(self) -> bool:
        """Whether the objective is a divergence from another model's next-token distributions (`divergence`,
        `twophase.objectives.distill`)."""
        return callable(getattr(self.objective, "divergence", None))

    def entropy_weights(self, row: Tensor, col: Tensor) -> Tensor:
        return self.objective.entropy_weights(row, col)

    def terms(self, logp: Tensor, row: Tensor, col: Tensor) -> Tensor:
        """The loss of positions (row, col) at log-probabilities logp (P,) with autograd's graph (0-dim): for a
        model whose phase two differentiates its per-token log-probabilities alone, so an objective that needs
        each position's whole distribution is refused."""
        if self.has_entropy():
            what = "a divergence from a teacher" if self.has_divergence() else "entropy_coef"
            raise ValueError(f"{what} needs the model's by-hand output layer (weighted_score_backward or "
                             "weighted_tree_backward: the built-in LSTM, the HF wrappers with their head): "
                             "this model's phase two differentiates its per-token log-probabilities alone")
        loss = self.objective.terms(logp, row, col)
        _, _, sums = self.objective.derivative(logp.detach(), row, col)
        self._add(loss, sums, len(row))
        return loss.sum()

    def add_loss(self, value: Tensor) -> None:
        """Add a term computed elsewhere (a block's entropy bonus) to the chunk's loss."""
        self._add(value, {}, 0)

    def add_entropies(self, counts: Tensor | None, H: Tensor) -> None:
        """Add entropies H (M,) of entries counted counts (M,) times (None: not measured) to the measured sums,
        on the device (read back with the chunk's other statistics)."""
        if counts is None:
            return
        with torch.no_grad():
            counts = counts.to(torch.float64)
            self._add(torch.zeros((), dtype=torch.float64, device=H.device),
                      {"entropy": (counts * H.detach().to(torch.float64)).sum(), "entropy_tokens": counts.sum()}, 0)


class PositionWeights:
    """Entry weights as a function of entry log-probabilities: `self(index, tok)` for a slice of the M entries."""

    def __init__(self, chunk: ChunkLoss, row: Tensor, col: Tensor, node: Tensor | None, size: int | None):
        self.chunk, self.size = chunk, len(row) if node is None else size
        if node is None:
            self.row, self.col, self.node, self.ptr = row, col, None, None
            return
        order = torch.sort(node, stable=True).indices  # (P,) positions grouped by node, nodes in order
        self.row, self.col, self.node = row[order], col[order], node[order]
        # positions of nodes [i, j) are ptr[i]:ptr[j]
        self.starts = torch.searchsorted(self.node, torch.arange(self.size + 1, device=node.device))  # (M + 1,)
        self.ptr = self.starts.tolist()

    def __len__(self) -> int:
        return self.size

    def __call__(self, index: slice, tok: Tensor) -> Tensor:
        """Weights (m,) of entries index (a slice) whose log-probabilities are tok (m,); adds their loss."""
        start, stop, _ = index.indices(self.size)
        if self.node is None:
            loss, d, sums = self.chunk.objective.derivative(tok, self.row[start:stop], self.col[start:stop])
            self.chunk._add(loss, sums, stop - start)
            return d
        a, b = self.ptr[start], self.ptr[stop]
        local = self.node[a:b] - start  # (p,) each position's entry within the slice
        loss, d, sums = self.chunk.objective.derivative(tok.index_select(0, local), self.row[a:b], self.col[a:b])
        self.chunk._add(loss, sums, b - a)
        return torch.zeros(stop - start, dtype=d.dtype, device=d.device).index_add_(0, local, d)

    def entropy(self, index: slice) -> Tensor | None:
        """(m,) the entropy bonus's weight of entries index (summed over the positions a tree node stands for),
        or None without a bonus."""
        if not self.chunk.has_bonus():
            return None
        start, stop, _ = index.indices(self.size)
        if self.node is None:
            return self.chunk.entropy_weights(self.row[start:stop], self.col[start:stop])
        a, b = self.ptr[start], self.ptr[stop]
        local = self.node[a:b] - start  # (p,)
        weight = self.chunk.entropy_weights(self.row[a:b], self.col[a:b])
        return weight.new_zeros(stop - start).index_add_(0, local, weight)

    def add_loss(self, value: Tensor) -> None:
        self.chunk.add_loss(value)

    def logit_gradient(self, index: slice, z: Tensor) -> Tensor | None:
        """(m, V) d loss / d logits of entries index, whose logits are z (m, V), for a divergence from another
        model's distributions (None without one); adds the entries' loss. A tree node stands for every position
        through it: its gradient is the node's divergence's, times the summed normalisers of those positions."""
        if not self.chunk.has_divergence():
            return None
        objective = self.chunk.objective
        start, stop, _ = index.indices(self.size)
        if self.node is None:
            row, col = self.row[start:stop], self.col[start:stop]
            weight = objective.scale.index_select(0, row)  # (m,)
        else:
            first = self.starts[start:stop]  # (m,) each node's first position: its prefix and source
            row, col = self.row.index_select(0, first), self.col.index_select(0, first)
            a, b = self.ptr[start], self.ptr[stop]
            local = self.node[a:b] - start  # (p,)
            scale = objective.scale.index_select(0, self.row[a:b])
            weight = scale.new_zeros(stop - start).index_add_(0, local, scale)  # (m,)
        value, grad = objective.divergence(z, row, col)  # (m,), (m, V)
        weight = weight.to(grad.dtype)
        self.chunk.add_loss((weight * value).sum())
        return grad.mul_(weight[:, None])

    def add_entropy(self, index: slice, H: Tensor) -> None:
        """The measured entropy's share of entries index, whose entropies are H (m,): each entry counted as often
        as it stands for positions of the measured token set."""
        counts = self.entropy_counts(index)
        if counts is not None:
            self.chunk.add_entropies(counts, H)

    def entropy_counts(self, index: slice) -> Tensor | None:
        """(m,) how many positions of the measured entropy's token set entries index stand for, or None."""
        if getattr(self.chunk.objective, "entropy_rows", None) is None:
            return None
        start, stop, _ = index.indices(self.size)
        if self.node is None:
            return self.chunk.objective.entropy_counts(self.row[start:stop], self.col[start:stop])
        a, b = self.ptr[start], self.ptr[stop]
        local = self.node[a:b] - start  # (p,)
        counts = self.chunk.objective.entropy_counts(self.row[a:b], self.col[a:b])
        return counts.new_zeros(stop - start).index_add_(0, local, counts)

    def autograd(self, tok: Tensor) -> Tensor:
        """The loss at entry log-probabilities tok (M,) with autograd's graph (0-dim)."""
        return self.chunk.terms(tok if self.node is None else tok.index_select(0, self.node), self.row, self.col)


def entropy(log_probs: Tensor) -> Tensor:
    """(P,) the entropies of log-distributions log_probs (P, V) (-inf entries: probability 0), with a graph."""
    p = log_probs.exp()
    return -(p * log_probs.masked_fill(p == 0, 0.0)).sum(-1)


def is_token_level(c) -> bool:
    return isinstance(c, (ChunkLoss, PositionWeights))


def weights(c, row: Tensor, col: Tensor, dtype: torch.dtype):
    """(M,) d loss / d log p of positions (row, col) of a chunk: c[row] for coefficients c (C,), else the
    ChunkLoss' `PositionWeights`."""
    if isinstance(c, ChunkLoss):
        return c.at(row, col)
    return c.to(dtype).index_select(0, row)


def loss(c, tok: Tensor, row: Tensor) -> Tensor:
    """The chunk's loss from its positions' log-probabilities tok (M,) of rows row (M,): sum_i c_i log p_i
    for coefficients, the accumulated objective for a ChunkLoss (once its weights were read)."""
    if isinstance(c, ChunkLoss):
        return c.total
    log_p = tok.new_zeros(len(c)).index_add_(0, row, tok)  # (C,)
    return (c.to(log_p.dtype) * log_p).sum()


def weighted_sum(w, tok: Tensor) -> Tensor:
    """sum w * tok for entry weights w (M,), or the accumulated objective for `PositionWeights`."""
    if isinstance(w, PositionWeights):
        return w.chunk.total
    return (w * tok).sum()
