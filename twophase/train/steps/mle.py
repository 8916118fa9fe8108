"""The MLE step: maximum likelihood of the references, through phase two like any rows.

One update from --grad-accum batches of (source, reference) pairs, each row weighted 1/(N*B) (`objectives.mle`):
the gradient of one batch of N*B. The reference rows go through the one phase-two path (`parts.phase_two`),
with the model in training mode (dropout on) as it is left (`keep_mode`).
"""
from __future__ import annotations

from ... import objectives
from ...config import PhaseTwoConfig, StepConfig
from ...system import distributed, fsdp
from .parts import Parts, phase_two, presented, target_rows, update


class MleStep:
    """The MLE phase's step, given the parts and its sections: phase two's (its chunks) and the steps' (--grad-accum,
    clipping)."""

    reads = ("phase_two", "steps")

    def __init__(self, parts: Parts, phase_two: PhaseTwoConfig, steps: StepConfig):
        self.parts, self.phase_two, self.steps = parts, phase_two, steps

    def step(self) -> dict:
        p, accum = self.parts, self.steps.grad_accum
        p.model.train()
        p.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        with fsdp.gathered(p.model, reduce=True):  # --fsdp: whole parameters for the step, one reduction after
            for _ in range(accum):
                batch = next(p.mle_batches)  # the global batch: every process draws it, then takes its share
                shown = presented(p, [p.pairs[k][0] for k in batch])
                pairs = [p.pairs[k] for k in distributed.shard(batch)]
                source = p.task.collate(shown, p.device)
                refs = target_rows(p, [p.ref_ids[i][j] for i, j in pairs], list(range(len(pairs))))  # (B, T)
                coef = objectives.mle(refs.owner, len(batch) * accum)
                loss += phase_two(p, self.phase_two, source, refs, coef, keep_mode=True)
        loss = distributed.reduce_sums({"loss": loss})["loss"]
        return {"loss": loss, **update(p, self.steps, loss)}

