"""The prefix tree of phase two's candidate rows: each distinct (source, prefix) decoded once.

Candidates of one source share long prefixes (a beam's rows often differ in their last few tokens only). Since
    sum_i c_i log p(y_i) = sum_nodes (sum_{i through node} c_i) log p(token at node | source, prefix),
decoding every distinct prefix once, weighted by the summed coefficients of the rows through it, gives the same
loss and the same gradient as decoding every row, with a fraction of the steps and a smaller graph.

A node at depth t is a distinct (source, tokens[0..t]) among the rows that score position t (`target_mask`: up to
and including the first eos_id). Nodes are stored depth by depth; a node's state is its parent's (a node of depth
t - 1, by index) advanced by the parent's token, and at depth 0 the model's initial state for its source. Rows
are sorted lexicographically within each source (`sort_rows`) so that rows sharing a prefix are neighbours; a row
then adds `new_nodes` nodes to the tree of the rows before it, which sizes phase two's chunks in nodes. Phase
two knows every row's length, shared prefix and source on the host (one read per batch), so `shape` lays out a
chunk's tree there (nodes per depth, each depth's owner layout) and `build` reads nothing back from the device.

Letters: N rows, T target length, M nodes (all depths), n_t nodes at depth t, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import nested, owners


@dataclass
class Shape:
    """A tree's shape, known on the host before any node exists: what `build` needs to lay the nodes out
    without reading a size back from the device."""

    offsets: list  # T + 1 ints: depth t's nodes are offsets[t]:offsets[t + 1]
    positions: int  # token positions the rows score
    groups: list  # T entries: depth t's owner layout (`twophase.owners`: (b0, G) or None)


def shape(lengths: list, common: list, owner: list) -> Shape:
    """The Shape of the tree of rows (host lists, in the rows' order) with scored lengths, `common_prefix` (the
    first row's is taken as 0: a tree starts afresh) and sources. Row i opens a node at every depth t with
    min(common[i], lengths[i]) <= t < lengths[i] (common[0] = 0)."""
    T = max(lengths, default=0)
    opened = [0] * (T + 1)  # difference array of the nodes per depth
    per_source = {}  # source -> difference array of its nodes per depth, while rows come grouped by source
    grouped = all(a <= b for a, b in zip(owner, owner[1:]))
    for i, (n, c, b) in enumerate(zip(lengths, common, owner)):
        first = 0 if i == 0 else min(c, n)
        opened[first] += 1
        opened[n] -= 1
        if grouped:
            diff = per_source.setdefault(b, [0] * (T + 1))
            diff[first] += 1
            diff[n] -= 1
    offsets, level = [0], 0
    for t in range(T):
        level += opened[t]
        offsets.append(offsets[-1] + level)
    groups = [None] * T
    if grouped and owner:
        first, last = owner[0], owner[-1]
        running = [0] * (last - first + 1)
        for t in range(T):
            for b, diff in per_source.items():
                running[b - first] += diff[t]
            groups[t] = owners.of_counts(first, running)
    return Shape(offsets=offsets, positions=sum(lengths), groups=groups)


@dataclass
class PrefixTree:
    """Nodes depth-major: depth t's nodes are positions offsets[t]:offsets[t + 1] of every (M,) tensor."""

    tokens: Tensor  # (M,) long: the token each node scores (its prefix's last token)
    owner: Tensor  # (M,) long: the node's source
    parent: Tensor  # (M,) long: index of the parent among the previous depth's nodes (0 at depth 0)
    weights: Tensor  # (M,) summed coefficients of the rows through the node, in the coefficients' dtype; for a
    # token-level objective (`twophase.phase2.tokenweights`) the function giving them from the nodes' log-probabilities
    offsets: list  # T + 1 ints
    positions: int  # token positions the rows score (sum of their lengths): what the rows would decode
    level_owners: list = field(default_factory=list)  # T views of owner, one per depth, layouts declared

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def depth(self) -> int:
        return len(self.offsets) - 1

    def level(self, t: int) -> slice:
        return slice(self.offsets[t], self.offsets[t + 1])

    def level_owner(self, t: int) -> Tensor:
        """(n_t,) depth t's owners: the same tensor object at every call, its layout declared (`owners`), so
        attention finds its grouping without reading it back."""
        return self.level_owners[t] if self.level_owners else self.owner[self.level(t)]

    def inputs(self, bos_id: int) -> Tensor:
        """(M,) the token each node is predicted from: bos_id at depth 0, else its parent's token."""
        prev = torch.full_like(self.tokens, bos_id)
        for t in range(1, self.depth):
            here, above = self.level(t), self.level(t - 1)
            prev[here] = self.tokens[above].index_select(0, self.parent[here])
        return prev


def _keys(tokens: Tensor, lengths: Tensor) -> Tensor:
    """(N, T) tokens with -1 past each row's length: a row that ends sorts before its continuations, and the
    padding (or repeated eos_id) after the end never makes two rows differ."""
    T = tokens.shape[1]
    scored = torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]  # (N, T)
    return torch.where(scored, tokens, torch.full_like(tokens, -1))


def sort_rows(tokens: Tensor, owner: Tensor, lengths: Tensor) -> Tensor:
    """(N,) the row order by source, then lexicographically by scored tokens: rows sharing a prefix become
    neighbours. Any order gives an exact tree; this one gives the fewest nodes."""
    key = torch.cat([owner[:, None], _keys(tokens, lengths)], dim=1)  # (N, 1 + T)
    _, rank = torch.unique(key, dim=0, sorted=True, return_inverse=True)  # lexicographic rank of each row
    return torch.sort(rank, stable=True).indices


def common_prefix(tokens: Tensor, owner: Tensor, lengths: Tensor) -> Tensor:
    """(N,) how many leading scored tokens each row shares with the row before it (0 for the first row and for
    a row of another source)."""
    key = _keys(tokens, lengths)  # (N, T)
    same = torch.zeros_like(key, dtype=torch.bool)
    same[1:] = (key[1:] == key[:-1]) & (owner[1:] == owner[:-1])[:, None]
    return same.long().cumprod(dim=1).sum(dim=1)


def new_nodes(tokens: Tensor, owner: Tensor, lengths: Tensor) -> Tensor:
    """(N,) the nodes each row adds to the tree of the rows before it; in `sort_rows` order, the rows a..b have
    lengths[a] + sum(new_nodes[a + 1:b + 1]) nodes (a longer shared prefix would run through the rows between)."""
    return lengths - torch.minimum(common_prefix(tokens, owner, lengths), lengths)


def build(tokens: Tensor, owner: Tensor, lengths: Tensor, coefficients: Tensor,
          layout: Shape | None = None) -> PrefixTree:
    """The tree of rows tokens (N, T) with their sources, scored lengths and coefficients (N,) (or a
    `tokenweights.ChunkLoss` over the N rows: each node's weight then sums the derivatives of the rows' positions
    that read it).

    Exact for rows in any order: row i opens new nodes from depth common_prefix[i] on and shares the previous
    row's nodes above it. Sorted rows (`sort_rows`) share every prefix they have in common. `layout`: the
    tree's `shape` where the caller knows it on the host (phase two's plan), so that nothing is read back from
    the device; without it, the rows' lengths, prefixes and sources are read once."""
    common = common_prefix(tokens, owner, lengths)  # (N,)
    if layout is None:
        layout = shape(*torch.stack([lengths, common, owner.to(lengths.dtype)]).tolist()) if len(lengths) \
            else Shape([0], 0, [])
    offsets, T = layout.offsets, len(layout.offsets) - 1
    M, P = offsets[-1], layout.positions
    tokens = tokens[:, :T]
    steps = torch.arange(T, device=tokens.device)
    active = steps[None, :] < lengths[:, None]  # (N, T) positions the rows score
    opens = active & (steps[None, :] >= common[:, None])  # (N, T); the first row's common is 0
    index = opens.long().cumsum(dim=0) - 1  # (N, T) row i's node among depth t's nodes (where active)
    per_depth = opens.sum(dim=0)  # (T,)
    base = per_depth.cumsum(0) - per_depth  # (T,) offsets[:-1], computed where the nodes are
    # (M, 2) (depth, row) of every node, depth-major, rows in order = node order; M known, so no size read
    depth, row = _nonzero(opens.t(), M).unbind(1)  # (M,) each
    parent = torch.where(depth > 0, index[row, (depth - 1).clamp_min(0)], torch.zeros_like(row))
    # every active position adds its row's coefficient to its node: weights summed over the rows through it
    pos_row, pos_col = _nonzero(active, P).unbind(1)  # (P,) each, row-major
    at = base[pos_col] + index[pos_row, pos_col]  # (P,) global node of each scored position
    if isinstance(coefficients, Tensor):
        weights = coefficients.new_zeros(M).index_add_(0, at, coefficients.index_select(0, pos_row))
    else:
        weights = coefficients.at(pos_row, pos_col, node=at, size=M)
    node_owner = owner.index_select(0, row)  # (M,)
    level_owners = [owners.declare(node_owner[offsets[t]:offsets[t + 1]], layout.groups[t]) for t in range(T)]
    return PrefixTree(tokens=tokens[row, depth], owner=node_owner, parent=parent, weights=weights,
                      offsets=offsets, positions=P, level_owners=level_owners)


def _nonzero(mask: Tensor, size: int) -> Tensor:
    """(size, 2) the indices of mask's `size` True entries, row-major, their count known on the host, so nothing
    is read back (`nonzero_static`); a torch without it for this device reads the count (`nonzero`)."""
    try:
        return mask.nonzero_static(size=size)
    except (NotImplementedError, RuntimeError):
        return mask.nonzero()


def step_loss(model, enc, nodes: PrefixTree) -> Tensor:
    """sum_nodes weight * log p(node's token | its prefix), with a graph, through the model's `step` only: each
    depth's states are the previous depth's selected by parent (`nested.select_rows`). Nodes of weight exactly zero
    add nothing (a -inf log-probability there would otherwise make 0 * -inf = nan). With a token-level
    objective's weights, its loss at the nodes' log-probabilities."""
    if callable(nodes.weights):
        return nodes.weights.autograd(step_log_probs(model, enc, nodes))
    prev = nodes.inputs(model.bos_id)  # (M,)
    state, total = None, None
    for t in range(nodes.depth):
        here = nodes.level(t)
        owner = nodes.level_owner(t)  # (n_t,)
        state = model.init_state(enc, owner) if t == 0 else nested.select_rows(state, nodes.parent[here])
        state, log_probs = model.step(enc, owner, prev[here], state)  # (n_t, V)
        # summed in at least float32: autocast's bf16 log-probabilities would round the weights to 8 bits
        tok = log_probs.gather(1, nodes.tokens[here, None]).squeeze(1)  # (n_t,)
        tok = tok.to(torch.promote_types(tok.dtype, torch.float32))
        w = nodes.weights[here].to(tok.dtype)
        term = torch.where(w != 0, w * tok, torch.zeros_like(tok)).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros((), device=nodes.tokens.device)
    return total


def step_log_probs(model, enc, nodes: PrefixTree) -> Tensor:
    """(M,) log p(node's token | its prefix) with a graph, through `step` depth by depth (as `step_loss`)."""
    prev = nodes.inputs(model.bos_id)  # (M,)
    state, levels = None, []
    for t in range(nodes.depth):
        here = nodes.level(t)
        owner = nodes.level_owner(t)  # (n_t,)
        state = model.init_state(enc, owner) if t == 0 else nested.select_rows(state, nodes.parent[here])
        state, log_probs = model.step(enc, owner, prev[here], state)  # (n_t, V)
        levels.append(log_probs.gather(1, nodes.tokens[here, None]).squeeze(1))  # (n_t,)
    return torch.cat(levels) if levels else torch.zeros(0, device=nodes.tokens.device)
