"""Baselines a run's RL step is measured against: the same run, with a baseline's gradient in the place of phase
two's (for benchmarks and the tests that compare them; twophase measured against itself is no training flag).

    run = recipe.setup(config)               # any sequence objective (beam, mrt, reinforce, priority, ...)
    baselines.use(run, baselines.ONE_PHASE)  # then run.train(), run.train_step("rl"), ...

    ONE_PHASE          the search keeps the graph of every decoding step and one backward replaces phase two:
                       what sequence-level RL costs without twophase (the same gradient, far more memory;
                       phase1.onephase). --mle-weight's reference rows, which no search scored, go through phase
                       two. Sampling without --top-k, --top-p or --min-len (phase one's own).
    NO_PREFIX_SHARING  phase two re-decodes every candidate from its first token instead of each distinct
                       (source, prefix) once: the same gradient, slower.
"""
from __future__ import annotations

import torch

from twophase.phase1.onephase import one_phase_backward, one_phase_search
from twophase.config import PhaseTwoConfig, SearchConfig
from twophase.system import amp
from twophase.train.steps.parts import Gradient, phase_two, search
from twophase.train.steps.sequence import SequenceStep


def _one_phase_search(p, search: SearchConfig, source):
    return one_phase_search(p.model, source, search.sampler, search.beam_size, search.max_len, search.temperature,
                            p.sampling)


def _one_phase_backward(p, phase_two_settings: PhaseTwoConfig, source, rows, coef: torch.Tensor,
                        log_p: torch.Tensor) -> float:
    """The gradient of sum_i coef[i] log p_i over the candidates (the first len(log_p) rows) through the search's
    graph, then phase two over the rows after them; with fp16 the coefficients carry the loss scale (the loss
    does not)."""
    n = len(log_p)
    scaled, scale = amp.scale_coefficients(coef[:n], p.scaler)
    loss = one_phase_backward(log_p, scaled) / scale
    if len(rows) > n:
        refs = rows.select(torch.arange(n, len(rows), device=coef.device))
        loss += phase_two(p, phase_two_settings, source, refs, coef[n:])
    return loss


ONE_PHASE = Gradient("phase 1: search with graph (one-phase)", _one_phase_search, _one_phase_backward)
NO_PREFIX_SHARING = Gradient("phase 1: search", lambda p, settings, source: (search(p, settings, source), None),
                             lambda p, settings, source, rows, coef, graph: phase_two(p, settings, source, rows, coef,
                                                                                      prefix_sharing=False))


def use(run, gradient: Gradient) -> None:
    """The run's RL step takes `gradient` (a sequence objective's step: the others' divergence or token-level
    objective is phase two's own)."""
    if not isinstance(run.trainer.rl, SequenceStep):
        raise ValueError(f"a baseline's gradient replaces a sequence objective's phase two, not --objective "
                         f"{run.trainer.cfg.objective}'s")
    run.trainer.rl.gradient = gradient
