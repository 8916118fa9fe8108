"""Phase two: teacher-forced re-decoding of phase one's candidates, in chunks, with gradients.

For per-sequence coefficients c (fixed numbers from phase one) the surrogate loss is
    L = sum_i c_i * log p(y_i | x_owner(i)),
and since c carries no gradient, dL/dtheta is a sum over rows: each chunk of rows can be decoded,
back-propagated and freed before the next begins. The encoder is shared by all chunks, so its outputs are cut
out of the graph (`Encoded.detached`), the chunks accumulate the gradient at that boundary, and the encoder is
back-propagated once at the end. The result equals one backward over all rows, whatever the chunk size.

On a GPU a chunk's gradient is computed with `torch.autograd.grad` and only then added to `.grad`: if the GPU
runs out of memory half-way through a chunk, nothing of it has been accumulated, so the chunk is redone at half
the size and the step's gradient stays exact. That costs a second, transient copy of the gradients (which
`--memory-budget` counts: `collected_bytes`). Where no
out-of-memory error can be caught and retried (the CPU, whose allocator failures are not CUDA's), autograd adds
each chunk's gradient straight into `.grad` instead, and the output layer's by hand into the same tensors.

Candidates of one source share long prefixes, so by default a chunk is decoded as its rows' prefix tree
(`twophase.phase2.prefixtree`): each distinct (source, prefix) once, weighted by the summed coefficients of the rows
through it; the loss and gradient are the rows' own. Rows are sorted so that those sharing a prefix fall in one
chunk, and chunks are sized in decoded positions (nodes), so the graph is bounded as before.

A model may do a chunk's forward and backward itself (`weighted_tree_backward` over the tree, or
`weighted_score_backward` over rows, see `twophase.protocol`): the built-in LSTM differentiates its output layer
by hand, computing each V-sized logit block once. Otherwise autograd differentiates `step` run depth by depth
over the tree, or, for a model with its own `score` (perhaps one parallel pass), `score` over the rows.

A token-level objective (`twophase.objectives.policy.PolicyLoss`, in place of the coefficients) makes each position's
loss a function of its current log-probability, with every normaliser a constant of the whole batch; the loss
is still a sum over rows, so the chunks stay exact. Each chunk gets it as a `tokenweights.ChunkLoss`: the by-hand
paths read each block's weights from the log-probs they have just computed, a tree node's weight summing the
derivatives of the rows through it; autograd differentiates the objective at the per-token log-probs of `step`
(depth by depth over the tree) or of the model's `token_scores`.

Every chunk's sizes (its rows, its tree's nodes per depth, each depth's owner layout) come from a plan made on
the host from one read of the rows' lengths, shared prefixes and sources per batch, and the chunks' losses are
summed on the device: a chunk makes the host wait only for what its model reads (the LSTM: one size).

Letters: B sources, N candidate rows, C rows per chunk, T target length, M prefix-tree nodes.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .. import nested, oom, owners, protocol
from ..samples import Samples
from . import deferral, prefixtree, tokenweights
from .chunkplan import ChunkPlan
from .tokenweights import DecodesChunks, TokenObjective, UnboundObjective


def rescore_backward(model, source, samples: Samples, coefficients: Tensor | TokenObjective | UnboundObjective,
                     chunk_size: int, profiler=None,
                     oom_retry: bool | None = None, keep_mode: bool = False, prefix_sharing: bool = True,
                     stats: dict | None = None) -> float:
    """Accumulate into .grad the gradient of sum_i coefficients[i] * log p(samples.tokens[i] | source[owner[i]]),
    decoding a chunk at a time. Returns the value of that sum. `coefficients` may instead be a token-level
    objective over the rows (a `tokenweights.TokenObjective`, e.g. `twophase.objectives.policy.policy_loss`): the
    gradient and value are then its loss's; or an `UnboundObjective`, bound to the batch here, such as a
    teacher's divergence (`twophase.objectives.distillation`): the teacher encodes the sources once and decodes
    each chunk's rows (`DecodesChunks`), in evaluation mode and without a graph. Anything else that is not
    numbers is refused with a TypeError naming the methods it lacks.

    With prefix_sharing (where the model decodes through a prefix tree, see `shares_prefixes`), the rows are
    sorted so that each source's rows sharing a prefix are neighbours, and a chunk decodes each distinct
    (source, prefix) of its rows once: it holds as many rows as have at most chunk_size * T distinct prefixes
    (T the longest row), the steps chunk_size full-length rows decode without sharing, so the graph stays
    within the same bound. Without it, a chunk is at most chunk_size rows, each decoded from its first token.

    The samples and coefficients are moved to the device of the model's encoder output (rows built on the CPU
    for a model on a GPU, say). On CUDA out-of-memory inside a chunk (`oom.is_out_of_memory`: cuBLAS's allocation
    failures too), the chunk is freed and redone at half the size (down to one row). oom_retry (default: on where the encoder output is on CUDA) chooses that retry-safe
    accumulation; off, an out-of-memory error propagates and the chunk's gradient goes straight into .grad,
    saving a chunk-time copy of the gradients.
    The model runs in evaluation mode, as search ran it, unless keep_mode (e.g. MLE rows with dropout).
    `profiler` (optional, see twophase.system.profiling) gets a section per encoder pass and per chunk. `stats`
    (optional dict) gets "rows", "chunks", "positions" (token positions the rows score) and "nodes" (positions
    decoded: the distinct prefixes, or every position without sharing) added to its counts; with a token-level
    objective also "tokens", "clip_low", "clip_high" (positions clipped, TRL's definitions) and "kl" (summed k3).
    An objective whose weights need each row's sums (`needs_row_statistics`: the sequence-level ratio, VESPO, the
    off-policy mask, the high-entropy mask's entropies) gets them from a pass without a graph over the same chunks
    first (`_with_row_statistics`), which raises out-of-memory errors rather than retrying (it holds no graph).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(coefficients, UnboundObjective):  # a teacher's divergence: its encoder once, no graph
        coefficients = coefficients.bind(model, source, samples)
    coefficients, token_level = _checked(coefficients, len(samples), samples.tokens.device)
    # Rows with a zero coefficient add nothing to the gradient (e.g. every candidate of a source equally good).
    live = (coefficients.live() if token_level else coefficients != 0).nonzero().squeeze(1)  # (N',)
    if len(live) == 0:
        return 0.0
    samples, coefficients = samples.select(live), coefficients[live]
    section = profiler.section if profiler is not None else (lambda name: contextlib.nullcontext())
    with torch.enable_grad(), protocol.scoring_mode(model, keep=keep_mode):
        with section("phase 2: encoder forward"):
            enc = model.encode(source)
        # the rows go where the model computes (samples or coefficients built on the CPU for a model on a GPU)
        device = nested.device_of(enc)
        samples, coefficients = nested.map_tensors(lambda x: x.to(device), (samples, coefficients))
        plan = ChunkPlan(model, samples, prefix_sharing and shares_prefixes(model))
        samples, coefficients = plan.samples, coefficients[plan.order] if plan.tree else coefficients
        if max(plan.owners) >= protocol.num_sources(enc):
            raise ValueError(f"samples.owner names source {max(plan.owners)}, but the source holds "
                             f"{protocol.num_sources(enc)}")
        if oom_retry is None:
            oom_retry = retries_out_of_memory(device)
        counts = {"rows": len(samples), "chunks": 0, "positions": plan.positions, "nodes": 0}
        if token_level:
            counts.update(tokens=0, clip_low=0, clip_high=0, kl=0.0, entropy=0.0, entropy_tokens=0.0)
        boundary = nested.cut_floating(enc)
        if token_level and coefficients.needs_row_statistics():  # the sequence-level ratio's row sums
            with section("phase 2: row statistics"):
                coefficients = _with_row_statistics(model, boundary, samples, coefficients, plan, chunk_size)
        params = [p for p in model.parameters() if p.requires_grad]
        # the chunks' losses summed where they are computed, read once at the end (not a host sync per chunk)
        total = torch.zeros((), dtype=torch.float64, device=device)
        start, size, sums = 0, chunk_size, {}
        while start < len(samples):
            end, nodes = plan.chunk(start, size)
            failed = False
            try:
                with section(f"phase 2: chunk of {end - start} rows" + (f", {nodes} nodes" if plan.tree else "")):
                    loss = _chunk(model, boundary, samples, coefficients, plan, slice(start, end), params,
                                  oom_retry, counts)
            except Exception as err:  # noqa: BLE001  (any error but out-of-memory is raised again)
                if not oom.is_out_of_memory(err) or size == 1 or not oom_retry:
                    raise
                failed = True
            if failed:  # out of the except block: its traceback, holding the failed chunk's graph, is gone
                size //= 2
                oom.release()
                continue
            total = total + loss.detach().to(total.dtype)
            _bank_boundary_grads(boundary, sums)
            start = end
            counts["chunks"] += 1
            counts["nodes"] += nodes
        with section("phase 2: encoder backward"):
            _encoder_backward(enc, boundary, sums)
    if stats is not None:
        for key, value in _read_counts(counts).items():
            stats[key] = stats.get(key, 0) + value
    return float(total)


def _read_counts(counts: dict) -> dict:
    """The counts with a token-level objective's device sums (clipped positions, summed KL) read back at once."""
    on_device = [key for key, value in counts.items() if isinstance(value, Tensor)]
    if not on_device:
        return counts
    values = torch.stack([counts[key].to(torch.float64) for key in on_device]).tolist()  # one host read
    return {**counts, **{key: value if key in ("kl", "entropy") else int(round(value)) for key, value in zip(on_device, values)}}


def _with_row_statistics(model, enc, samples: Samples, objective, plan: "ChunkPlan", size: int):
    """The objective with its rows' statistics (`PolicyLoss.row_statistic_terms` summed over each row's scored
    positions): a pass without a graph over the plan's chunks, each chunk's rows scored by the model's
    per-token log-probabilities (rows, never the (C, T, V) logits a model's own token_scores avoids)."""
    parts, entropies, start, width = [], [], 0, samples.tokens.shape[1]
    with torch.no_grad():
        while start < len(samples):
            end, _ = plan.chunk(start, size)
            rows = slice(start, end)
            T = plan.longest(rows)
            owner = owners.declare(samples.owner[rows], plan.groups(rows))
            if objective.needs_entropies():  # whole distributions: `step`, one (C, V) at a time
                tok, ent = _step_scores_and_entropies(model, enc, samples.tokens[rows, :T], owner)  # (C, T) each
                entropies.append(torch.nn.functional.pad(ent, (0, width - T)))
            else:
                tok = protocol.token_scores(model, enc, samples.tokens[rows, :T], owner)  # (C, T)
            C = tok.shape[0]
            at = torch.arange(T, device=tok.device)
            scored = (at[None, :] < samples.lengths[rows, None]).reshape(-1, 1)  # (C * T, 1)
            row, col = torch.arange(C, device=tok.device).repeat_interleave(T), at.repeat(C)  # (C * T,) each
            terms = objective[rows].row_statistic_terms(tok.reshape(-1), row, col)  # (C * T, 4)
            parts.append(torch.where(scored, terms, torch.zeros_like(terms)).reshape(C, T, -1).sum(1))  # (C, 4)
            start = end
    objective = objective.with_row_statistics(torch.cat(parts))
    if entropies:
        at = torch.arange(width, device=samples.lengths.device)
        objective = objective.with_entropies(torch.cat(entropies), at[None, :] < samples.lengths[:, None])
    return objective


def _step_scores_and_entropies(model, enc, tokens: Tensor, owner: Tensor) -> tuple[Tensor, Tensor]:
    """((C, T) log p of tokens, (C, T) the entropy of each position's next-token distribution), teacher-forced
    by `step` without a graph (0 past each row's end)."""
    toks, ents = [], []
    for tok, scored, log_probs in protocol.teacher_forced_steps(model, enc, tokens, owner):  # (C,), (C,), (C, V)
        log_probs = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))
        ent = tokenweights.entropy(log_probs)  # (C,)
        toks.append(tok.to(log_probs.dtype))
        ents.append(torch.where(scored, ent, torch.zeros_like(ent)))
    return torch.stack(toks, 1), torch.stack(ents, 1)


def retries_out_of_memory(device: torch.device) -> bool:
    """oom_retry's default on `device`: on for CUDA, whose out-of-memory errors can be caught and the chunk redone.
    It costs a chunk-time copy of the trainable parameters' gradients (`collected_bytes`)."""
    return torch.device(device).type == "cuda"


def collected_bytes(model) -> int:
    """Bytes of the chunk-time gradient copy oom_retry makes: one gradient per trainable parameter."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _checked(coefficients, n: int, device):
    """(coefficients as a (n,) tensor on device, False), or (a token-level objective of n rows, True)."""
    if isinstance(coefficients, TokenObjective):
        if len(coefficients) != n:
            raise ValueError(f"expected an objective of {n} rows, got {len(coefficients)}")
        return coefficients, True
    # an objective with a method missing would otherwise fail deep in a chunk, or be read as numbers
    if any(callable(getattr(coefficients, name, None)) for name in ("live", "needs_row_statistics", "derivative",
                                                                    "decoded")):
        raise TypeError(f"{type(coefficients).__name__} is not a TokenObjective (twophase.phase2.tokenweights): "
                        f"it lacks {', '.join(tokenweights.missing(coefficients))}")
    try:
        coefficients = torch.as_tensor(coefficients, device=device)
    except (TypeError, RuntimeError, ValueError):
        raise TypeError(f"coefficients must be {n} numbers or a TokenObjective (twophase.phase2.tokenweights); "
                        f"{type(coefficients).__name__} lacks {', '.join(tokenweights.missing(coefficients))}") \
            from None
    if coefficients.shape != (n,):
        raise ValueError(f"expected {n} coefficients, got shape {tuple(coefficients.shape)}")
    if not bool(torch.isfinite(coefficients).all()):  # a NaN would reach every parameter's .grad silently
        bad = int((~torch.isfinite(coefficients)).nonzero()[0])
        raise ValueError(f"coefficients must be finite; row {bad} is {float(coefficients[bad])}")
    return coefficients, False


def shares_prefixes(model) -> bool:
    """Whether phase two decodes the model's rows as a prefix tree: a model with `weighted_tree_backward` (the
    built-in LSTM), or one with only `step` (its rows would be decoded by `step` anyway). A model with its own
    `score` or `weighted_score_backward` keeps its rows: its teacher-forced pass may be one parallel forward (a
    transformer), which decoding step by step would slow down."""
    if callable(getattr(model, "weighted_tree_backward", None)):
        return True
    return getattr(model, "weighted_score_backward", None) is None and getattr(model, "score", None) is None


def _encoder_backward(enc, boundary, sums: dict) -> None:
    """The encoder's graph, once, from the gradients the chunks left at its cut outputs."""
    outputs, grads = [], []
    for i, (x, leaf) in enumerate(zip(nested.floating(enc), nested.floating(boundary))):
        g = sums[i].to(x.dtype) if i in sums else leaf.grad
        if g is not None and x.requires_grad:
            outputs.append(x)
            grads.append(g)
    if outputs:
        torch.autograd.backward(outputs, grads)


def _bank_boundary_grads(boundary, sums: dict) -> None:
    """Under autocast the encoder outputs, hence their leaves' .grad, are 16-bit: summed over many chunks they
    would round at every addition, so each chunk's share moves into a float32 sum (sums: index -> tensor)."""
    for i, leaf in enumerate(nested.floating(boundary)):
        if leaf.grad is not None and leaf.grad.dtype in (torch.float16, torch.bfloat16):
            g = leaf.grad.float()
            sums[i] = sums[i].add_(g) if i in sums else g
            leaf.grad = None


def _chunk(model, boundary, samples: Samples, coefficients, plan: ChunkPlan, rows: slice, params, collect: bool,
           counts: dict) -> Tensor:
    """Decode rows (as their prefix tree with plan.tree), then add d(sum c_i log p_i)/d(params, boundary) into
    their .grad; returns the sum (0-dim, on the device). With collect, the whole chunk's gradient exists before
    any of it is added (see the module docstring). A token-level objective's statistics go into counts once the
    chunk succeeded. Every size comes from the plan: nothing is read back from the device here."""
    inputs = params + [x for x in nested.floating(boundary) if x.requires_grad]
    c = coefficients[rows]
    if isinstance(c, DecodesChunks):  # a teacher's states at the chunk's positions, without a graph
        c = c.decoded(samples.tokens[rows, :plan.longest(rows)], samples.owner[rows])
    if not isinstance(c, Tensor):
        c = tokenweights.ChunkLoss(c)  # this attempt's loss and statistics (an OOM retry starts afresh)
    if plan.tree:
        nodes = prefixtree.build(samples.tokens[rows], samples.owner[rows], samples.lengths[rows], c,
                                 plan.shape(rows))
        loss, grads = tree_gradients(model, boundary, nodes, inputs, collect)
    else:
        T = plan.longest(rows)  # no steps past the chunk's longest row
        owner = owners.declare(samples.owner[rows], plan.groups(rows))
        loss, grads = chunk_gradients(model, boundary, samples.tokens[rows, :T], owner, c, inputs, collect)
    if isinstance(c, tokenweights.ChunkLoss):
        for key, value in c.sums.items():
            counts[key] += value
    with torch.no_grad():
        for x, g in zip(inputs, grads):
            if g is None:
                continue
            if x.grad is None:
                x.grad = g
            else:
                x.grad.add_(g)
    return loss


def tree_gradients(model, enc, nodes: prefixtree.PrefixTree, inputs: list, collect: bool):
    """loss = sum_nodes weight * log p(node) (= sum_i c_i log p_i of the rows the tree was built from) and, with
    collect, its gradients with respect to inputs (without, they go into .grad and the list is empty): the
    model's `weighted_tree_backward`, or autograd through `step` run depth by depth (`prefixtree.step_loss`)."""
    by_hand = getattr(model, "weighted_tree_backward", None)
    if callable(by_hand):
        return by_hand(enc, nodes, inputs, collect)
    return _autograd(lambda: prefixtree.step_loss(model, enc, nodes), inputs, collect)


def chunk_gradients(model, enc, tokens: Tensor, owner: Tensor, c: Tensor, inputs: list, collect: bool):
    """loss = sum_i c_i log p(tokens[i] | enc[owner[i]]) and, with collect, its gradients with respect to inputs
    (without, they go into .grad and the list is empty): the model's `weighted_score_backward`, or autograd
    through its `score` (through `step` where it has none)."""
    by_hand = getattr(model, "weighted_score_backward", None)
    if by_hand is not None:
        return by_hand(enc, tokens, owner, c, inputs, collect)
    if isinstance(c, tokenweights.ChunkLoss):  # the objective at the per-token log-probs (C, T)
        row, col = protocol.target_mask(tokens, model.pad_id, model.eos_id).nonzero(as_tuple=True)  # (P,) each
        return _autograd(lambda: c.terms(protocol.token_scores(model, enc, tokens, owner)[row, col], row, col),
                         inputs, collect)

    def loss():
        log_p = protocol.score(model, enc, tokens, owner)  # (C,)
        return (c.to(log_p.dtype) * log_p).sum()
    return _autograd(loss, inputs, collect)


def _autograd(loss_fn, inputs: list, collect: bool):
    """loss_fn() and, with collect, its gradients with respect to inputs (without, they go into .grad and the list
    is empty), its per-step weight gradients summed once (`deferral`)."""
    with deferral.Deferred(inputs) as deferred:
        loss = loss_fn()
    if not loss.requires_grad:  # nothing in the chunk depends on a parameter (e.g. every weight zero)
        return loss, []
    if collect:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # frees this chunk's graph
        return loss, deferred.add(inputs, grads, collect)
    loss.backward(inputs=inputs)
    deferred.add(inputs, [], collect)
    return loss, []
