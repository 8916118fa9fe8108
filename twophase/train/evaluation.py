"""Validation: decode examples with beam search and score the best hypothesis of each with the task's metrics
and the reward; and the one way the trainer calls a reward (with the examples' context).

Several processes each decode a share and reduce the sufficient statistics, so the scores equal one process's.
Letters: B sources per decoding batch, N rows.
"""
from __future__ import annotations

import torch

from . import distributed
from ..samples import best_rows
from ..search import beam_search
from ..tasks.base import Example, Task


def reward_context(examples: list[Example]) -> dict:
    """The keywords a source-aware reward may declare, one entry per hypothesis: `sources` (the raw source of
    each hypothesis' example) and every extra field of the task's examples."""
    context = {"sources": [ex.source for ex in examples]}
    for key in (examples[0].fields if examples else {}):
        context[key] = [ex.fields[key] for ex in examples]
    return context


def score(reward, hypotheses: list[str], examples: list[Example]) -> list[float]:
    """reward(hypotheses, references, **context) with hypothesis i from examples[i]."""
    return reward(hypotheses, [ex.references for ex in examples], **reward_context(examples))


@torch.inference_mode()
def nbest_hypotheses(model, task: Task, examples: list[Example], beam_size: int, max_len: int, device,
                     batch_size: int) -> list[list[str]]:
    """Every beam candidate of each example, best first, detokenised (at least one per example)."""
    out = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        s = beam_search(model, task.collate(batch, device), beam_size, max_len)
        lists: list[list[str]] = [[] for _ in batch]
        for row, owner in zip(s.tokens.tolist(), s.owner.tolist()):  # rows grouped by source, best first
            lists[owner].append(task.detokenize(row))
        out += lists
    return out


@torch.inference_mode()
def best_hypotheses(model, task: Task, examples: list[Example], beam_size: int, max_len: int, device,
                    batch_size: int) -> list[str]:
    """The best beam candidate of each example, detokenised; validation and decoding both read these."""
    hyps = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        s = beam_search(model, task.collate(batch, device), beam_size, max_len)
        hyps += [task.detokenize(row) for row in best_rows(s).tolist()]  # best_rows: (B, T)
    return hyps


@torch.inference_mode()
def validate(model, task: Task, examples: list[Example], reward, beam_size: int, max_len: int,
             device: torch.device, limit: int = 0, batch_size: int = 256) -> dict:
    """The task's scores (from each example's n-best list), n, and the mean reward of the best hypotheses of
    examples (the first `limit`)."""
    n = min(limit, len(examples)) if limit else len(examples)
    share = [examples[i] for i in distributed.shard(list(range(n)))]
    nbest = nbest_hypotheses(model, task, share, beam_size, max_len, device, batch_size)
    hyps = [h[0] for h in nbest]
    sums = dict(task.nbest_metric_sums(nbest, share))
    sums["reward"] = sum(score(reward, hyps, share)) if share else 0.0
    sums = distributed.reduce_sums(sums)
    return {**task.scores(sums), "reward": sums["reward"] / max(sums["n"], 1)}


def test_beams(cfg) -> list[int]:
    """The beam widths the test split is decoded with: --eval-beam, then --test-beam where it is another."""
    return [cfg.eval_beam] + ([cfg.test_beam] if cfg.test_beam and cfg.test_beam != cfg.eval_beam else [])


def test_scores(model, task: Task, examples: list[Example], reward, beams: list[int], max_len: int,
                device: torch.device) -> dict:
    """validate() at beams[0], then at each further width with its keys suffixed "@K" (generalization@64)."""
    out = validate(model, task, examples, reward, beams[0], max_len, device)
    for k in beams[1:]:
        extra = validate(model, task, examples, reward, k, max_len, device)
        out.update({f"{key}@{k}": value for key, value in extra.items() if key != "n"})
    return out
