"""--objective distill's RL step: on-policy distillation from a frozen teacher (`train.teacher`), in TRL's order.

TRL generates once per accumulation, and its normaliser is the whole step's scored tokens, so the step reads:
    1-2. phase one and rewards of every --grad-accum batch (the step's whole generation; the rewards are logged,
         the teacher's distributions are the signal), with --include-reference's references beside the candidates;
    3.   the objective: TRL's DistillationTrainer loss (`teacher.objective`), normalised by the generation's scored
         tokens, every process's (its num_items_in_batch), one objective for every batch;
    4.   phase two of each batch with it, the teacher gathered for them all (--fsdp: sharded otherwise);
    5.   update.
"""
from __future__ import annotations

from ...config import PhaseTwoConfig, RLConfig, SearchConfig, StepConfig
from ...system import fsdp
from .. import teacher as teachers
from .parts import PHASE_TWO, Parts, rl_update, rollout
from .sequence import joined_references


class DistillStep:
    """The distillation step, given the parts (the frozen teacher among them) and its sections: phase one's search,
    the objective's (rl), phase two's and the steps' (`gradient`: steps 1 and 4)."""

    reads = ("search", "rl", "phase_two", "steps")

    def __init__(self, parts: Parts, search: SearchConfig, rl: RLConfig, phase_two: PhaseTwoConfig,
                 steps: StepConfig):
        self.parts, self.search, self.rl, self.phase_two, self.steps = parts, search, rl, phase_two, steps
        self.gradient = PHASE_TWO

    def step(self) -> dict:
        p, teacher = self.parts, self.parts.teacher
        p.optimizer.zero_grad(set_to_none=True)
        with fsdp.gathered(p.model, reduce=True):  # --fsdp: whole parameters for the step, one reduction after
            rollouts, rows = [], []
            for _ in range(self.steps.grad_accum):  # 1-2. the step's whole generation
                rollouts.append(rollout(p, self.search, next(p.rl_batches), self.gradient))
                rows.append(joined_references(p, self.rl, rollouts[-1])[0])
            # 3. one objective, the generation's normaliser
            objective = teachers.objective(teacher, self.rl, self.search, rows)
            with fsdp.gathered(teacher):  # 4. phase two of each batch
                losses = [self.gradient.backward(p, self.phase_two, r.source, batch_rows, objective, r.search)
                          for r, batch_rows in zip(rollouts, rows)]
        return rl_update(p, self.steps, losses, [r.rewards for r in rollouts], [r.parts for r in rollouts])  # 5.

    def state_dict(self) -> None:
        return None  # nothing kept between steps

    def load_state_dict(self, state: dict) -> None:
        pass
