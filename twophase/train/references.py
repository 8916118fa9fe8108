"""--include-reference: each source's references join its candidates before the objective (Bunel et al.'s RL_beam
keeps the reference program in the set it renormalises over).

Search never scored the references, so they are scored here, teacher-forced and without a graph, by the model
in evaluation mode as search ran it (`protocol.score`: the numbers phase two will differentiate). The rows then
go through the one phase-two path like any candidate; the objective (`objectives.beam`) treats a reference the
beam already found as one candidate with two rows, so it is counted once and its coefficient split between them.

Letters: N candidate rows, R reference rows.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import protocol
from ..samples import Samples


@torch.no_grad()
def reference_scores(model, source, refs: Samples) -> Tensor:
    """(R,) log p(reference | source) of the reference rows, teacher-forced, no graph, dropout off."""
    with protocol.scoring_mode(model):
        enc = model.encode(source)
        return protocol.score(model, enc, refs.tokens, refs.owner)


def with_references(model, source, cand: Samples, rewards: Tensor, refs: Samples,
                    ref_rewards: Tensor) -> tuple[Samples, Tensor]:
    """(candidates then references as one Samples (N + R rows), their rewards (N + R,)); the references' scores
    are the model's log-probabilities of them."""
    scored = Samples(refs.tokens, refs.lengths, refs.owner, reference_scores(model, source, refs).to(cand.scores.dtype))
    return Samples.cat([cand, scored], model.pad_id), torch.cat([rewards, ref_rewards.to(rewards.dtype)])
