"""Reward functions written for TRL's `GRPOTrainer`: `reward(prompts, completions, completion_ids, **columns)`.

A plug-in is called TRL's way when its signature begins `(prompts, completions, ...)` or `(completions, ...)`
(TRL passes everything by keyword), or it declares `completion_ids`. It then receives, by keyword, one entry per candidate:

    prompts         the example's prompt as the dataset holds it (a string, or a list of chat messages)
    completions     the candidate's text; for chat prompts `[{"role": "assistant", "content": text}]`, as TRL
    completion_ids  the candidate's ids, up to and including its eos (where it produced one), as TRL's
    <column>        every other dataset column (`Example.fields`), by its name

and may return None for a candidate it does not score (see `twophase.objectives` for what each objective does
with it). twophase's own rewards take `(hypotheses, references, **context)` instead (`twophase.rewards`).
Like TRL, only what the signature names is passed (everything, with **kwargs); TRL's `trainer_state`,
`log_extra` and `log_metric` keywords do not exist here, so a function that requires them is refused.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable


def is_trl_style(params: list[inspect.Parameter]) -> bool:
    """Whether a signature's parameters are TRL's: (prompts, completions, ...), (completions, ...), or
    completion_ids among them."""
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return (names[:2] == ["prompts", "completions"] or names[:1] == ["completions"]
            or any(p.name == "completion_ids" for p in params))


class Call:
    """How to call one TRL-style function: what its signature takes, read once."""

    def __init__(self, fn: Callable[..., Any], params: list[inspect.Parameter]):
        self.fn = fn
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        named = [p for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        self.names = {p.name for p in named}
        self.required = {p.name for p in named if p.default is p.empty}

    def arguments(self, hypotheses: list[str], context: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """(keyword arguments, the required names the caller did not give)."""
        sources = context.get("sources", [None] * len(hypotheses))
        completions = [[{"role": "assistant", "content": h}] if isinstance(s, list) else h
                       for h, s in zip(hypotheses, sources)]
        given = {"prompts": sources, "completions": completions,
                 **{k: v for k, v in context.items() if k != "sources"}}
        missing = sorted(self.required - given.keys())
        kwargs = given if self.takes_all else {k: v for k, v in given.items() if k in self.names}
        return kwargs, missing

    def __call__(self, kwargs: dict[str, Any]):
        return self.fn(**kwargs)
