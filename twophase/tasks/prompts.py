"""`--train/--valid/--test` as prompt tables (`twophase.tasks.table`): the data half of the `tsv` task (built-in
LSTM and `--hf-model`) when the files are JSONL, JSON, CSV or parquet instead of TSV.

Each row is one `Example`: source = the prompt as the file holds it (a string, or chat messages: what a reward's
`sources` / `prompts` receive), references = its `completion` / `target` (none: RL only), fields = every other
column. A source longer than --max-src-len, or a reference that does not fit in --max-len with its EOS, is
refused with FILE:LINE or, with --too-long skip, left out and counted. Where some training or validation row
has no reference, validation reports the reward(s) only (the task's metrics compare with references).
"""
from __future__ import annotations

from .base import Example
from .data import DataError, _check_length, limit_names
from .table import Row, is_table, read_table


class PromptTables:
    """Mixed into `TSV`: `load_tables` fills the splits from table files. The host provides `cfg`, `notes`,
    `prompt_text(prompt, where)` (the text a prompt is tokenized as) and `count_tokens(prompts, references)`
    (their lengths in the model's tokens; it may rewrite the references as the model's tokens read them)."""

    chat = False  # whether the prompts are chat messages (decoding then wraps an input line as a user message)
    unreferenced: dict = {}  # flag -> (FILE:LINE of its first row without a reference, such rows, rows kept)

    def load_tables(self) -> None:
        cfg = self.cfg
        splits = []
        self.unreferenced = {}
        for flag, path in (("--train", cfg.train), ("--valid", cfg.valid), ("--test", cfg.test)):
            if path is None:
                splits.append([])
                continue
            if not is_table(path):
                raise DataError(f"{flag} {path}: a TSV file beside table files; give every split in one format")
            splits.append(self._examples(flag, read_table(path)))
        self.train, self.valid, self.test = splits
        kinds = {isinstance(ex.source, list) for ex in self.train + self.valid + self.test}
        if len(kinds) > 1:
            raise DataError("the prompts mix strings and chat messages; give every row one kind")
        self.chat = kinds == {True}
        rows = self.train + self.valid
        if not all(ex.references for ex in rows):
            self.metrics = ()  # an instance's own: the task's metrics need a reference for every example
            missing = sum(not ex.references for ex in rows)
            some = "no training or validation row has a reference" if missing == len(rows) else \
                f"{missing} of the {len(rows)} training and validation rows have no reference"
            self.notes.append(f"{some} (completion/target): validation reports the reward only")

    def _examples(self, flag: str, rows: list[Row]) -> list[Example]:
        cfg = self.cfg
        named = limit_names(cfg)
        for r in rows:
            self.prompt_text(r.prompt, r.where)  # a prompt it cannot render is refused naming its row
        source_counts, ref_counts = self.count_tokens([r.prompt for r in rows], [r.references for r in rows])
        out, skipped, missing = [], 0, []  # missing: FILE:LINE of the kept rows without a reference
        for row, n_source, n_refs in zip(rows, source_counts, ref_counts):
            where = row.where.rpartition(":")
            line = where[2].removeprefix("row ")
            keep = _check_length(where[0], line, "source", n_source, cfg.max_src_len, cfg.too_long, named[0])
            keep = keep and all(_check_length(where[0], line, "target", n, cfg.max_len - 1, cfg.too_long, named[1])
                                for n in n_refs)
            if keep:
                out.append(Example(row.prompt, row.references, row.fields))
                if not row.references:
                    missing.append(row.where)
            else:
                skipped += 1
        if skipped:
            self.notes.append(f"{flag}: skipped {skipped} rows longer than the limits (--too-long skip)")
        if not out:
            raise DataError(f"{rows[0].where.rpartition(':')[0]}: no data ({skipped} rows longer than the limits)")
        if missing:
            self.unreferenced[flag] = (missing[0], len(missing), len(out))
        return out
