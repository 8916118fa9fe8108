"""What `train.py --help` shows of the configuration for one command: the sections of what it learns and how
(its task, model and objective: `sections`' sections) that it uses and, in them, the flags that apply, read from
the conditions the sections and fields declare (`Only`); then by name, with their flags, the sections every run
has (`runsections`': phase two, steps, evaluation, the run's directory, the system), and the sections and flags
this command does not use (`--help all` prints every section, `--help SECTION` one).

`view`: the command's values resolved (its layers merged over Config's defaults, not checked), `task` the name of
the task it runs (countdown where it names none), so that the task-specific sections (karel, countdown) show
only with their task; `reads`: the data and model flags that task reads (`Task.flags`), where known.
"""
from __future__ import annotations

import difflib
import textwrap

from . import runsections
from .documented import Only, _flag
from .sections import FIELDS, SECTIONS, SHAPING_FLAGS, section_fields

ALL = "all"  # --help all: every section
# the sections of how every run computes, validates and is kept: named with their flags, not printed in full
EVERY_RUN = tuple(name for name, cls in SECTIONS.items() if cls.__module__ == runsections.__name__)


def field_applies(name: str, view) -> bool:
    """Whether the field's own condition (`arg(only=...)`) holds in this command: --temperature only with
    --sampler sample, the LSTM's sizes only without --hf-model."""
    only = FIELDS[name].metadata["only"]
    return only is None or only.holds(view)


def field_left_out(name: str, view, reads: frozenset | None = None) -> str | None:
    """Why --help leaves the field out of this command (where it would apply), or None where it shows it. Left
    out: a data or model flag the task does not read (`reads`: its `Task.flags` and recipe, refused when the run
    starts; None: not known before the task is built), and a field whose condition's switch this command set to
    something else (the LSTM's sizes with --hf-model, --mrt-alpha with --objective policy). Shown where its switch
    is still at Config's default, the user's to set (--temperature beside --sampler beam)."""
    only = FIELDS[name].metadata["only"]
    if not field_applies(name, view) and getattr(view, only.switch) != FIELDS[only.switch].default:
        return only.described()
    if reads is not None and name in SHAPING_FLAGS and name not in reads:
        return f"not read by --task {view.task}"
    return None


def section_condition(name: str) -> Only | None:
    """Where section `name` is used: its own condition, or where that condition's switch is a field of the section
    itself (--lora-r in LoRA's), the switch's condition (--lora-r: with --hf-model); None: always."""
    only = getattr(SECTIONS[name], "only", None)
    if only is not None and only.switch in section_fields(name):
        return FIELDS[only.switch].metadata["only"]
    return only


def section_left_out(name: str, view, reads: frozenset | None = None) -> str | None:
    """Why --help leaves section `name` out of this command, or None where it shows it: a section is a whole task,
    model or objective, shown only where its condition holds (karel's with --task karel, policy's with --objective
    policy, LoRA's with --hf-model) and where the task reads some flag of it."""
    only = section_condition(name)
    if only is not None and not only.holds(view):
        return only.described()
    if all(field_left_out(f, view, reads) for f in section_fields(name)):
        return f"not read by --task {view.task}"
    return None


def shown(view, reads: frozenset | None = None) -> dict[str, tuple[str, ...]]:
    """{section: its fields shown}, in SECTIONS' order: the sections of this command's task, model and objective,
    each with the fields that --help shows (`field_left_out`)."""
    return {name: tuple(f for f in section_fields(name) if field_left_out(f, view, reads) is None)
            for name in SECTIONS if name not in EVERY_RUN and section_left_out(name, view, reads) is None}


def summary(name: str) -> str:
    """A section's one-line title: its docstring's first clause (up to a colon or a parenthesis)."""
    first = " ".join((SECTIONS[name].__doc__ or name).split("\n\n")[0].split())
    for stop in (":", " (", "."):
        first = first.partition(stop)[0]
    return first[:1].lower() + first[1:] if first.split()[0][1:].islower() else first  # not LoRA's


def closing(view, width: int, reads: frozenset | None = None) -> str:
    """The paragraph after the sections shown: the sections left out, each with its title and why, then the flags
    of the shown sections left out, by why; and how to see them."""
    used = shown(view, reads)
    hidden = [name for name in SECTIONS if name not in used and name not in EVERY_RUN]
    by_reason: dict[str, list[str]] = {}  # the flags left out of the sections shown, by why
    for name in used:
        for f in section_fields(name):
            why = field_left_out(f, view, reads)
            if why is not None:
                by_reason.setdefault(why, []).append(_flag(f))
    pad = max(map(len, SECTIONS), default=0) + 2
    lines = _wrap(f"Every run's own sections (--help SECTION shows one, e.g. --help run; --help {ALL} shows every "
                  "section and flag):", width)
    for name in EVERY_RUN:
        flags = [_flag(f) for f in section_fields(name) if field_left_out(f, view, reads) is None]
        lines += _wrap(f"{name.ljust(pad)}{summary(name)}: {', '.join(flags)}", width, "  ", " " * (pad + 2))
    if not hidden and not by_reason:
        return "\n".join(lines)
    lines += [""] + _wrap("Not shown, as this command does not use them:", width)
    for name in hidden:
        lines += _wrap(f"{name.ljust(pad)}{summary(name)} ({section_left_out(name, view, reads)})", width,
                       "  ", " " * (pad + 2))
    if by_reason:
        listed = "; ".join(f"{', '.join(flags)} ({why})" for why, flags in by_reason.items())
        lines += _wrap(f"{'and the flags' if hidden else 'the flags'} {listed}", width, "  ", "  ")
    return "\n".join(lines)


def _wrap(text: str, width: int, first: str = "", rest: str = "") -> list[str]:
    """`text` in lines of `width`, a flag never cut at its hyphens."""
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False,
                         break_long_words=False)


def topic(text: str) -> str:
    """--help's argument: a section's name or `all`; ValueError naming the sections otherwise."""
    if text in SECTIONS or text == ALL:
        return text
    close = difflib.get_close_matches(text, [*SECTIONS, ALL], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"no section {text!r}{hint}; --help takes {ALL} or a section: {', '.join(SECTIONS)}")

