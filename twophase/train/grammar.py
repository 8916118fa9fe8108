"""`--grammar on`: the task's grammar around the model (`twophase.constraints.Constrained`), for training and
decoding alike, and the check that the training references are in it.

The wrapped model is what the trainer, validation and twophase-decode see: every search, score and gradient
is the constrained model's. Its `state_dict` is the model's own, so checkpoints do not depend on the flag; the
flag itself is saved with the run's config, and twophase-decode follows it unless told otherwise.
"""
from __future__ import annotations

import torch

from ..constraints import Constrained, GrammarError, teacher_forced_allowed
from ..tasks.base import Task
from ..vocab import pad_targets


def constrain(model, task: Task, grammar: str, max_len: int, flag: str = "--grammar"):
    """The model constrained to the task's grammar for rows of at most max_len positions, or the model itself
    (grammar 'off'); a one-line ValueError (the command's usage error) where the task has no grammar or refuses
    max_len."""
    if grammar == "off":
        return model
    try:
        g = task.grammar(max_len)
    except ValueError as err:
        raise ValueError(f"{flag} on: {err}") from None
    if g is None:
        raise ValueError(f"{flag} on: task '{getattr(task, 'spec', task.name)}' declares no grammar "
                         "(Task.grammar returns None)")
    return Constrained(model, g)


def check_references(model, task: Task, device, batch_size: int = 4096) -> None:
    """Every training reference must be a sequence of the grammar (within --max-len): MLE would otherwise train
    on rows of probability zero (log p = -inf). A ValueError naming how many fail, with the first one."""
    if not isinstance(model, Constrained):
        return
    rows = [(i, ids) for i, ex in enumerate(task.train) for ids in task.target_ids(ex)]
    bad = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            tokens = pad_targets([ids for _, ids in part], device, model.pad_id, model.eos_id)  # (n, T)
            try:
                ok = teacher_forced_allowed(model, tokens, torch.arange(len(part), device=device)).all(1)  # (n,)
            except GrammarError as err:
                raise ValueError(f"--grammar on: {err}") from None
            bad += [part[k][0] for k in (~ok).nonzero().squeeze(1).tolist()]
    if bad:
        example = task.train[bad[0]].references[0]
        raise ValueError(f"--grammar on: {len(bad)} training references are not in the task's grammar within "
                         f"--max-len (the first: {example!r}); a longer --max-len, or --grammar off")
