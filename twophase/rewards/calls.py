"""How a run calls a reward: the candidates' strings and references, with the context a source-aware reward may
declare (`sources`, every extra field of the task's examples, `completion_ids`).

A reward is `reward(hypotheses, references, **context) -> list[float]` (NaN: no reward, a TRL-style reward's None);
training's rollout (`train.steps.parts.rewards_of`) and validation (`train.evaluation.validate`) both call it here.
Examples are the task's (anything with `source`, `references` and `fields`).
"""
from __future__ import annotations

import torch

from ..protocol import target_mask


def reward_context(examples: list) -> dict:
    """The keywords a source-aware reward may declare, one entry per hypothesis: `sources` (the raw source of
    each hypothesis' example) and every extra field of the task's examples."""
    context = {"sources": [ex.source for ex in examples]}
    for key in (examples[0].fields if examples else {}):
        context[key] = [ex.fields[key] for ex in examples]
    return context


def score(reward, hypotheses: list[str], examples: list, ids: list[list[int]] | None = None) -> list[float]:
    """reward(hypotheses, references, **context) with hypothesis i from examples[i]; `ids`, where known, each
    hypothesis' ids up to and including its eos (the context's `completion_ids`). NaN: no reward (a TRL-style
    reward's None)."""
    context = reward_context(examples)
    if ids is not None:
        context["completion_ids"] = ids
    return reward(hypotheses, [ex.references for ex in examples], **context)


def completion_ids(tokens: torch.Tensor, pad_id: int, eos_id: int) -> list[list[int]]:
    """Rows (N, T) as lists of their ids up to and including the first eos (TRL's completion_ids)."""
    lengths = target_mask(tokens, pad_id, eos_id).sum(dim=1).tolist()  # (N,)
    return [row[:n] for row, n in zip(tokens.tolist(), lengths)]
