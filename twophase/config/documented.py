"""The vocabulary of the configuration's sections: a documented field (`arg`: default, choices, minimum, parser,
resume rule; its help text the docstring after it, read by `take_help`), a condition under which a section or a
field applies (`Only`), the parsers of the fields whose text an annotation's type cannot read, and the named
recipes (`PRESETS`).
"""
from __future__ import annotations

import argparse
import ast
import functools
import re
import sys
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union, get_args, get_origin

FIXED = "fixed"        # must equal the checkpoint's value
GROW = "may grow"      # may be raised, never lowered (--rl-steps: a longer RL phase)
PHASE = "while in it"  # --mle-steps: may change while the MLE phase runs (not below the steps taken); fixed after
FREE = "free"          # observes or paces the run, or only says where and how fast it computes

SET = object()  # Only's value meaning "set": truthy, or for a path, not None
DEFAULT_BEAM = 5  # validation's and twophase-decode's beam width, one figure so the two agree
MRT_ALPHA = 0.5  # --mrt-alpha's default; another value with another objective is refused

# --preset NAME: other defaults for a named recipe; flags given on the command line still win.
PRESETS: dict[str, dict[str, object]] = {
    # The long G2P recipe (docs/g2p.md): a bidirectional encoder with dropout, validation-driven MLE (the rate
    # halving at each validation without a better word accuracy) of at most 16,000 steps, then RL and its
    # equal-time MLE control.
    "g2p-long": dict(bidirectional=True, dropout=0.3, mle_steps=16000, lr_decay=0.5, patience=1, min_lr=2.5e-4,
                     eval_every=500, save_every=500, rl_steps=500, rl_lr=1e-4),
    # Bunel et al.'s Karel model and schedule, for a GPU (docs/karel.md; GandRL_for_NPS README): IOs2Seq at their
    # sizes, MLE with Adam at 1e-4 on batches of 128 for 100 epochs of the 10,000 training programs (validated every
    # 10) at a constant rate, RL from the best validation, then beam-RL with 64 candidates on batches of 16 at 1e-5
    # for 5 epochs; validation and test beam 64.
    "karel-paper": dict(karel_model="paper", hidden_size=256, embed_dim=256, karel_channels=64, karel_blocks=2,
                        karel_pair_dim=512, karel_layers=2, lr=1e-4, mle_batch_size=128, mle_steps=7800,
                        eval_every=780, save_every=780, rl_lr=1e-5, batch_size=16, beam_size=64, rl_steps=3125,
                        eval_beam=64, test_beam=0, lr_decay=1.0, rl_from_best=True, save_dir="runs/karel-paper"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Only:
    """Where a section (or a field) does something: while the field `switch` holds `value` (SET: while it is set).
    A field of it given (differing from its default) where that does not hold is refused with `refusal`, filled
    with {flag} (the field's), {switch} (the switch's flag), {value} and {actual} (the switch's value)."""

    switch: str
    value: object = SET
    refusal: str = "{flag} applies to {switch} {value} only, not {switch} {actual}"

    def holds(self, cfg) -> bool:
        actual = getattr(cfg, self.switch)
        if self.value is SET:
            return bool(actual) if not isinstance(actual, str) else True
        return actual in self.value if isinstance(self.value, tuple) else actual == self.value

    def message(self, name: str, cfg) -> str:
        value = " or ".join(self.value) if isinstance(self.value, tuple) else self.value
        return self.refusal.format(flag=_flag(name), switch=_flag(self.switch), value=value,
                                   actual=getattr(cfg, self.switch))

    def described(self) -> str:
        if self.value is SET:
            return f"with {_flag(self.switch)}"
        if self.value is None or self.value is False:
            return f"without {_flag(self.switch)}"
        if self.value is True:
            return f"with {_flag(self.switch)}"
        values = " or ".join(self.value) if isinstance(self.value, tuple) else self.value
        return f"with {_flag(self.switch)} {values}"


def arg(default, choices=None, minimum=None, parse=None, resume=FIXED, only: Only | None = None, inherited=True,
        path=False, task_reads=True, below=None, maximum=None) -> Any:
    """A documented field; its help text is the docstring written after it (where editors show it), which
    `take_help` reads into the field's metadata. `minimum`: the least value allowed; `below`: a bound the value
    must stay under (dropout in [0, 1)); `maximum`: the largest value allowed (--seed's, what every
    generator takes); `parse` converts the flag's text where the annotation's type is not
    enough; `resume`: its rule on --resume; `only`: where this field alone applies (beyond its section's);
    `inherited=False`: a resumed run does not take it from its checkpoint (where and how this command computes);
    `path`: compared as a file on resume; `task_reads=False`: a field of a task-shaping section that no task reads
    (the trainer's)."""
    return field(default=default, metadata=dict(help="", choices=choices, minimum=minimum, parse=parse,
                                                resume=resume, only=only, inherited=inherited, path=path,
                                                task_reads=task_reads, below=below, maximum=maximum))


def take_help(cls) -> None:
    """Each field of the section `cls` gets its help text (metadata "help", what --help prints) from the docstring
    after it in the source, whitespace collapsed. Run before `Config` is made of the sections: it shares their
    fields. Where the source cannot be read (a frozen install) the texts stay empty."""
    texts = _field_docstrings(sys.modules[cls.__module__].__file__).get(cls.__name__, {})
    for f in fields(cls):
        f.metadata = types.MappingProxyType({**f.metadata, "help": texts.get(f.name, "")})


@functools.lru_cache(maxsize=None)
def _field_docstrings(path: str) -> dict[str, dict[str, str]]:
    """{class name: {field name: the docstring after it}} of the module at `path`, parsed once."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return {}
    found: dict[str, dict[str, str]] = {}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        pairs = zip(cls.body, cls.body[1:])
        found[cls.name] = {field.target.id: " ".join(doc.value.value.split()) for field, doc in pairs
                           if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                           and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                           and isinstance(doc.value.value, str)}
    return found


def plain_kinds(hint) -> tuple[str, ...]:
    """The plain types a field's resolved annotation allows, by name ("int", "float", "str", "bool", "None"): a
    Literal's (a choice field's) are its values' type."""
    parts = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    return tuple("None" if part is type(None) else type(get_args(part)[0]).__name__ if get_origin(part) is Literal
                 else part.__name__ for part in parts)


def parse_chunk(text: str) -> int | str:
    """A positive number of rows, or 'auto' (largest chunk within --memory-budget)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'auto', got {text}")
    return value


UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB', '512MB', '1.5g', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MB, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_device(text: str) -> str:
    """--device's name as written: cpu, cuda, cuda:N, mps or auto (whether this machine has it is asked where the
    run starts: a record may be resumed on another machine)."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N, mps or auto, got {text!r}")
    return text


def check_size(text: str) -> str:
    parse_size(text)  # refuse now; the config keeps the text the user wrote
    return text
