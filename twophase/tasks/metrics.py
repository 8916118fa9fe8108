"""G2P scores over token sequences: word accuracy and phoneme error rate against several references."""
from __future__ import annotations

import math
from typing import Sequence


def evaluate(hypotheses: list[Sequence[str]], references: list[Sequence[Sequence[str]]]) -> dict:
    """{"word_acc", "wer", "per", "n"}; a word is right if it equals any of its references.

    PER sums, over words, the edit distance to the closest reference, divided by the summed lengths of those
    references. Among equally close references the longest is taken, as it gives the lowest rate.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    if not hypotheses:
        raise ValueError("nothing to evaluate")
    return scores_from_sums(evaluate_sums(hypotheses, references))


def evaluate_sums(hypotheses: list[Sequence[str]], references: list[Sequence[Sequence[str]]]) -> dict:
    """The sufficient statistics of `evaluate`: {"correct", "errors", "length", "n"}. Sums of shards add up to
    the sums of the whole set, which is how validation split over several processes is reduced."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    from rapidfuzz.distance import Levenshtein  # here: `import twophase` needs no rapidfuzz

    correct = errors = length = 0
    for hyp, refs in zip(hypotheses, references):
        if not refs:
            raise ValueError("every hypothesis needs at least one reference")
        hyp = list(hyp)
        distance, negative_length = min((Levenshtein.distance(hyp, list(r)), -len(r)) for r in refs)
        correct += distance == 0
        errors += distance
        length -= negative_length
    return {"correct": correct, "errors": errors, "length": length, "n": len(hypotheses)}


def scores_from_sums(sums: dict) -> dict:
    """evaluate's scores from (possibly reduced) evaluate_sums."""
    n, errors, length = int(sums["n"]), sums["errors"], sums["length"]
    if n == 0:
        raise ValueError("nothing to evaluate")
    word_acc = sums["correct"] / n
    per = errors / length if length else (0.0 if errors == 0 else math.inf)
    return {"word_acc": word_acc, "wer": 1.0 - word_acc, "per": per, "n": n}


def without_stress(phonemes: Sequence[str]) -> list[str]:
    """ARPAbet without its stress digits (`AH0` -> `AH`): the convention of the stress-free CMUdict results."""
    return [p.rstrip("012") for p in phonemes]


def stress_free_correct(hypotheses: list[Sequence[str]], references: list[Sequence[Sequence[str]]]) -> int:
    """How many hypotheses equal one of their references once stress is removed from both."""
    return sum(any(without_stress(h) == without_stress(r) for r in refs) for h, refs in zip(hypotheses, references))
