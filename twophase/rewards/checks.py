"""A run's reward checked before its first step, against the task's data: called once on answers whose scores
exist whatever the reward means (`check_calls`), and refused where it compares with references on rows that have
none (`check_references`). Each is a one-line RewardError. The task is read for its examples only (`train`,
`valid`, `test`, `target_ids`, and where it locates them, `unreferenced`)."""
from __future__ import annotations

from .calls import score
from .errors import RewardError
from .registry import needs_references


def check_calls(reward, task) -> None:
    """Call the reward once before anything slow, on answers whose scores exist whatever the reward means: the
    references of the first two training sources against themselves, and an empty hypothesis. A plug-in that
    raises or returns NaN then stops the run in seconds, not at the first validation after the warm start."""
    examples = [ex for ex in task.train[:2] if ex.references]
    if not examples:  # a task without references (execution rewards, say): an empty hypothesis only
        examples = task.train[:1]
    hyps = [ex.references[0] if ex.references else "" for ex in examples] + [""]
    ids = [task.target_ids(ex)[0] if ex.references else [] for ex in examples] + [[]]  # without eos
    try:
        score(reward, hyps, examples + examples[:1], ids)
    except RewardError as err:
        refs = sum(bool(ex.references) for ex in examples)
        checked = f"{refs} training references scored against themselves and " if refs else ""
        raise RewardError(f"{err} (start-up check: {checked}an empty hypothesis)") from None


def check_references(reward, spec: str | None, default: bool, train_flag: str | None, task) -> None:
    """Refuse, before any step, a reward that compares with references (`needs_references`: the built-ins) on rows
    that have none: with no reference anywhere in --train it would score nothing (--reward forgotten: the task's
    default `edit`); a row without one in --train, --valid or --test would never be scored, so the first is named
    (FILE:LINE). Several rewards (--reward a,b): a row needs a reference only where every one of them needs
    references (the others score it; those that need them give it None, as TRL's rewards do for rows they do not
    apply to), but one that needs references on a --train without any would never score. `spec`: --reward's
    value, `default`: whether it is the task's default rather than given; `train_flag`: --train's value."""
    parts = list(zip(getattr(reward, "names", [spec]), getattr(reward, "rewards", [reward])))
    needing = [name for name, fn in parts if needs_references(fn)]
    if not needing:
        return
    flag = f"--reward {spec}" + (" (the task's default)" if default else "")
    compares = f"{', '.join(needing)} compare{'s' if len(needing) == 1 else ''} candidates with references"
    if not any(ex.references for ex in task.train):
        if len(needing) < len(parts):
            raise RewardError(f"{flag}: {compares}, and --train {train_flag} has none: "
                              f"{'it' if len(needing) == 1 else 'they'} would never score; leave "
                              f"{'it' if len(needing) == 1 else 'them'} out")
        raise RewardError(f"{flag}: {compares}, and --train {train_flag} has none (no completion/target): "
                          f"{'--reward is needed' if default else 'give --reward'}, one that scores without "
                          "references (module:callable, e.g. a function in TRL's signature: docs/trl.md)")
    if len(needing) < len(parts):
        return
    located = getattr(task, "unreferenced", None) or {}
    for split, examples in (("--train", task.train), ("--valid", task.valid), ("--test", getattr(task, "test", []))):
        count = sum(not ex.references for ex in examples or [])
        if not count:
            continue
        where, _, total = located.get(split) or (
            f"{split}: example {next(i for i, ex in enumerate(examples) if not ex.references) + 1}", count,
            len(examples))
        raise RewardError(f"{where}: no reference (completion/target), which {flag} compares candidates with "
                          f"({count} of {total} rows of {split} have none): give every row one, or add a "
                          "--reward that scores without references")
