"""What a task supplies to training, validation and decoding; the trainer knows nothing else about the data.

A task holds three splits of `Example`s and knows how a batch of them becomes a model's `source` (`collate`),
which model to build, how a candidate row becomes the string a reward sees (`detokenize`), and how
validation scores best candidates (`metric_sums`, added up over batches and processes, then `scores`).
Its `state_dict` (vocabularies, say) goes into every checkpoint, so decoding and `--resume` rebuild the same
ids without the data.

A task is found by `--task NAME` (see twophase.tasks.get): `package.module:callable`, an entry point of the
group `twophase.tasks`, or a built-in (`g2p`, `tsv`, `karel`, `countdown`). The callable takes the task's settings (the
training Config's data, model, karel and lora sections and max_len, by their Config names: `cfg.hidden_size`,
`cfg.train`; `twophase.config.TaskConfig`) and returns a `Task`; it should be cheap: data is read by
`load_data`, which runs after `load_state_dict` on --resume.
"""
from __future__ import annotations

import random

from dataclasses import dataclass, field
from typing import Any

from ..errors import OneLineError


class TaskError(OneLineError, ValueError):
    """A task could not be found, loaded or built; the message is one line naming it."""


class ExportMismatch(OneLineError, ValueError):
    """An export of the final model, read back as its users read it, is not the model it was written from; the
    message is one line naming the export and the first parameter that differs."""


@dataclass
class Example:
    """One source with its references and any extra data a reward may ask for."""

    source: Any  # the raw source: what a reward's `sources` keyword receives (a string for text tasks)
    references: list[str] = field(default_factory=list)  # target strings, tokens joined by single spaces
    fields: dict = field(default_factory=dict)  # extra per-example data; each key becomes a reward keyword
    hidden: dict = field(default_factory=dict)  # data only the task's metrics read (a held-out test): never
    #                                             offered to a reward, so no plug-in (not even **kwargs) trains on it


@dataclass(frozen=True)
class Metric:
    """A validation score: its key in `scores`, the label of the summary table, and its direction."""

    key: str
    label: str
    fmt: str = "{:.2%}"
    higher_is_better: bool = True


class Task:
    """The base of every task; subclasses fill in the data and the methods below.

    `flags`: the data and model flags (the fields of the configuration's data and model sections) this task reads
    (a model's size, its data files); those it sets in `flag_defaults` count as read too. Given but not read, such
    a flag is refused in one line; every other flag is the trainer's."""

    name = "task"
    default_reward = "edit"  # --reward when not given
    metrics: tuple[Metric, ...] = ()  # validation scores, in the summary table's order
    main_metric: str | None = None  # what --best-metric auto picks; None: the validation reward
    # The task's recipe: train.py flags (Config field names) whose defaults differ for this task, e.g.
    # {"hidden_size": 128}. Flags given on the command line still win; --preset overrides these.
    flag_defaults: dict = {}
    flags: frozenset = frozenset()  # the data and model flags this task reads (see the class docstring)

    def __init__(self):
        self.train: list[Example] = []
        self.valid: list[Example] = []
        self.test: list[Example] = []
        self.notes: list[str] = []  # one-line remarks on the data (lines skipped, say), printed once at start-up

    # ---- data and state
    def load_data(self) -> None:
        """Read or generate the splits (and build vocabularies not restored by load_state_dict)."""
        raise NotImplementedError

    def data_files(self) -> dict:
        """The files a task read its splits from where the flags did not name them ({"train": path, ...}: the
        TSV files of generated problems, say): the run records them as its --train, --valid and --test, so
        decoding and checking find the same data. None by default."""
        return {}

    def state_dict(self) -> dict:
        """Plain data (lists, dicts, numbers, strings) that rebuilds this task's ids without the data."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ---- model
    def build_model(self):
        """A fresh `twophase.SequenceModel` (an nn.Module) for this task's ids."""
        raise NotImplementedError

    def save_final(self, model, save_dir):
        """Write the run's final model in a form of the task's own besides the checkpoints (--hf-model: the
        Hugging Face folder <save-dir>/hf_final), at the end of a run; returns its path, or None (the default:
        the checkpoints are the model)."""
        return None

    def present(self, examples: list[Example], rng=random) -> list[Example]:
        """The training examples as one training step shows them (model and reward): the examples themselves by
        default; a task may show another view each time (Karel: a random 5 of a task's 6 pairs). Randomness from
        `rng` (a `random.Random`: the trainer's, seeded by --seed, drawn alike on every process over the global
        batch and saved in every checkpoint, so a run is reproducible, resumes exactly and does not depend on the
        number of processes)."""
        return examples

    def collate(self, examples: list[Example], device) -> Any:
        """The model's `source` for a batch of examples, on `device`."""
        raise NotImplementedError

    def target_ids(self, example: Example) -> list[list[int]]:
        """Each reference as target ids, without EOS: the rows MLE trains on."""
        raise NotImplementedError

    def detokenize(self, ids: list[int]) -> str:
        """A candidate row (ids up to its EOS, padding after) as the string rewards and metrics see."""
        raise NotImplementedError

    def grammar(self, max_len: int):
        """What `--grammar on` constrains the model to (`twophase.constraints`: start/allowed/advance over
        rows of at most max_len positions, EOS included), or None (the default): the task has none."""
        return None

    # ---- decoding
    def parse_source(self, line: str) -> Any:
        """An input line of `twophase-decode` as an `Example.source`."""
        return line

    def format_output(self, hypothesis: str) -> str:
        """A decoded hypothesis as `twophase-decode` writes it."""
        return hypothesis

    def source_problem(self, source: Any, max_len: int) -> str | None:
        """Why `twophase-decode` cannot decode this source with outputs of up to max_len tokens (longer than
        training allowed, more than the model's positions), or None; reported with its input line."""
        return None

    def unknown_source_tokens(self, source: Any) -> list[str]:
        """Tokens of a source the task cannot represent (decode reports them); none by default."""
        return []

    # ---- validation
    def metric_sums(self, hypotheses: list[str], examples: list[Example]) -> dict:
        """Additive statistics of the best hypotheses of `examples` (summed over batches and processes);
        must include "n", the number of examples."""
        return {"n": len(examples)}

    def nbest_metric_sums(self, nbest: list[list[str]], examples: list[Example]) -> dict:
        """Validation's additive statistics from each example's n-best list (best first, never empty): by default
        `metric_sums` of the best ones; a task may also score a hypothesis it picks from the list (Karel: the
        first that passes the specification, execution-filtered top-1)."""
        return self.metric_sums([hyps[0] for hyps in nbest], examples)

    def scores(self, sums: dict) -> dict:
        """The metrics from summed `metric_sums`."""
        return {}

    def describe(self) -> str:
        """The task as train.py's first line names it: its spec (`tsv`, `module:Class`), with what it reads where
        the name does not say it (the `tsv` task on JSONL prompts, say)."""
        return getattr(self, "spec", self.name)

    def closing_lines(self) -> list[str]:
        """Lines printed after a run's closing table (Karel: its baselines' figures); none by default."""
        return []
