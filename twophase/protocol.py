"""`SequenceModel`: all that phase one, phase two, the one-phase baseline and validation call on a model.

Three ids and three methods make a model; two optional methods make it faster:

    pad_id, bos_id, eos_id                        ints: the model's special ids (nothing assumes 0/1/2)
    encode(source) -> enc                         once per batch of B sources
    init_state(enc, owner) -> state               the decoder state of N rows
    step(enc, owner, prev, state) -> (state, log_probs)
    score(enc, tokens, owner) -> (N,)             optional: teacher-forced log p, with gradients
    token_scores(enc, tokens, owner) -> (N, T)    optional: the same per position (0 past a row's end); what
                                                  a token-level objective differentiates where no fast path is
    position_log_probs(enc, tokens, owner) -> (N, T, V)
                                                  optional: the next-token log-probabilities at every position
                                                  of `score`'s pass (`twophase.constraints` renormalises them)
    weighted_score_backward(enc, tokens, owner, coefficients, inputs, collect) -> (loss, grads)
                                                  optional: phase two's chunk done by the model (see below)
    weighted_tree_backward(enc, nodes, inputs, collect) -> (loss, grads)
                                                  optional: the same over a chunk's prefix tree (`phase2.prefixtree`)

`step` (and `advance`) may consume the `state` it is given: the library passes each state to the model once
and never reads it afterwards, so a model may free its tensors early (the Hugging Face wrappers empty it, so
that a step holds one copy of a key/value cache rather than the old and the new).

`source` is whatever the task's batches hold: the pair (src, src_lengths) for the built-in `Seq2Seq`, a
tokenizer's dict, a float tensor of grids. `enc` and `state` are trees (`twophase.nested`): a tensor, tuple, list,
dict or dataclass of tensors, of any dtypes and shapes, whose leading dimension is B for `enc` and N for `state`.
Search reorders `state` by selecting rows; phase two cuts every floating tensor of `enc` out of the graph and
back-propagates the encoder once per step.

Letters: B sources, N rows, T target length, V vocabulary.
    owner (N,)      long: each row's source, an index into the B sources of `enc`
    prev (N,)       long: the previous tokens (bos_id at the first step)
    log_probs (N, V) normalised log-probabilities of the next token
    tokens (N, T)   candidate rows: tokens, then eos_id (when produced), then pad_id; never bos_id. A row ends at
                    its first eos_id, so pad_id may equal eos_id (as in GPT-2), and so may bos_id (BART's decoder
                    start token is its eos).

Search never proposes pad_id or bos_id unless it is eos_id (a model should give them probability zero); a
candidate's score is the sum of its tokens' log-probabilities, which `score` must reproduce: both phases call the
model's own functions, in evaluation mode (no dropout) unless told otherwise.

`weighted_score_backward` lets a model differentiate its output layer by hand (the built-in LSTM computes each
V-sized logit block once instead of twice): given coefficients c (C,) it returns loss = sum_i c_i log p_i (a
0-dim tensor) and, with `collect`, the gradients of that loss with respect to `inputs` (a list aligned with
`inputs`, None where unused); without `collect` it adds them into each input's .grad itself and returns [].
`weighted_tree_backward` does the same for loss = sum_nodes nodes.weights * log p(node's token | its prefix),
each distinct (source, prefix) of the chunk's rows decoded once; without it, phase two runs `step` depth by
depth over the tree, unless the model has its own `score` or `weighted_score_backward` (then it scores rows).
With a token-level objective (`twophase.objectives.policy`) the coefficients are a `tokenweights.ChunkLoss` and
`nodes.weights` a function of the nodes' log-probabilities: a by-hand path gets each position's weight from
`tokenweights.weights(c, row, col, dtype)` (a tensor, or a function to call on a block's log-probs, as
`outputlayer.target_log_probs_and_grads` does) and its loss from `tokenweights.loss` / `weighted_sum`.

A model that splits `step` into `advance(enc, owner, prev, state) -> state` and `log_probs(state) -> (N, V)`
lets beam search build its (rows, V) candidate scores a block of sources at a time (a wide beam's largest
temporaries); `vocab_size`, where present, sizes those blocks before the first one is computed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from . import nested
from .errors import OneLineError


class ModelError(OneLineError, ValueError):
    """A model broke the protocol (NaN log-probabilities, wrong shapes, ...): one line per broken rule, naming
    the model (see `twophase.check_model`)."""


def model_name(model: Any) -> str:
    return type(model).__name__


@runtime_checkable
class SequenceModel(Protocol):
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, source: Any) -> Any:
        """The encoder output for B sources: a tree of tensors with leading dimension B."""

    def init_state(self, enc: Any, owner: Tensor) -> Any:
        """The initial decoder state of N rows, row i decoding source owner[i]: a tree of (N, ...) tensors."""

    def step(self, enc: Any, owner: Tensor, prev: Tensor, state: Any) -> tuple[Any, Tensor]:
        """Consume prev (N,) and return the new state and the next token's log-probabilities (N, V)."""


def target_mask(tokens: Tensor, pad_id: int, eos_id: int) -> Tensor:
    """(N, T) True at the positions a row scores: its tokens up to and including its first eos_id."""
    is_eos = tokens == eos_id
    eos_before = is_eos.long().cumsum(1) - is_eos.long()  # (N, T) EOS strictly before each position
    return (eos_before == 0) & ((tokens != pad_id) | is_eos)


def teacher_forced_inputs(tokens: Tensor, bos_id: int) -> Tensor:
    """(N, T) the token each position is predicted from: bos_id, then the row shifted right by one."""
    bos = torch.full_like(tokens[:, :1], bos_id)
    return torch.cat([bos, tokens[:, :-1]], dim=1)


def teacher_forced_steps(model: SequenceModel, enc: Any, tokens: Tensor,
                         owner: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """For t = 0, 1, ..., T - 1: ((N,) log p(tokens[i, t] | source owner[i], tokens[i, :t]), 0 where row i does
    not score t; (N,) whether it does; (N, V) the whole next-token log-distribution), by running `step` over the
    rows teacher-forced: the one loop behind `step_token_scores`, `step_score` and phase two's entropies."""
    mask = target_mask(tokens, model.pad_id, model.eos_id)  # (N, T)
    prev = teacher_forced_inputs(tokens, model.bos_id)  # (N, T)
    state = model.init_state(enc, owner)
    for t in range(tokens.shape[1]):
        state, log_probs = model.step(enc, owner, prev[:, t], state)  # (N, V)
        tok = log_probs.gather(1, tokens[:, t:t + 1]).squeeze(1)  # (N,)
        yield torch.where(mask[:, t], tok, torch.zeros_like(tok)), mask[:, t], log_probs  # a pad may read -inf


def step_token_scores(model: SequenceModel, enc: Any, tokens: Tensor, owner: Tensor) -> Tensor:
    """(N, T) log p(tokens[i, t] | source owner[i], tokens[i, :t]) by running `step` over the rows,
    teacher-forced, 0 past each row's end: the very numbers search computed."""
    columns = [tok for tok, _, _ in teacher_forced_steps(model, enc, tokens, owner)]  # T of (N,)
    return torch.stack(columns, 1) if columns else torch.zeros(len(owner), 0, device=tokens.device)


def step_score(model: SequenceModel, enc: Any, tokens: Tensor, owner: Tensor) -> Tensor:
    """(N,) log p(tokens[i] | source owner[i]) by running `step` over the rows, teacher-forced: the default
    `score` of a model that has none, with the very numbers search summed, in its order (left to right)."""
    total = None
    for tok, _, _ in teacher_forced_steps(model, enc, tokens, owner):
        total = tok if total is None else total + tok
    return total if total is not None else torch.zeros(len(owner), device=tokens.device)


def token_scores(model: SequenceModel, enc: Any, tokens: Tensor, owner: Tensor) -> Tensor:
    """(N, T) teacher-forced per-token log-probabilities with gradients, 0 past each row's end: the model's
    `token_scores`, or `step_token_scores`."""
    own = getattr(model, "token_scores", None)
    return own(enc, tokens, owner) if own is not None else step_token_scores(model, enc, tokens, owner)


def score(model: SequenceModel, enc: Any, tokens: Tensor, owner: Tensor) -> Tensor:
    """(N,) teacher-forced log-probabilities with gradients: the model's `score`, or `step_score`."""
    own = getattr(model, "score", None)
    return own(enc, tokens, owner) if own is not None else step_score(model, enc, tokens, owner)


def num_sources(enc: Any) -> int:
    return nested.leading_size(enc)


@contextlib.contextmanager
def eval_mode(model: Any):
    """The model in evaluation mode (no dropout) for the block, then every module back in the mode it had, also
    after an exception: what records no graph (search, validation, decoding, a reference's scores). Its
    recurrent modules run in evaluation mode too, with cuDNN's inference kernels; a graph through them is
    `scoring_mode`'s."""
    modules = all_modules(model)
    was = [m.training for m in modules]
    if any(was):
        for top in _tops(model):
            top.train(False)
    try:
        yield
    finally:
        if any(was):
            for module, training in zip(modules, was):  # each its own: a frozen part stays frozen
                module.training = training


@contextlib.contextmanager
def scoring_mode(model: Any, keep: bool = False):
    """`eval_mode` for a block that records a graph (phase two, the one-phase baseline, the chunk-size probe):
    search and phase two must score with one function, or search scores stop being the log-probabilities phase
    two differentiates; `keep=True` leaves the modes alone (the MLE steps' dropout, where no search scored).

    Either way every recurrent module (nn.LSTM, nn.GRU, nn.RNN) that would run in evaluation mode runs in
    training mode with its dropout at 0 instead (`recurrent_training_mode`): the same arithmetic, and the one
    mode cuDNN back-propagates through."""
    with contextlib.nullcontext() if keep else eval_mode(model), recurrent_training_mode(model):
        yield


def _tops(model: Any) -> list[torch.nn.Module]:
    """The model itself if it is an nn.Module, else its nn.Module attributes (a plain object holding modules)."""
    if isinstance(model, torch.nn.Module):
        return [model]
    return [v for v in vars(model).values() if isinstance(v, torch.nn.Module)] if hasattr(model, "__dict__") else []


def all_modules(model: Any) -> list[torch.nn.Module]:
    """Every nn.Module of a model: its own tree, or that of each nn.Module attribute of a plain object."""
    return list({id(m): m for top in _tops(model) for m in top.modules()}.values())


@contextlib.contextmanager
def recurrent_training_mode(model: Any):
    """Every nn.RNNBase of the model that is in evaluation mode put in training mode with dropout 0 for the
    block, then restored (also after an exception). cuDNN refuses to back-propagate through an RNN run in
    evaluation mode ("cudnn RNN backward can only be called in training mode"), and the only difference
    between the modes of an nn.RNNBase is its inter-layer dropout, so at dropout 0 the two compute the same."""
    switched = [(m, m.dropout) for m in all_modules(model) if isinstance(m, torch.nn.RNNBase) and not m.training]
    try:
        for module, _ in switched:
            module.dropout = 0.0
            module.training = True
        yield
    finally:
        for module, dropout in switched:
            module.training = False
            module.dropout = dropout
