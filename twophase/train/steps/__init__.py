"""The training steps: one module per step family, each reading top to bottom in the algorithm's order, given the
parts (`parts.Parts`: plain data) and the sections of the configuration it reads, never its owner nor the whole
configuration.

    mle        the MLE step (maximum likelihood of the references, through phase two)
    sequence   the sequence-level objectives (beam, mrt, reinforce, priority, unordered-set)
    policy     the token-level policy objective (GRPO and its kin: generations, several updates each)
    distill    on-policy distillation from a frozen teacher

`STEPS` maps each --objective to its RL step's family: adding an objective is one module and one line here. A
family names the sections it reads in `reads` (keys of `config.SECTIONS`: "search", "rl", "policy", "phase_two",
"steps"), is built as `Family(parts, **those sections)` (`build`), and offers `step() -> metrics row`, and
`state_dict()` / `load_state_dict(state)` for what it keeps between steps (None: nothing).
"""
from __future__ import annotations

from .distill import DistillStep
from .mle import MleStep  # noqa: F401
from .parts import Parts
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


def build(family, cfg, parts: Parts):
    """The step `family` on `parts`, given its own copy of each section of `cfg` it reads (`family.reads`)."""
    return family(parts, **{name: cfg.section(name) for name in family.reads})
