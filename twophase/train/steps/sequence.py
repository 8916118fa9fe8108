"""The sequence-level objectives' RL step (--objective beam, mrt, reinforce, priority, unordered-set).

One update from --grad-accum batches of B sources, every loss averaged over all N*B of them; each batch, in turn:
    1. phase one  - K candidates per source, no graph (beam_search / sample / stochastic_beam_search);
    2. rewards    - the detokenised candidates scored against every reference of their source (and the source);
    3. objective  - rewards and search scores turned into one coefficient per candidate (`objectives`), with
                    --include-reference's references joined first and --mle-weight's MLE rows after;
    4. phase two  - rescore_backward: chunked teacher-forced re-decoding, .grad += d/dtheta sum_i c_i log p_i;
then 5. update    - the loss summed over processes, clipped, the optimizer's step.
Steps 1 and 4 are the step's `gradient` (`parts.PHASE_TWO`; a benchmark may put a baseline's in its place,
`benchmarks.baselines`).
"""
from __future__ import annotations

import torch

from ... import objectives
from ...config import PhaseTwoConfig, RLConfig, SearchConfig, StepConfig
from ...objectives import estimators
from ...phase1.search import greedy
from ...samples import Samples
from ...system import fsdp
from ..evaluation import with_references
from .parts import PHASE_TWO, Parts, Rollout, reference_rows, rewards_of, rl_update, rollout, section


class SequenceStep:
    """The sequence objectives' step, given the parts and its sections: phase one's search, the objective's (rl),
    phase two's and the steps' (`gradient`: steps 1 and 4)."""

    reads = ("search", "rl", "phase_two", "steps")

    def __init__(self, parts: Parts, search: SearchConfig, rl: RLConfig, phase_two: PhaseTwoConfig,
                 steps: StepConfig):
        self.parts, self.search, self.rl, self.phase_two, self.steps = parts, search, rl, phase_two, steps
        self.gradient = PHASE_TWO

    def step(self) -> dict:
        p = self.parts
        p.optimizer.zero_grad(set_to_none=True)
        with fsdp.gathered(p.model, reduce=True):  # --fsdp: whole parameters for the step, one reduction after
            done = [self.batch(next(p.rl_batches)) for _ in range(self.steps.grad_accum)]  # .grad accumulated
        losses, rewards, reward_parts = zip(*done)
        # 5. update (summed over processes)
        return rl_update(p, self.steps, list(losses), list(rewards), list(reward_parts))

    def batch(self, batch: list[int]) -> tuple:
        """Steps 1-4 on one batch, its phase two right after its phase one: .grad += its share of the step's
        gradient. Returns the loss, the (N,) rewards and, with several rewards, each one's values (what the
        update's row reports: the batch's candidates and graph go with this call)."""
        p = self.parts
        r = rollout(p, self.search, batch, self.gradient)  # 1-2. phase one, rewards
        rows, coef = self.coefficients(r)  # 3. the objective's weight on each log p(row)
        # 4. Phase two: chunked teacher-forced re-decoding; .grad = d/dtheta sum_i c_i log p_i, exactly.
        return self.gradient.backward(p, self.phase_two, r.source, rows, coef, r.search), r.rewards, r.parts

    def state_dict(self) -> None:
        return None  # nothing kept between steps

    def load_state_dict(self, state: dict) -> None:
        pass

    def coefficients(self, r: Rollout) -> tuple[Samples, torch.Tensor]:
        """Step 3: the rows phase two re-decodes and their coefficients; every loss is averaged over the global
        batch size B (every source of the update, across processes and batches)."""
        p, rl = self.parts, self.rl
        B = r.batch_size * self.steps.grad_accum
        rows, row_rewards = joined_references(p, rl, r)
        coef = self.objective(rows, row_rewards, r, B)
        if rl.mle_weight > 0:  # the MLE term rides along as extra rows, chunked like the candidates
            refs = reference_rows(p, r.idx)
            rows = Samples.cat([rows, refs], p.model.pad_id)
            coef = objectives.mix(coef, objectives.mle(refs.owner, B), rl.mle_weight)
        return rows, coef

    def objective(self, cand: Samples, rewards, r: Rollout, B: int) -> torch.Tensor:
        """The objective's coefficients of the rows (cand.owner indexes the batch's sources)."""
        p, rl = self.parts, self.rl
        if rl.objective == "beam":
            return objectives.beam(rewards, cand.scores, cand.owner, B, tokens=cand.tokens)
        if rl.objective == "mrt":
            return objectives.mrt(rewards, cand.scores, cand.owner, B, rl.mrt_alpha, tokens=cand.tokens)
        if rl.objective == "priority":
            return estimators.priority(rewards, cand.scores, cand.threshold, cand.owner, B)
        if rl.objective == "unordered-set":
            return estimators.unordered_set(rewards, cand.scores, cand.owner, B)
        greedy_rewards = None
        if rl.reinforce_baseline == "greedy":  # self-critical: the greedy decode's reward is the baseline
            with p.autocast():
                best = greedy(p.model, r.source, self.search.max_len)
            greedy_rewards = rewards_of(p, best.tokens, best.owner.tolist(), r.examples)  # (B,)
        return objectives.reinforce(rewards, cand.owner, B, rl.reinforce_baseline, greedy_rewards)


def joined_references(p: Parts, rl: RLConfig, r: Rollout) -> tuple[Samples, torch.Tensor]:
    """The rows the objective weighs and their rewards: the candidates, and with --include-reference each source's
    references after them (RL_beam over candidates and references; the objective dedups the two), scored by the
    model and rewarded as the candidates were."""
    if not rl.include_reference:
        return r.cand, r.rewards
    refs = reference_rows(p, r.idx)
    with section(p, "references: score and reward", "references"), p.autocast():
        return with_references(p.model, r.source, r.cand, r.rewards, refs,
                               rewards_of(p, refs.tokens, refs.owner.tolist(), r.examples))
