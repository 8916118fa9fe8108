"""What phase two back-propagates: sequence-level objectives as per-sequence coefficients (`sequence`, re-exported
here, so `objectives.beam(...)`, `objectives.mle(...)`, `objectives.mix(...)` read as before), the estimators of a
sample without replacement (`estimators`), and the token-level objectives: `policy` (clipped ratios, k3 KL, TRL's
loss types) with its parts `advantage`, `policyloss`, `mismatch` and `entropycontrol`; and `distillation` (a
teacher's distributions as the signal, TRL's DistillationTrainer loss: `distill`).
"""
from .sequence import (BASELINES, beam, check_owner, distinct, group_count, group_softmax, group_sum, mix,  # noqa: F401
                       mle, mrt, reinforce, scored_values)
from .distill import distillation  # noqa: F401,E402
