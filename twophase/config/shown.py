"""What `train.py --help` shows of the configuration for one command: the sections it uses and, in them, the
flags that apply, read from the conditions the sections and fields declare (`Only`); the rest is named in a
closing paragraph (`--help all` prints every section, `--help SECTION` one).

`view`: the command's values resolved (its layers merged over Config's defaults, not checked), `task` the name of
the task it runs (countdown where it names none), so that the task-specific sections (karel, countdown) show
only with their task.
"""
from __future__ import annotations

import difflib
import textwrap

from .documented import Only, _flag
from .sections import FIELDS, SECTIONS, section_fields

ALL = "all"  # --help all: every section


def field_applies(name: str, view) -> bool:
    """Whether the field's own condition (`arg(only=...)`) holds in this command: --temperature only with
    --sampler sample, the LSTM's sizes only without --hf-model."""
    only = FIELDS[name].metadata["only"]
    return only is None or only.holds(view)


def field_shown(name: str, view) -> bool:
    """Whether --help shows the field: where it applies, or where its condition's switch is still at Config's
    default, the user's to set (--temperature beside --sampler beam); not where this command set the switch to
    something else (the LSTM's sizes with --hf-model, --mrt-alpha with --objective policy)."""
    only = FIELDS[name].metadata["only"]
    return field_applies(name, view) or getattr(view, only.switch) == FIELDS[only.switch].default


def section_condition(name: str) -> Only | None:
    """Where section `name` is used: its own condition, or where that condition's switch is a field of the section
    itself (--lora-r in LoRA's), the switch's condition (--lora-r: with --hf-model); None: always."""
    only = getattr(SECTIONS[name], "only", None)
    if only is not None and only.switch in section_fields(name):
        return FIELDS[only.switch].metadata["only"]
    return only


def section_used(name: str, view) -> bool:
    """Whether this command uses the section: a section is a whole task, model or objective, shown only where its
    condition holds (karel's with --task karel, policy's with --objective policy, LoRA's with --hf-model)."""
    only = section_condition(name)
    return only is None or only.holds(view)


def shown(view) -> dict[str, tuple[str, ...]]:
    """{section: its fields shown}, in SECTIONS' order: the sections this command uses, each with the fields that
    --help shows (`field_shown`)."""
    return {name: tuple(f for f in section_fields(name) if field_shown(f, view))
            for name in SECTIONS if section_used(name, view)}


def summary(name: str) -> str:
    """A section's one-line title: its docstring's first clause (up to a colon or a parenthesis)."""
    first = " ".join((SECTIONS[name].__doc__ or name).split("\n\n")[0].split())
    for stop in (":", " (", "."):
        first = first.partition(stop)[0]
    return first[:1].lower() + first[1:] if first.split()[0][1:].islower() else first  # not LoRA's


def closing(view, width: int) -> str:
    """The paragraph after the sections shown: the sections left out, each with its title and where it applies,
    then the flags of the shown sections left out, with where they apply; and how to see them."""
    used = shown(view)
    hidden = [name for name in SECTIONS if name not in used]
    by_condition: dict[str, list[str]] = {}  # the flags left out of the sections shown, by where they apply
    for name, kept in used.items():
        for f in section_fields(name):
            if f not in kept:
                by_condition.setdefault(FIELDS[f].metadata["only"].described(), []).append(_flag(f))
    wrap = dict(width=width, break_on_hyphens=False, break_long_words=False)
    example = hidden[-1] if hidden else "rl"
    if not hidden and not by_condition:
        return "\n".join(textwrap.wrap(f"Every section and flag applies to this command; --help SECTION shows one "
                                        f"(e.g. --help {example}).", **wrap))
    lines = textwrap.wrap(f"Not shown, as this command does not use them (--help SECTION shows one, e.g. --help "
                          f"{example}; --help {ALL} shows every section and flag):", **wrap)
    pad = max(map(len, hidden), default=0) + 2
    for name in hidden:
        lines += textwrap.wrap(f"{name.ljust(pad)}{summary(name)} ({section_condition(name).described()})",
                               initial_indent="  ", subsequent_indent=" " * (pad + 2), **wrap)
    if by_condition:
        listed = "; ".join(f"{', '.join(flags)} ({where})" for where, flags in by_condition.items())
        lines += textwrap.wrap(f"{'and the flags' if hidden else 'the flags'} {listed}", initial_indent="  ",
                               subsequent_indent="  ", **wrap)
    return "\n".join(lines)


def topic(text: str) -> str:
    """--help's argument: a section's name or `all`; ValueError naming the sections otherwise."""
    if text in SECTIONS or text == ALL:
        return text
    close = difflib.get_close_matches(text, [*SECTIONS, ALL], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"no section {text!r}{hint}; --help takes {ALL} or a section: {', '.join(SECTIONS)}")

