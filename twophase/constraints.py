"""Grammar-constrained decoding for any model: `Constrained(model, grammar)` is itself a `SequenceModel`.

Its next-token distribution is the model's renormalised over the tokens the grammar allows,
    log p'(y_t | y_<t) = log p(y_t | y_<t) - log sum_{a allowed after y_<t} p(a | y_<t)    (y_t allowed)
    log p'(y_t | y_<t) = -inf                                                             (y_t not allowed),
so search, phase two and validation use it like any model: search never proposes a disallowed token (it has
probability zero), its scores are p' (the wrapper's own `step`), and phase two differentiates the same p'.

A grammar is three methods on trees of tensors (`twophase.nested`), so search reorders its state as a model's:
    start(owner) -> gstate            the automaton state of N rows (owner (N,): each row's source)
    allowed(gstate) -> (N, V) bool    the tokens that may come next; eos_id where the sequence may end
    advance(gstate, tokens) -> gstate consume tokens (N,)
`advance` must accept any token without failing (a disallowed one may lead anywhere, a sink state say): beam
search extends impossible hypotheses (score -inf) by arbitrary tokens, and rows that ended are given their
padding. The wrapper tracks which rows ended (consumed eos_id) or died (consumed a disallowed token) and reads
the grammar only for the others; no grammar sees bos_id.

Edge cases, both without NaN:
- A live row where the grammar allows no token is the grammar's error (every state an allowed prefix reaches
  must allow eos_id or a continuation): `GrammarError`, raised by search and scoring alike.
- A row whose allowed tokens all have model probability zero (the model masks them) has no distribution to
  renormalise: all its tokens get -inf, so the prefix is impossible. Beam search drops such rows, the sampler
  ends them and drops them too, and a teacher-forced row through there scores -inf (its gradient stays finite).

Optional methods, where the model has them: `advance`/`log_probs` (beam search's blocked path), `vocab_size`,
and `score`/`position_log_probs` when the model has `position_log_probs(enc, tokens, owner) -> (N, T, V)`: the
constrained teacher-forced log-prob is then the model's one pass, minus the log allowed mass at each position,
at the cost of T grammar steps (no gradient) and one masked log-sum-exp over (N, T, V). A model's
`weighted_score_backward`/`weighted_tree_backward` (a hand-made output-layer gradient) cannot see the mask, so
the wrapper does not offer them: phase two then decodes the rows' prefix tree through the wrapper's `step`.

The wrapper registers the model as its submodule (parameters, train/eval and devices follow), and its
`state_dict` is the model's, so a checkpoint written with a grammar loads without one and vice versa.

Letters: B sources, N rows, T target length, V vocabulary.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .errors import OneLineError
from .protocol import target_mask
from .vocab import pad_targets

LIVE, ENDED, DEAD = 0, 1, 2  # a row's phase: reading the grammar, after its eos_id, after a disallowed token


class GrammarError(OneLineError, ValueError):
    """A grammar state reached by allowed tokens allows no token at all."""


class Constrained(nn.Module):
    """`model` (a `SequenceModel`) restricted to the sequences `grammar` allows; see the module docstring."""

    def __init__(self, model, grammar):
        super().__init__()
        self.model, self.grammar = model, grammar
        self.pad_id, self.bos_id, self.eos_id = model.pad_id, model.bos_id, model.eos_id
        # Optional protocol methods, offered only where the model has what they need.
        if callable(getattr(model, "advance", None)) and callable(getattr(model, "log_probs", None)):
            self.advance, self.log_probs = self._advance, self._log_probs
        if getattr(model, "vocab_size", None) is not None:
            self.vocab_size = model.vocab_size
        if callable(getattr(model, "position_log_probs", None)):
            self.score, self.position_log_probs = self._score, self._position_log_probs
            self.token_scores = self._token_scores  # the policy objectives' one pass, not a step loop

    # ---- checkpoints hold the model's parameters only
    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    # ---- the protocol
    def encode(self, source: Any) -> Any:
        return self.model.encode(source)

    def init_state(self, enc: Any, owner: Tensor) -> dict:
        g = self.grammar.start(owner)
        return {"model": self.model.init_state(enc, owner), "grammar": g, "allowed": self._allowed(g, len(owner)),
                "phase": torch.full_like(owner, LIVE), "first": True}

    def step(self, enc: Any, owner: Tensor, prev: Tensor, state: dict) -> tuple[dict, Tensor]:
        m, logp = self.model.step(enc, owner, prev, state["model"])  # (N, V)
        state = self._consume(state, m, prev)
        return state, renormalise(logp, self._fits(state["allowed"], logp), state["phase"])

    def _advance(self, enc: Any, owner: Tensor, prev: Tensor, state: dict) -> dict:
        return self._consume(state, self.model.advance(enc, owner, prev, state["model"]), prev)

    def _log_probs(self, state: dict) -> Tensor:
        logp = self.model.log_probs(state["model"])  # (N, V)
        return renormalise(logp, self._fits(state["allowed"], logp), state["phase"])

    def _consume(self, state: dict, model_state: Any, prev: Tensor) -> dict:
        """The state after prev (N,): the model's, given; the grammar's (bos_id at the first step is not fed)."""
        g, allowed, phase = state["grammar"], state["allowed"], state["phase"]
        if not state["first"]:
            phase = next_phase(phase, allowed, prev, self.eos_id)
            g = self.grammar.advance(g, prev)
            allowed = self._allowed(g, len(prev))  # (N, V)
        return {"model": model_state, "grammar": g, "allowed": allowed, "phase": phase, "first": False}

    # ---- the grammar's masks, checked: a wrong one fails here in one line, not as a torch error in renormalise
    def _allowed(self, g: Any, rows: int, width: int | None = None) -> Tensor:
        """grammar.allowed(g): (rows, V) bool, V `width` or the model's vocabulary where it declares one; else
        GrammarError naming the grammar and what it returned (shape and dtype only: nothing is read from the
        device)."""
        mask = self.grammar.allowed(g)
        width = width if width is not None else getattr(self, "vocab_size", None)
        if (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() == 2 and mask.shape[0] == rows
                and (width is None or mask.shape[1] == width)):
            return mask
        got = (f"a {mask.dtype} tensor of shape {tuple(mask.shape)}" if isinstance(mask, Tensor)
               else f"a {type(mask).__name__}")
        raise GrammarError(f"grammar {type(self.grammar).__name__}: allowed() must return a ({rows}, "
                           f"{width if width is not None else 'V'}) torch.bool tensor (one row per row of the "
                           f"state, one column per token), got {got}")

    def _fits(self, allowed: Tensor, logp: Tensor) -> Tensor:
        """`allowed` where its width is the model's log-probabilities' (a model without vocab_size)."""
        if allowed.shape[-1] != logp.shape[-1]:
            raise GrammarError(f"grammar {type(self.grammar).__name__}: allowed() returned {allowed.shape[-1]} "
                               f"columns, the model scores {logp.shape[-1]} tokens")
        return allowed

    # ---- teacher forcing through the model's one pass
    def masks(self, tokens: Tensor, owner: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
        """(N, T, V) the allowed tokens at every position of rows tokens (N, T), and (N, T) the rows' phases
        there: the grammar run over the rows, without gradients; `width`: V where the model declares none."""
        with torch.no_grad():
            g = self.grammar.start(owner)
            phase = torch.full_like(owner, LIVE)
            allowed, phases = [], []
            for t in range(tokens.shape[1]):
                if t:
                    g = self.grammar.advance(g, tokens[:, t - 1])
                here = self._allowed(g, len(owner), width)  # (N, V)
                allowed.append(here)
                phases.append(phase)
                phase = next_phase(phase, here, tokens[:, t], self.eos_id)
        if not allowed:  # no positions
            V = self._allowed(self.grammar.start(owner), len(owner), width).shape[-1]
            return tokens.new_zeros((len(owner), 0, V), dtype=torch.bool), tokens.new_zeros((len(owner), 0))
        return torch.stack(allowed, 1), torch.stack(phases, 1)

    def _position_log_probs(self, enc: Any, tokens: Tensor, owner: Tensor) -> Tensor:
        logp = self.model.position_log_probs(enc, tokens, owner)  # (N, T, V)
        allowed, phase = self.masks(tokens, owner, logp.shape[-1])
        return renormalise(logp, allowed, phase)

    def _token_scores(self, enc: Any, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N, T) constrained teacher-forced per-token log-probabilities, with gradients, 0 past each row's end:
        what search adds up, position by position."""
        logp = self._position_log_probs(enc, tokens, owner)  # (N, T, V)
        tok = logp.gather(2, tokens[:, :, None]).squeeze(2)  # (N, T)
        return torch.where(target_mask(tokens, self.pad_id, self.eos_id), tok, torch.zeros_like(tok))

    def _score(self, enc: Any, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N,) constrained teacher-forced log-probabilities, with gradients: what search sums."""
        return self._token_scores(enc, tokens, owner).sum(1)


def next_phase(phase: Tensor, allowed: Tensor, tokens: Tensor, eos_id: int) -> Tensor:
    """(N,) the rows' phases after tokens (N,), given what was allowed (N, V): a live row ends at an allowed
    eos_id and dies at a disallowed token; an ended or dead row stays so."""
    ok = allowed.gather(1, tokens[:, None]).squeeze(1)  # (N,)
    live = phase == LIVE
    phase = torch.where(live & ~ok, torch.full_like(phase, DEAD), phase)
    return torch.where(live & ok & (tokens == eos_id), torch.full_like(phase, ENDED), phase)


def renormalise(logp: Tensor, allowed: Tensor, phase: Tensor) -> Tensor:
    """log p' (..., V) from the model's logp (..., V): renormalised over `allowed` on live rows, all -inf on
    dead ones, the model's own (any continuation: search pads them) on ended ones; `phase` is (...,)."""
    ended, dead = (phase == ENDED)[..., None], (phase == DEAD)[..., None]
    allowed = (allowed | ended) & ~dead
    stuck = ~allowed.any(-1) & (phase == LIVE)
    if bool(stuck.any()):  # one host sync; a NaN-free distribution cannot be made up here
        at = stuck.nonzero()[0].tolist()
        raise GrammarError(f"the grammar allows no token at all after an allowed prefix (row {at[0]}"
                           + (f", position {at[1]}" if len(at) > 1 else "") + "): every state it reaches must "
                           "allow eos or a continuation")
    masked = logp.masked_fill(~allowed, float("-inf"))
    # Rows without allowed mass (dead, or the model gives every allowed token -inf) stay all -inf: their
    # normaliser is taken over zeros instead, so neither it nor its gradient is NaN.
    has_mass = (allowed & ~torch.isneginf(logp)).any(-1, keepdim=True)
    norm = torch.logsumexp(masked.masked_fill(~has_mass, 0.0), dim=-1, keepdim=True)
    return masked - norm


def teacher_forced_allowed(constrained: Constrained, tokens: Tensor, owner: Tensor) -> Tensor:
    """(N, T) whether each scored position's token is allowed: the check that rows are in the language."""
    allowed, phase = constrained.masks(tokens, owner)
    ok = allowed.gather(2, tokens[:, :, None]).squeeze(2) & (phase == LIVE)
    return ok | ~target_mask(tokens, constrained.pad_id, constrained.eos_id)


__all__ = ["Constrained", "GrammarError", "renormalise", "teacher_forced_allowed"]


# ---- a task's grammar around a model, for a run (--grammar on) or a decode
def constrain(model, task, grammar: str, max_len: int, flag: str = "--grammar"):
    """The model constrained to the task's grammar for rows of at most max_len positions, or the model itself
    (grammar 'off'); a one-line GrammarError naming `flag` where the task has no grammar or refuses max_len."""
    if grammar == "off":
        return model
    try:
        g = task.grammar(max_len)
    except ValueError as err:
        raise GrammarError(f"{flag} on: {err}") from None
    if g is None:
        raise GrammarError(f"{flag} on: task '{getattr(task, 'spec', task.name)}' declares no grammar "
                           "(Task.grammar returns None)")
    return Constrained(model, g)


def check_references(model, task, device, batch_size: int = 4096) -> None:
    """Every training reference must be a sequence of the grammar (within --max-len): MLE would otherwise train
    on rows of probability zero (log p = -inf). A GrammarError naming how many fail, with the first one; nothing
    where the model is not constrained."""
    if not isinstance(model, Constrained):
        return
    rows = [(i, ids) for i, ex in enumerate(task.train) for ids in task.target_ids(ex)]
    bad = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            tokens = pad_targets([ids for _, ids in part], device, model.pad_id, model.eos_id)  # (n, T)
            try:
                ok = teacher_forced_allowed(model, tokens, torch.arange(len(part), device=device)).all(1)  # (n,)
            except GrammarError as err:
                raise GrammarError(f"--grammar on: {err}") from None
            bad += [part[k][0] for k in (~ok).nonzero().squeeze(1).tolist()]
    if bad:
        example = task.train[bad[0]].references[0]
        raise GrammarError(f"--grammar on: {len(bad)} training references are not in the task's grammar within "
                           f"--max-len (the first: {example!r}); a longer --max-len, or --grammar off")
