"""Configuration files: `train.py --config FILE.yaml` (or `.json`) and `train.py --print-config`.

A file holds `Config` fields as `key: value` (YAML) or one JSON object: the field names (`rescore_chunk`) or the
flags' spellings (`rescore-chunk`), at the top or inside their section (`search: {beam_size: 8}`, the sections of
`train.py --help all`; `--print-config` writes them so). Its values are defaults of the command, so a flag given with
it still wins.
The layers, lowest first: Config's defaults < the task's recipe (`Task.flag_defaults`) < `--preset` < the file <
the command line. `--resume` takes the checkpoint's configuration in place of the first three (the file and the
flags then change it where the resume rules allow); `--init-from` takes its checkpoint's model flags over its
task's recipe, the file over both. Relative paths in a file are read from the working directory, as flags are.

A run's own record, `<save-dir>/config.json` (`{"config": {...}, "recipe": ..., "started_from": ...}`), is a valid
file and reproduces that run. What a record says about the command that wrote it (`RECORD_ONLY`: its --save-dir,
--resume, --resume-from, --overwrite, --eval-only) is not taken from it, so a run started from another's record
never continues, replaces or writes into that run: it goes to --save-dir (default runs/<task>, refused while it
holds a run). A hand-written file may not set `COMMAND_ONLY` at all: whether to continue, replace or only
evaluate a run is said on the command line (or to `twophase.fit`), never remembered in a file.

YAML is read with PyYAML under YAML 1.2's rules for booleans and numbers: `on`, `off`, `yes` and `no` stay strings
(`grammar: on`), `1e-4` is a number. A bad key or value is a one-line ConfigFileError naming the file, the line
(where the parser gives one) and the key.
"""
from __future__ import annotations

import json
import re
from dataclasses import MISSING, fields
from pathlib import Path

from . import FIELDS, SECTION_OF, SECTIONS, Config, values
from .values import ConfigError

COMMAND_ONLY = ("resume", "resume_from", "overwrite", "eval_only")  # a file may not set these
RECORD_ONLY = ("save_dir",) + COMMAND_ONLY  # a run's config.json: taken as it is, less these


class ConfigFileError(ConfigError):
    """A configuration file that cannot be read or holds a bad key or value; one line naming the file."""


def _yaml_loader():
    """PyYAML's safe loader with YAML 1.2's booleans (true/false only) and floats (1e-4 without a dot)."""
    try:
        import yaml
    except ImportError:
        return None

    class Loader(yaml.SafeLoader):
        pass

    bool_tag, float_tag = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
    Loader.yaml_implicit_resolvers = {ch: [(tag, rx) for tag, rx in rules if tag != bool_tag]
                                      for ch, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    Loader.add_implicit_resolver(float_tag, re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return Loader


def _read_yaml(path: str, text: str) -> tuple[object, dict]:
    """The document and the line of each key of its top mapping (and of a record's "config" mapping)."""
    loader = _yaml_loader()
    if loader is None:
        raise ConfigFileError(f"--config {path}: reading YAML needs PyYAML: pip install pyyaml (or give a .json "
                              "file)")
    import yaml

    try:
        node = yaml.compose(text, Loader=loader)
        doc = yaml.load(text, Loader=loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        place = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigFileError(f"{place}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
    lines: dict = {}
    mappings = [(node, "")] if isinstance(node, yaml.MappingNode) else []
    while mappings:
        mapping, prefix = mappings.pop()
        seen = set()
        for key, value in mapping.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name in seen:
                raise ConfigFileError(f"{path}:{key.start_mark.line + 1}: {prefix}{name}: given twice")
            seen.add(name)
            lines.setdefault(f"{prefix}{name}", key.start_mark.line + 1)
            if not isinstance(value, yaml.MappingNode) or mapping is not node:
                continue
            if name == "config":  # a run's record: its fields, flat
                mappings.append((value, ""))
            elif name in SECTIONS:  # a section's fields, keyed "section.field"
                mappings.append((value, f"{name}."))
    return doc, lines


def _read_json(path: str, text: str) -> tuple[object, dict]:
    def pairs(items):
        out = {}
        for key, value in items:
            if key in out:
                raise ConfigFileError(f"{path}:{_line_of(text, key)}: {key}: given twice")
            out[key] = value
        return out

    try:
        doc = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as err:
        raise ConfigFileError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
    return doc, {}


def _line_of(text: str, key: str) -> int | None:
    """The line of a JSON key's first occurrence (json gives no positions)."""
    m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
    return text.count("\n", 0, m.start()) + 1 if m else None


def read(path) -> dict:
    """The Config fields a file sets, checked: {field name: value}. ConfigFileError (one line) otherwise."""
    path = str(path)
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigFileError(f"--config {path}: a configuration file ends in .yaml, .yml or .json")
    if Path(path).is_dir():
        raise ConfigFileError(f"--config {path}: a directory, not a file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigFileError(f"--config {path}: cannot read it ({getattr(err, 'strerror', None) or err})") \
            from None
    doc, lines = _read_yaml(path, text) if suffix != ".json" else _read_json(path, text)
    if doc is None or doc == {}:  # an empty file (or comments only) would train the default task unawares
        raise ConfigFileError(f"{path}: sets nothing (an empty file); a configuration file holds Config fields as "
                              "key: value (python train.py --print-config writes one)")
    if not isinstance(doc, dict):
        raise ConfigFileError(f"{path}: expected a mapping of Config fields (key: value), got "
                              f"{type(doc).__name__}")
    record = isinstance(doc.get("config"), dict)  # a run's config.json
    out, spelled = {}, {}

    def where(key) -> str:
        # JSON: the key as written at the top, else a section's field by its own name
        line = lines.get(key) if lines else _line_of(text, key) or _line_of(text, key.rpartition(".")[2])
        return f"{path}:{line}" if line else path

    items = {key: (key, value) for key, value in doc["config"].items()} if record else _unsectioned(doc, where)
    for key, (field_key, value) in items.items():
        name = field_key.replace("-", "_") if isinstance(field_key, str) else field_key
        if name not in FIELDS:
            if record:  # a field of another version of twophase: as a checkpoint's, dropped
                continue
            raise ConfigFileError(f"{where(key)}: {key}: unknown key{values.did_you_mean(name)}; the keys are "
                                  "train.py's flags (python train.py --help all)")
        if name in spelled:
            raise ConfigFileError(f"{where(key)}: {key}: given twice (as {spelled[name]} too)")
        spelled[name] = key
        if record and name in RECORD_ONLY:
            continue
        if name in COMMAND_ONLY:
            raise ConfigFileError(f"{where(key)}: {key}: what a command does with a run is said on its command "
                                  f"line (--{name.replace('_', '-')}), not in a configuration file")
        out[name] = check_value(name, value, f"{where(key)}: {key}")
    return out


def _unsectioned(doc: dict, where) -> dict:
    """A hand-written file's keys, each {label: (its field's key, value)}: a top-level key is its own label, a
    section's field is labelled "section.field" (`search: {beam_size: 8}` gives "search.beam_size"); a field
    inside a section other than its own is refused in one line."""
    items = {}
    for key, value in doc.items():
        if key not in SECTIONS:
            items[key] = (key, value)
            continue
        if not isinstance(value, dict):
            raise ConfigFileError(f"{where(key)}: {key}: a section holds its fields as key: value, got "
                                  f"{_shown(value)}")
        for inner, field_value in value.items():
            label = f"{key}.{inner}"
            name = inner.replace("-", "_") if isinstance(inner, str) else inner
            if name in SECTION_OF and SECTION_OF[name] != key:
                raise ConfigFileError(f"{where(label)}: {label}: {name} is in the {SECTION_OF[name]} section, not "
                                      f"{key} (python train.py --help {SECTION_OF[name]})")
            items[label] = (inner, field_value)
    return items


def check_value(name: str, value, label: str):
    """`value` for the field `name` as its flag would take it (type, parse, range, choices), or
    ConfigFileError starting with `label`."""
    return values.checked(name, value, label, ConfigFileError)


_shown = values.shown


def changed(settings: dict) -> frozenset[str]:
    """The fields of a file's `settings` that count as given to start's checks (a shaping flag the task does not
    read, an explicit --compare-mle): those differing from Config's defaults, so a run's record, which lists
    every field, gives only what its run changed. (Every key of a file wins over the recipe and the preset.)"""
    return frozenset(k for k, v in settings.items()
                     if FIELDS[k].default is MISSING or v != FIELDS[k].default)


def dumps(cfg: Config, origins: dict | None = None) -> str:
    """`--print-config`: the configuration as YAML that `--config` reads back to the same Config, in the sections
    of `train.py --help` (every field but COMMAND_ONLY; each value a JSON scalar, which YAML 1.2 reads as JSON
    does). `origins`: where a value came from, by field (`layers.resolve`'s), shown as a trailing comment where it
    is not Config's default."""
    origins = origins or {}
    lines = ["# twophase configuration: python train.py --config FILE.yaml (flags given with it still win)"]
    for name, section in SECTIONS.items():
        shown = [f.name for f in fields(section) if f.name not in COMMAND_ONLY]
        if shown:
            title = f"  # {section.title}" if section.title != name else ""
            lines += [f"{name}:{title}"] + [f"  {n}: {json.dumps(getattr(cfg, n))}"
                                            + (f"  # {origins[n]}" if n in origins else "") for n in shown]
    return "\n".join(lines) + "\n"
