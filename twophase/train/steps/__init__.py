"""The training steps: one module per step family, each reading top to bottom in the algorithm's order, given the
parts (`parts.Parts`: plain data) and its own settings, never its owner.

    mle        the MLE step (maximum likelihood of the references, through phase two)
    sequence   the sequence-level objectives (beam, mrt, reinforce, priority, unordered-set)
    policy     the token-level policy objective (GRPO and its kin: generations, several updates each)
    distill    on-policy distillation from a frozen teacher

`STEPS` maps each --objective to its RL step's family: adding an objective is one module and one line here. A
family is built as `Family(cfg, parts, teacher)` and offers `step() -> metrics row`, and `state_dict()` /
`load_state_dict(state)` for what it keeps between steps (None: nothing).
"""
from __future__ import annotations

from .distill import DistillStep
from .mle import MleStep  # noqa: F401
from .parts import Parts  # noqa: F401
from .policy import PolicyStep
from .sequence import SequenceStep

STEPS = {
    "beam": SequenceStep,
    "mrt": SequenceStep,
    "reinforce": SequenceStep,
    "priority": SequenceStep,
    "unordered-set": SequenceStep,
    "policy": PolicyStep,
    "distill": DistillStep,
}
