"""Training configuration: sections of documented fields, and the flat `Config` made of them.

The package: `documented` (what a documented field and a condition are), `sections` and `runsections` (the sections),
`values` (one field's value checked), this module (`Config`, its flags), `rules` (the checks across fields and the
resume rules), `layers` (the layers of defaults resolved into one Config), `file` (`--config FILE` and
`--print-config`).

Each section is a dataclass whose fields carry their flag's help text, type, default, valid range and resume rule
(`arg`); a section that only applies under a condition declares it once (`Only`), and `rules` refuses a field
of it given where the condition does not hold. The flat `Config` is a dataclass of every section's fields under
their own names, in the sections' order (`SECTIONS`: what checkpoints and config.json store), so `cfg.beam_size`
and `asdict(cfg)` read as one record, a type checker and an editor see every field, and `cfg.section("search")`
is the search section's values. A Config is checked when it is made (each field's type, range and choices, then
the checks across fields): an invalid one cannot be made; a field assigned later is checked as it is set and
counts as given (`Config.__setattr__`). The command line is generated from the fields (`--rescore-chunk` for
`rescore_chunk`), one argparse group per section, titled by its key in a file.
"""
from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from dataclasses import MISSING, dataclass, field, fields, make_dataclass

from . import rules as configrules
from . import values
from .documented import DEFAULT_BEAM, PRESETS, _flag, parse_chunk, parse_size  # noqa: F401 (the package's names)
from .runsections import EvaluationConfig, PhaseTwoConfig, RunConfig, StepConfig, SystemConfig  # noqa: F401
from .sections import (FIELDS, KINDS, SECTION_OF, SECTIONS, SHAPING_FLAGS, TASK_EXTRA, TASK_SECTIONS,  # noqa: F401
                       CountdownConfig, DataConfig, KarelConfig, LoraConfig, MLEConfig, ModelConfig, PolicyConfig,
                       RLConfig, SearchConfig, section_fields)


def _remembers_given(cls):
    """`cls.__init__` also records the names of the fields it was given (`Config.given()`): a field passed equal
    to its default is still the user's, and wins over a task's recipe and a preset. Not a field: equality,
    `asdict` and the record ignore it."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in kwargs:  # Python's own TypeError, with the field meant where one is close
            if name not in FIELDS:
                raise TypeError(f"{cls.__name__} got an unexpected keyword argument {name!r}"
                                f"{values.did_you_mean(name)}")
        self.__dict__["_given"] = frozenset(names[:len(args)]) | frozenset(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


# The sections in reverse: a dataclass takes its bases' fields from the last base first, so the fields are in
# SECTIONS' order (data, model, ..., system), the order --help prints them in and the record stores them in.
@_remembers_given
@dataclass
class Config(SystemConfig, RunConfig, EvaluationConfig, StepConfig, PhaseTwoConfig, PolicyConfig, RLConfig,
             SearchConfig, MLEConfig, LoraConfig, CountdownConfig, KarelConfig, ModelConfig, DataConfig):
    """Every training setting, one field per train.py flag (the fields of the sections, in SECTIONS' order).
    `cfg.section("search")` gives one section's values. Made only valid: a bad value or combination raises a
    one-line ConfigError, a ValueError, naming the field (`Config.<field>: ...`) or the flags (`rules`' checks)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not f.default:  # a default is valid as it is
                object.__setattr__(self, f.name, values.checked(f.name, value, f"Config.{f.name}",
                                                                   finite=False))
        configrules.validate(self)
        self.__dict__["_made"] = True  # from now on, an assignment is checked and counts as given

    def __setattr__(self, name: str, value) -> None:
        """`cfg.beam_size = 4` after construction: the value is checked as the constructor checks it (type,
        range, choices, a finite number; a one-line ConfigError naming `Config.<field>`) and the field counts as
        given, as a constructor keyword does. A name that is no field is refused (AttributeError): a misspelt
        assignment would otherwise be dropped silently. The checks across fields run where the Config is used
        (`twophase.fit`, `validate()`), so that related fields can be set one after the other."""
        if not self.__dict__.get("_made"):  # the dataclass's own __init__
            object.__setattr__(self, name, value)
            return
        if name not in FIELDS:
            raise AttributeError(f"Config has no field {name!r}")
        object.__setattr__(self, name, values.checked(name, value, f"Config.{name}"))
        self.__dict__["_given"] = self.given() | {name}

    # cfg.search: cfg.section("search"), a copy of the section's values
    data = property(lambda self: self.section("data"))
    model = property(lambda self: self.section("model"))
    karel = property(lambda self: self.section("karel"))
    countdown = property(lambda self: self.section("countdown"))
    lora = property(lambda self: self.section("lora"))
    mle = property(lambda self: self.section("mle"))
    search = property(lambda self: self.section("search"))
    rl = property(lambda self: self.section("rl"))
    policy = property(lambda self: self.section("policy"))
    phase_two = property(lambda self: self.section("phase_two"))
    steps = property(lambda self: self.section("steps"))
    evaluation = property(lambda self: self.section("evaluation"))
    run = property(lambda self: self.section("run"))
    system = property(lambda self: self.section("system"))

    def given(self) -> frozenset[str]:
        """The fields passed to the constructor (by name or position) or assigned since, whatever their value;
        every field for a Config made by `dataclasses.replace` or from a record."""
        return self.__dict__.get("_given", frozenset())

    def section(self, name: str):
        """The values of section `name` (a key of SECTIONS) as that section's dataclass: a copy, not a view to
        write through."""
        cls = SECTIONS[name]
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    def for_task(self):
        """What a task reads (`TaskConfig`): the data, model, karel, countdown and lora sections and --max-len."""
        return TaskConfig(**{name: getattr(self, name) for name in TASK_FIELDS})

    def validate(self) -> None:
        """The checks a Config passed when it was made (`rules.validate`), again, and those that read the file
        system (`rules.check_files`); ConfigError naming the flag."""
        configrules.validate(self)
        configrules.check_files(self)

    def warnings(self) -> list[str]:
        """Configurations that train, but not what the user probably means (`rules.warnings`)."""
        return configrules.warnings(self)


assert [f.name for f in fields(Config)] == [n for cls in SECTIONS.values() for n in (f.name for f in fields(cls))]
ORDER = tuple(f.name for f in fields(Config))  # the record's keys, in their order

TASK_FIELDS = tuple(n for n in ORDER if SECTION_OF[n] in TASK_SECTIONS or n in TASK_EXTRA)


class NotATaskSetting(LookupError):
    """A training setting a task asked for that is not its own. Not an AttributeError on purpose: `getattr(cfg,
    "seed", 0)` in a task would otherwise read a silent 0 where the run's seed is meant."""


class _TaskViews:
    def __getattr__(self, name: str):  # only for names that are not fields
        if name in FIELDS:
            raise NotATaskSetting(f"TaskConfig has no {name} (--{name.replace('_', '-')}, the {SECTION_OF[name]} "
                                 f"section's): a task reads the {', '.join(TASK_SECTIONS)} sections and "
                                 f"{', '.join(TASK_EXTRA)}")
        raise AttributeError(f"TaskConfig has no attribute {name!r}")


def _make_task_config():
    specs = [(n, FIELDS[n].type, field(default=FIELDS[n].default, metadata=FIELDS[n].metadata)) for n in TASK_FIELDS]
    cls = make_dataclass("TaskConfig", specs, bases=(_TaskViews,), frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = ("The settings a task reads, as `Config` names them: the fields of TASK_SECTIONS and TASK_EXTRA "
                   "(`Config.for_task()`).")
    return cls


TaskConfig = _make_task_config()


def _typed(f, kind):
    """argparse type that also enforces the field's range, so `--rescore-chunk 0` fails at parse time."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if kind is float and not math.isfinite(value):  # nan passes every comparison with a minimum
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        problem = values.out_of_range(f.name, value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem.rpartition(", got ")[0] + f", got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


class OneLineParser(argparse.ArgumentParser):
    """Bad flags exit with status 2 and one line (argparse would add the whole usage). A value that starts with
    a minus and a digit is a value, units and all (`--memory-budget -1GB` is refused by its flag, not read as an
    unknown option): argparse takes only plain negative numbers for values."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?[a-zA-Z]*$")

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def section_help(cls) -> str:
    """A section's description in --help: its docstring's first paragraph, and where it applies."""
    text = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    only = getattr(cls, "only", None)
    return text + (f" Applies {only.described()} only." if only is not None else "")


def add_config_flags(parser: argparse.ArgumentParser, kept: dict[str, tuple[str, ...]] | None = None) -> None:
    """One flag per Config field, each in its section's argument group, titled by the section's key in a
    configuration file (`search:`) and printed in SECTIONS' order; the flags are added in the record's order
    (argparse's messages list flags in the order they were added). `kept`: only these sections and, in each,
    these fields ({section: fields}; --help's for one command, `shown.shown`); None: every one."""
    kept = kept if kept is not None else {name: section_fields(name) for name in SECTIONS}
    groups = {name: parser.add_argument_group(name, section_help(cls)) for name, cls in SECTIONS.items()
              if name in kept}
    for f in fields(Config):
        if f.name not in kept.get(SECTION_OF[f.name], ()):
            continue
        group = groups[SECTION_OF[f.name]]
        kind = {"int": int, "float": float, "str": str, "bool": bool}[KINDS[f.name][0]]
        default = f.default if f.default is not MISSING else None
        # None means "not given"; the help text says what that does where it matters.
        # %(default)s: the help shows the defaults the parser ends with (a task's recipe with --task, a preset's)
        text = f.metadata["help"].replace("%", "%%") + ("" if default is None else " (default: %(default)s)")
        if f.metadata["parse"] is not None:
            group.add_argument(_flag(f.name), type=f.metadata["parse"], default=default, help=text,
                               choices=f.metadata.get("choices"))  # checked after the parser's own words
        elif kind is bool and (default or f.metadata["inherited"] and not f.name.startswith("no_")):
            # --FLAG / --no-FLAG: a recipe or a preset may turn it on (Karel's --rl-from-best), and the user's
            # --no-FLAG, equal to Config's default, still wins over it
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                               help=f.metadata["help"].replace("%", "%%"))
        elif kind is bool:
            group.add_argument(_flag(f.name), action="store_true", help=f.metadata["help"].replace("%", "%%"))
        else:
            group.add_argument(_flag(f.name), type=_typed(f, kind), default=default, choices=f.metadata["choices"],
                               help=text)


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(**{f.name: getattr(args, f.name) for f in fields(Config)})


def config_from_dict(saved: dict) -> Config:
    """A checkpoint's config: fields this version does not know are dropped, new ones take their defaults."""
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in saved.items() if k in known})
