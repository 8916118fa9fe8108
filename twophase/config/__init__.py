"""Training configuration: sections of documented fields, and the flat `Config` built from them.

The package: `documented` (what a documented field and a condition are), `sections` and `runsections` (the sections),
this module (`Config`, its views and its flags), `rules` (the checks across fields and the resume rules), `file`
(`--config FILE` and `--print-config`).

Each section is a dataclass whose fields carry their flag's help text, type, default, valid range and resume rule
(`arg`); a section that only applies under a condition declares it once (`Only`), and `rules` refuses a field
of it given where the condition does not hold. The flat `Config` holds every section's fields under their own names
in one fixed order (`ORDER`: what checkpoints and config.json store), so `cfg.beam_size` and `asdict(cfg)` read as
one record, and `cfg.search` (or `cfg.section("search")`) is the search section's values. The command line is
generated from the fields (`--rescore-chunk` for `rescore_chunk`), one argparse group per section.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import MISSING, field, fields, make_dataclass

from . import rules as configrules
from .documented import DEFAULT_BEAM, PRESETS, _flag, parse_chunk, parse_size  # noqa: F401 (the package's names)
from .runsections import EvaluationConfig, PhaseTwoConfig, RunConfig, StepConfig, SystemConfig  # noqa: F401
from .sections import (FIELDS, SECTION_OF, SECTIONS, SHAPING_FLAGS, TASK_EXTRA, TASK_SECTIONS,  # noqa: F401
                       DataConfig, KarelConfig, LoraConfig, MLEConfig, ModelConfig, PolicyConfig, RLConfig,
                       SearchConfig, section_fields)


# Config's fields in their stored order: the keys of asdict(cfg), of every checkpoint's "config" and of
# config.json, which --config reads back; a new field goes at the end.
ORDER = (
    "preset", "task", "train", "valid", "test", "char_source", "char_target", "lowercase_source", "max_src_len",
    "too_long", "valid_size", "train_size", "hf_model", "embed_dim", "hidden_size", "bidirectional", "dropout",
    "karel_model", "karel_channels", "karel_blocks", "karel_pair_dim", "karel_layers", "mle_steps", "mle_batch_size",
    "lr", "lr_decay", "patience", "min_lr", "rl_steps", "batch_size", "rl_lr", "sampler", "beam_size", "temperature",
    "objective", "baseline", "loss_type", "importance_sampling_level", "delta", "sapo_temperature_pos",
    "sapo_temperature_neg", "off_policy_mask_threshold", "entropy_coef", "top_entropy_quantile",
    "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "mask_truncated_completions", "updates_per_generation", "clip_epsilon", "clip_epsilon_high", "kl_beta",
    "kl_importance_weighted", "ref_checkpoint", "advantage_scale", "drop_zero_std", "mrt_alpha", "compare_mle",
    "mle_weight", "reward", "max_len", "grammar", "rescore_chunk", "memory_budget", "profile_memory", "one_phase",
    "no_prefix_sharing", "reward_weights", "top_k", "top_p", "min_len", "lora_r", "lora_alpha", "lora_dropout",
    "lora_target_modules", "merge_lora", "rl_from_best", "include_reference", "karel_reward_pairs", "test_beam",
    "clip_norm", "eval_every", "eval_beam", "best_metric", "tensorboard", "picture", "log_every", "seed", "device",
    "deterministic", "tf32", "save_dir", "save_every", "keep_last", "resume", "overwrite", "max_bad_steps",
    "threads", "resume_from", "init_from", "eval_only", "export", "grad_accum", "fsdp", "amp", "compile",
    "target_vocab")
assert sorted(ORDER) == sorted(FIELDS) and len(set(ORDER)) == len(ORDER), "ORDER is not the sections' fields"

class _Views:
    """Config's behaviour beside its fields: the section views and the checks (`rules`)."""

    def section(self, name: str):
        """The values of section `name` (a key of SECTIONS) as that section's dataclass: a copy, not a view to
        write through."""
        cls = SECTIONS[name]
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    def for_task(self):
        """What a task reads (`TaskConfig`): the data, model, karel and lora sections and --max-len."""
        return TaskConfig(**{name: getattr(self, name) for name in TASK_FIELDS})

    @property
    def reinforce_baseline(self) -> str:
        """The baseline REINFORCE uses: --baseline, or mean where it was not given (None)."""
        return self.baseline or "mean"

    def validate(self) -> None:
        """Cross-field checks the parser cannot express (`rules.validate`); ValueError naming the flag."""
        configrules.validate(self)

    def warnings(self) -> list[str]:
        """Configurations that train, but not what the user probably means (`rules.warnings`)."""
        return configrules.warnings(self)


def _view(name: str) -> property:
    return property(lambda self: self.section(name), doc=f"The {name} section's values ({SECTIONS[name].__name__}).")


def _make_config():
    specs = [(n, FIELDS[n].type,
              field(default=FIELDS[n].default, metadata=FIELDS[n].metadata)) for n in ORDER]
    cls = make_dataclass("Config", specs, bases=(_Views,), namespace={name: _view(name) for name in SECTIONS})
    cls.__module__ = __name__
    cls.__doc__ = ("Every training setting, one field per train.py flag (the fields of SECTIONS, in ORDER); "
                   "`cfg.<section>` gives one section's values, e.g. `cfg.search.beam_size`.")
    return cls


Config = _make_config()

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
    """argparse type that also enforces the field's minimum, so `--rescore-chunk 0` fails at parse time."""
    minimum = f.metadata["minimum"]

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if kind is float and not math.isfinite(value):  # nan passes every comparison with a minimum
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


class OneLineParser(argparse.ArgumentParser):
    """Bad flags exit with status 2 and one line (argparse would add the whole usage)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def section_help(cls) -> str:
    """A section's description in --help: its docstring's first paragraph, and where it applies."""
    text = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    only = getattr(cls, "only", None)
    return text + (f" Applies {only.described()} only." if only is not None else "")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Config field, each in its section's argument group. The flags are added in ORDER (argparse's
    messages list flags in the order they were added: `--pr` is ambiguous between --preset and --print-config);
    the groups print in SECTIONS' order."""
    groups = {name: parser.add_argument_group(cls.title, section_help(cls)) for name, cls in SECTIONS.items()}
    for f in fields(Config):
        group = groups[SECTION_OF[f.name]]
        kind = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type).split(" ")[0]]
        default = f.default if f.default is not MISSING else None
        # None means "not given"; the help text says what that does where it matters.
        # %(default)s: the help shows the defaults the parser ends with (a task's recipe with --task, a preset's)
        text = f.metadata["help"].replace("%", "%%") + ("" if default is None else " (default: %(default)s)")
        if f.metadata["parse"] is not None:
            group.add_argument(_flag(f.name), type=f.metadata["parse"], default=default, help=text)
        elif kind is bool and default:  # on unless --no-FLAG
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=True,
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
