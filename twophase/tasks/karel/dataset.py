"""Karel datasets: train/valid/test splits of generated tasks, cached on disk.

`generate_dataset(n_train, n_valid, n_test, seed, **params)` returns {"train": [...], "valid": [...],
"test": [...]} lists of `Example`. No program appears twice, within or across splits. One stream seeded by
`seed` draws a pool of n_train + n_valid + n_test distinct tasks, which a second stream shuffles and cuts into
test, valid and train: every split is drawn from the same distribution (version 1 drew the test split first,
and de-duplication then left the later splits without the short programs the test split had taken). The price:
the splits move when any count changes (another --train-size is another dataset).

The result is written once to `<cache_dir>/<key>.jsonl`, where the key hashes the counts, the seed, every
generator parameter and `GENERATOR_VERSION` (bumped whenever the generator's output changes); a second
call with the same arguments loads that file. The default cache_dir is `$TWOPHASE_CACHE_DIR/karel`, else
`$XDG_CACHE_HOME/twophase/karel`, else `~/.cache/twophase/karel`. The file is written to a temporary file
in the same directory and renamed into place (atomic), so a crash never leaves half a dataset behind.

File format (JSON lines): a header {"format": "twophase-karel", "version", "key", "seed", "counts",
"params"}, then one line per task {"split", "program", "pairs": [[input text, output text], ...]} with
worlds in `World.to_text` format. A damaged file raises ValueError naming FILE:LINE.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from os import PathLike
from pathlib import Path

from .dsl import try_parse
from .generate import Example, GeneratorParams, sample_example
from .world import World

GENERATOR_VERSION = 2  # 2: one pool, shuffled into the splits
SPLITS = ("train", "valid", "test")
_FORMAT = "twophase-karel"

DEFAULT_TRAIN, DEFAULT_VALID = 10_000, 500  # --task karel's sizes (--train-size, --valid-size)
DATA_SEED = 0  # every training seed sees the same tasks


def default_cache_dir() -> Path:
    if os.environ.get("TWOPHASE_CACHE_DIR"):
        return Path(os.environ["TWOPHASE_CACHE_DIR"]) / "karel"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "twophase" / "karel"


def _header(counts: dict, seed: int, params: GeneratorParams) -> dict:
    body = {"version": GENERATOR_VERSION, "seed": seed, "counts": counts, "params": params.as_dict()}
    key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return {"format": _FORMAT, "key": key, **body}


def generate_dataset(n_train: int, n_valid: int, n_test: int, seed: int = 0,
                     cache_dir: str | PathLike | None | bool = True, **params) -> dict[str, list[Example]]:
    """The splits of a generated dataset, from the cache when present (see the module docstring).

    cache_dir: a directory, True for `default_cache_dir()`, or None/False to neither read nor write a cache.
    params: fields of `GeneratorParams` (unknown names raise TypeError, bad values ValueError).
    """
    counts = {"train": n_train, "valid": n_valid, "test": n_test}
    if any(not isinstance(n, int) or n < 0 for n in counts.values()):
        raise ValueError(f"karel dataset: split sizes must be integers >= 0, got {counts}")
    p = GeneratorParams(**params)
    header = _header(counts, seed, p)
    path = None
    if cache_dir is not None and cache_dir is not False:
        path = (default_cache_dir() if cache_dir is True else Path(cache_dir)) / f"{header['key']}.jsonl"
        if path.exists():
            found, splits = load_dataset(path)
            if found != header:
                raise ValueError(f"{path}:1: header does not match the requested dataset; delete the file")
            return splits
    splits = _generate_splits(counts, seed, p)
    if path is not None:
        save_dataset(path, header, splits)
    return splits


def _generate_splits(counts: dict, seed: int, p: GeneratorParams, patience: int = 20000) -> dict:
    taken: set[str] = set()  # no program twice in the pool, hence in no two splits
    # A string seed goes through SHA-512 in random.seed: the same streams on every run and platform.
    rng = random.Random(f"twophase-karel:{seed}:pool")
    pool = [sample_example(rng, p, taken, patience) for _ in range(sum(counts.values()))]
    random.Random(f"twophase-karel:{seed}:shuffle").shuffle(pool)
    splits, start = {}, 0
    for split in ("test", "valid", "train"):
        splits[split], start = pool[start:start + counts[split]], start + counts[split]
    return {s: splits[s] for s in SPLITS}


def save_dataset(path: str | PathLike, header: dict, splits: dict[str, list[Example]]) -> None:
    """Write `header` and the splits as JSON lines, atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(header, sort_keys=True) + "\n")
            for split, examples in splits.items():
                for ex in examples:
                    pairs = [[a.to_text(), b.to_text()] for a, b in ex.pairs]
                    f.write(json.dumps({"split": split, "program": ex.program, "pairs": pairs}) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_dataset(path: str | PathLike) -> tuple[dict, dict[str, list[Example]]]:
    """(header, splits) of a file written by `save_dataset`; ValueError naming FILE:LINE if damaged."""
    splits: dict[str, list[Example]] = {s: [] for s in SPLITS}
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    header = _json_line(path, 1, lines[0] if lines else "")
    if header.get("format") != _FORMAT:
        raise ValueError(f"{path}:1: not a {_FORMAT} file")
    for n, line in enumerate(lines[1:], start=2):
        rec = _json_line(path, n, line)
        try:
            program, split = rec["program"], rec["split"]
            if split not in splits or try_parse(program) is None or not rec["pairs"]:
                raise ValueError(f"bad split {split!r}, program {program!r} or empty pairs")
            pairs = tuple((World.from_text(a, f"pair {i} input"), World.from_text(b, f"pair {i} output"))
                          for i, (a, b) in enumerate(rec["pairs"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{n}: {type(err).__name__}: {err}") from None
        splits[split].append(Example(program, pairs))
    got = {s: len(v) for s, v in splits.items()}
    if "counts" in header and header["counts"] != got:
        raise ValueError(f"{path}:{len(lines)}: {got} tasks, the header says {header['counts']} (truncated?)")
    return header, splits


def _json_line(path, n: int, line: str) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{n}: bad JSON: {err}") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object")
    return rec


def dataset_counts(n_train: int, n_valid: int) -> dict:
    """generate_dataset's counts for --train-size / --valid-size: twice as many test tasks as validation ones."""
    return dict(n_train=n_train, n_valid=n_valid, n_test=2 * n_valid)


def data_key(n_train: int, n_valid: int, seed: int, params: GeneratorParams) -> str:
    """The cache key of the dataset `generated_splits` returns."""
    counts = dataset_counts(n_train, n_valid)
    return _header({s: counts[f"n_{s}"] for s in SPLITS}, seed, params)["key"]


def generated_splits(n_train: int, n_valid: int, seed: int, params: GeneratorParams) -> dict:
    """The generated splits (`generate.Example`s) --task karel trains on, from the cache when there."""
    return generate_dataset(**dataset_counts(n_train, n_valid), seed=seed, **params.as_dict())
