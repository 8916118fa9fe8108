"""Prompt datasets as TRL reads them: JSONL (and, with the `datasets` package of the `hf` extra, whatever
`datasets.load_dataset` reads from a local file: .json, .csv, .parquet), one example per row.

    prompt                  required: a string, or a list of chat messages ({"role", "content"} dicts), which a
                            Hugging Face tokenizer's chat template renders (`--hf-model`; the built-in LSTM takes
                            strings only)
    completion / target     optional references: a string, a list of strings (several references), or a list of
                            chat messages (their contents joined); null or absent: no reference
    any other column        reaches reward plug-ins by name, one value per hypothesis (`Example.fields`)

A row lacking a column other rows have gets None there (as `datasets` fills it). Bad rows stop the run with
`FILE:LINE: what is wrong` (a JSONL line, a CSV line counting the header; `FILE:row N` for parquet and JSON
files that `datasets` reads).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .data import DataError, read_lines

SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
REFERENCES = ("completion", "target")
# keywords a reward is given by the trainer itself: a column of that name would be shadowed
RESERVED = ("sources", "prompts", "completions", "completion_ids", "hypotheses", "references", "trainer_state")


@dataclass
class Row:
    where: str  # "FILE:LINE" for messages
    prompt: Any  # a string, or a list of {"role", "content"} messages
    references: list[str] = field(default_factory=list)
    fields: dict = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def is_table(path) -> bool:
    """Whether --train/--valid/--test names a table (by its suffix) rather than a TSV file."""
    return path is not None and os.path.splitext(str(path))[1].lower() in SUFFIXES


def read_table(path) -> list[Row]:
    """The rows of a table file, checked (see the module docstring)."""
    name = str(path)
    if not os.path.isfile(name):
        raise DataError(f"{name}: no such file")
    if name.lower().endswith(".jsonl"):
        records = _jsonl(name)
    else:
        records = _load_dataset(name)
    if not records:
        raise DataError(f"{name}: no data")
    columns = list(dict.fromkeys(k for _, rec in records for k in rec))
    for bad in RESERVED:
        if bad in columns:
            raise DataError(f"{name}: column '{bad}' is a keyword rewards are already given; rename it")
    present = [c for c in REFERENCES if c in columns]
    if len(present) > 1:
        raise DataError(f"{name}: both 'completion' and 'target' columns; keep one as the references")
    return [_row(where, {c: rec.get(c) for c in columns}) for where, rec in records]


def _jsonl(name: str) -> list[tuple[str, dict]]:
    records = []
    for number, line in enumerate(read_lines(name), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{name}:{number}: not JSON ({err.msg})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{name}:{number}: expected a JSON object, found {type(rec).__name__}")
        records.append((f"{name}:{number}", rec))
    return records


def _load_dataset(name: str) -> list[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{name}: reading {os.path.splitext(name)[1]} files needs the datasets package "
                        "(pip install 'twophase[hf]'); JSONL files need nothing") from None
    kind = SUFFIXES[os.path.splitext(name)[1].lower()]
    try:
        table = datasets.load_dataset(kind, data_files=name, split="train")
    except Exception as exc:  # datasets' own errors for unreadable files are of many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{name}: cannot read as {kind} ({first})") from None
    offset, unit = (2, ":") if kind == "csv" else (1, ":row ")  # a CSV line counts the header
    return [(f"{name}{unit}{i + offset}", dict(rec)) for i, rec in enumerate(table)]


def _row(where: str, rec: dict) -> Row:
    prompt = rec.pop("prompt", None)
    if prompt is None:
        raise DataError(f"{where}: no 'prompt'")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt")
    elif not _messages(prompt):
        raise DataError(f"{where}: 'prompt' must be a string or a list of {{\"role\", \"content\"}} messages, "
                        f"got {_brief(prompt)}")
    refs = []
    for column in REFERENCES:
        if column in rec:
            refs = _references(where, column, rec.pop(column))
    return Row(where, prompt, refs, rec)


def _messages(value) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))


def _references(where: str, column: str, value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        texts = [value]
    elif _messages(value):
        texts = ["".join(m["content"] for m in value)]  # a conversational completion: its messages' text
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        texts = list(value)
    else:
        raise DataError(f"{where}: '{column}' must be a string, a list of strings or a list of messages, got "
                        f"{_brief(value)}")
    if any(not t.strip() for t in texts):
        raise DataError(f"{where}: empty '{column}'")
    return list(dict.fromkeys(" ".join(t.split()) for t in texts))  # whitespace as detokenised candidates have it


def _brief(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
