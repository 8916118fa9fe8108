"""Validation: decode examples with beam search and score the best hypothesis of each with the task's metrics
and the reward (called as training calls it, `rewards.calls.score`); and --include-reference's
ground-truth references joined to the candidates (`with_references`; not the KL reference model, `klreference`).

Several processes each decode a share and reduce the sufficient statistics, so the scores equal one process's.
Letters: B sources per decoding batch, N candidate rows, R reference rows.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import protocol
from ..system import distributed
from ..rewards.calls import completion_ids, score
from ..rewards.registry import corpus_kinds, corpus_score, corpus_statistics
from ..rewards.weighted import mean_std, statistics
from ..samples import Samples, best_rows
from ..phase1.search import beam_search
from ..tasks.base import Example, Task


@torch.inference_mode()
def nbest_hypotheses(model, task: Task, examples: list[Example], beam_size: int, max_len: int, device,
                     batch_size: int) -> tuple[list[list[str]], list[list[int]]]:
    """Every beam candidate of each example, best first, detokenised (at least one per example), and the best
    one's ids (up to and including eos: a TRL-style reward's completion_ids)."""
    out, ids = [], []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        s = beam_search(model, task.collate(batch, device), beam_size, max_len)
        lists: list[list[str]] = [[] for _ in batch]
        for row, owner in zip(s.tokens.tolist(), s.owner.tolist()):  # rows grouped by source, best first
            lists[owner].append(task.detokenize(row))
        out += lists
        ids += completion_ids(best_rows(s), model.pad_id, model.eos_id)  # best_rows: (B, T)
    return out, ids


@torch.inference_mode()
def validate(model, task: Task, examples: list[Example], reward, beam_size: int, max_len: int,
             device: torch.device, limit: int = 0, batch_size: int = 256) -> dict:
    """The task's scores (from each example's n-best list), n, and the mean reward of the best hypotheses of
    examples (the first `limit`): None where the reward scored none of them (every one None), never 0."""
    n = min(limit, len(examples)) if limit else len(examples)
    share = [examples[i] for i in distributed.shard(list(range(n)))]
    nbest, ids = nbest_hypotheses(model, task, share, beam_size, max_len, device, batch_size)
    hyps = [h[0] for h in nbest]
    sums = dict(task.nbest_metric_sums(nbest, share))
    values = [v for v in score(reward, hyps, share, ids) if not math.isnan(v)] if share else []
    sums["reward"], sums["rewarded"] = math.fsum(values), len(values)  # NaN: not scored, left out of the mean
    names = getattr(reward, "names", [])  # several rewards (rewards.weighted.WeightedSum): each one's mean and std
    if names:
        sums.update(statistics(reward.last if share else {n: [] for n in names}))
    kinds = corpus_kinds(reward)
    sums.update(corpus_sums(task, kinds, hyps, share))
    sums = distributed.reduce_sums(sums)
    reward = sums["reward"] / sums["rewarded"] if sums["rewarded"] else None  # None: no hypothesis was scored
    return {**task.scores(sums), "reward": reward, **mean_std(sums, names), **corpus_scores(kinds, sums)}


def corpus_sums(task: Task, kinds: tuple[str, ...], hyps: list[str], examples: list[Example]) -> dict:
    """The sufficient statistics of each corpus score (`rewards.registry.CORPUS`) of these hypotheses, as the
    user reads them (`Task.format_output`, twophase-decode's; likewise the references), over the examples that
    have references; {"corpus_bleu/0": ..., "corpus_bleu/n": ...}."""
    kept = [(task.format_output(h), [task.format_output(r) for r in ex.references])
            for h, ex in zip(hyps, examples) if ex.references]
    out = {}
    for kind in kinds:
        stats = corpus_statistics(kind, [h for h, _ in kept], [refs for _, refs in kept])
        out.update({f"corpus_{kind}/{i}": v for i, v in enumerate(stats)}, **{f"corpus_{kind}/n": len(kept)})
    return out


def corpus_scores(kinds: tuple[str, ...], sums: dict) -> dict:
    """corpus_bleu (and corpus_chrf) from the reduced `corpus_sums`: None where no example had references."""
    out = {}
    for kind in kinds:
        stats = [sums[f"corpus_{kind}/{i}"] for i in range(len(corpus_statistics(kind, [], [])))]
        out[f"corpus_{kind}"] = corpus_score(kind, stats) if sums[f"corpus_{kind}/n"] else None
    return out


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


# ------------------------------------------------------------------ ground-truth references (--include-reference)
# --include-reference: each source's references join its candidates before the objective (Bunel et al.'s RL_beam
# keeps the reference program in the set it renormalises over).
#
# Search never scored the references, so they are scored here, teacher-forced and without a graph, by the model
# in evaluation mode as search ran it (`protocol.score`: the numbers phase two will differentiate). The rows then
# go through the one phase-two path like any candidate; the objective (`objectives.beam`) treats a reference the
# beam already found as one candidate with two rows, so it is counted once and its coefficient split between them.
@torch.no_grad()
def reference_scores(model, source, refs: Samples) -> Tensor:
    """(R,) log p(reference | source) of the reference rows, teacher-forced, no graph, dropout off."""
    with protocol.eval_mode(model):
        enc = model.encode(source)
        return protocol.score(model, enc, refs.tokens, refs.owner)


def with_references(model, source, cand: Samples, rewards: Tensor, refs: Samples,
                    ref_rewards: Tensor) -> tuple[Samples, Tensor]:
    """(candidates then references as one Samples (N + R rows), their rewards (N + R,)); the references' scores
    are the model's log-probabilities of them."""
    scored = Samples(refs.tokens, refs.lengths, refs.owner, reference_scores(model, source, refs).to(cand.scores.dtype))
    return Samples.cat([cand, scored], model.pad_id), torch.cat([rewards, ref_rewards.to(rewards.dtype)])
