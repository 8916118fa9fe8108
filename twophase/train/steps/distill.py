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

from ...config import Config
from ...system import fsdp
from .. import teacher as teachers
from .parts import PHASE_TWO, Parts, rl_update, rollout
from .sequence import joined_references


class DistillStep:
    """The distillation step, given the parts, its settings and the frozen teacher (`gradient`: steps 1 and 4)."""

    def __init__(self, cfg: Config, parts: Parts, teacher=None):
        self.cfg, self.parts, self.teacher = cfg, parts, teacher
        self.gradient = PHASE_TWO

    def step(self) -> dict:
        p, cfg = self.parts, self.cfg
        p.optimizer.zero_grad(set_to_none=True)
        with fsdp.gathered(p.model, reduce=True):  # --fsdp: whole parameters for the step, one reduction after
            rollouts, rows = [], []
            for _ in range(cfg.grad_accum):  # 1-2. the step's whole generation
                rollouts.append(rollout(p, cfg, next(p.rl_batches), self.gradient))
                rows.append(joined_references(p, cfg, rollouts[-1])[0])
            objective = teachers.objective(self.teacher, cfg, rows)  # 3. one objective, the generation's normaliser
            with fsdp.gathered(self.teacher):  # 4. phase two of each batch
                losses = [self.gradient.backward(p, cfg, r.source, batch_rows, objective, r.search)
                          for r, batch_rows in zip(rollouts, rows)]
        return rl_update(p, cfg, losses, [r.rewards for r in rollouts], [r.parts for r in rollouts])  # 5.

    def state_dict(self) -> None:
        return None  # nothing kept between steps

    def load_state_dict(self, state: dict) -> None:
        pass
