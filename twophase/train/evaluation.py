"""Validation: decode a data set with beam search and score the best hypothesis of each source.

Several processes each decode a share and reduce the sufficient statistics, so the scores equal one process's.
Letters: B sources per decoding batch, N rows.
"""
from __future__ import annotations

import torch

from . import distributed
from ..tasks.data import Dataset, pad_batch
from ..tasks.metrics import evaluate_sums, scores_from_sums
from ..samples import best_rows
from ..search import beam_search
from ..vocab import Vocab


@torch.inference_mode()
def validate(model, data: Dataset, src_vocab: Vocab, tgt_vocab: Vocab, reward, beam_size: int, max_len: int,
             device: torch.device, limit: int = 0, batch_size: int = 256) -> dict:
    """word_acc, wer, per, n and the mean reward of the best hypotheses over data (its first `limit` sources)."""
    n = min(limit, len(data)) if limit else len(data)
    model.eval()
    share = distributed.shard(list(range(n)))
    hyps = []
    for start in range(0, len(share), batch_size):
        source = pad_batch([src_vocab.encode(data.sources[i]) for i in share[start:start + batch_size]], device)
        s = beam_search(model, source, beam_size, max_len)
        hyps += [tgt_vocab.decode(r) for r in best_rows(s).tolist()]
    refs = [data.references[i] for i in share]
    sums = evaluate_sums(hyps, refs)
    sums["reward"] = sum(reward([" ".join(h) for h in hyps], [[" ".join(r) for r in rs] for rs in refs])
                         if hyps else [])
    sums = distributed.reduce_sums(sums)
    return {**scores_from_sums(sums), "reward": sums["reward"] / sums["n"]}
