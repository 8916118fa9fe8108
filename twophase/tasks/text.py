"""Text-to-text tasks on the built-in LSTM: CMUdict grapheme-to-phoneme (`g2p`, the default) and TSV files (`tsv`).

Sources and targets are token sequences with vocabularies built from the training data (saved in checkpoints);
a reward sees target tokens joined by single spaces, and `sources` as the source text.
"""
from __future__ import annotations

import os

from ..models.seq2seq import Seq2Seq
from ..vocab import Vocab
from .base import Example, Metric, Task
from .data import (Dataset, DataError, limit_names, load_cmudict, load_tsv, pad_batch, read_lines,
                   tokenize_source)
from .metrics import evaluate_sums, scores_from_sums, stress_free_correct
from .prompts import PromptTables
from .table import is_table


def examples(data: Dataset, char_source: bool) -> list[Example]:
    joiner = "" if char_source else " "
    return [Example(joiner.join(src), [" ".join(r) for r in refs]) for src, refs in zip(data.sources, data.references)]


LSTM_FLAGS = frozenset({"embed_dim", "hidden_size", "bidirectional", "dropout"})  # the built-in Seq2Seq's


class TextTask(Task):
    """Token sequences in, token sequences out, scored by sequence accuracy and token error rate."""

    flags = LSTM_FLAGS

    # Named as metrics.jsonl, the progress lines and --best-metric name them: the keys are G2P's (a sequence is
    # its "word"), so the labels say both.
    metrics = (Metric("word_acc", "sequence accuracy (word_acc)"),
               Metric("per", "token error rate (per)", higher_is_better=False))

    def __init__(self, cfg, char_source: bool, char_target: bool, fold_case: bool = False):
        super().__init__()
        self.cfg = cfg
        self.char_source, self.char_target, self.fold_case = char_source, char_target, fold_case
        self.src_vocab: Vocab | None = None
        self.tgt_vocab: Vocab | None = None

    def splits(self) -> tuple[Dataset, Dataset, Dataset | None]:
        raise NotImplementedError

    def load_data(self) -> None:
        train, valid, test = self.splits()
        self.train, self.valid = examples(train, self.char_source), examples(valid, self.char_source)
        self.test = examples(test, self.char_source) if test is not None else []
        if self.src_vocab is None:  # a fresh run; --resume and decode restore the saved ids instead
            self.src_vocab = Vocab.build(self.source_tokens(e.source) for e in self.train)
            self.tgt_vocab = Vocab.build([*(r.split() for e in self.train for r in e.references),
                                          self.output_tokens()])

    def output_tokens(self) -> list[str]:
        """--target-vocab's tokens (split as the targets are), beside the references' in the output vocabulary;
        none without the flag."""
        path = getattr(self.cfg, "target_vocab", None)
        if not path:
            return []
        try:
            lines = read_lines(path)
        except DataError as err:
            raise DataError(f"--target-vocab: {err}") from None
        tokens = [t for line in lines for t in tokenize_source(line, self.char_target)]
        if not tokens:
            raise DataError(f"--target-vocab {path}: no tokens (whitespace-separated, one or more a line)")
        return tokens

    def state_dict(self) -> dict:
        return {"src_vocab": self.src_vocab.itos, "tgt_vocab": self.tgt_vocab.itos, "char_source": self.char_source,
                "char_target": self.char_target, "fold_case": self.fold_case}

    def load_state_dict(self, state: dict) -> None:
        self.src_vocab, self.tgt_vocab = Vocab(state["src_vocab"]), Vocab(state["tgt_vocab"])
        self.char_source, self.char_target = state["char_source"], state["char_target"]
        self.fold_case = state.get("fold_case", False)

    def build_model(self) -> Seq2Seq:
        cfg = self.cfg
        return Seq2Seq(len(self.src_vocab), len(self.tgt_vocab), cfg.embed_dim, cfg.hidden_size, cfg.dropout,
                       cfg.bidirectional)

    def source_tokens(self, source: str) -> tuple[str, ...]:
        return tokenize_source(source.lower() if self.fold_case else source, self.char_source)

    def collate(self, batch: list[Example], device):
        return pad_batch([self.src_vocab.encode(self.source_tokens(e.source)) for e in batch], device)  # (B, S), (B,)

    def target_ids(self, example: Example) -> list[list[int]]:
        return [self.tgt_vocab.encode(r.split()) for r in example.references]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(self.tgt_vocab.decode(ids))

    def format_output(self, hypothesis: str) -> str:
        return "".join(hypothesis.split()) if self.char_target else hypothesis

    def unknown_source_tokens(self, source: str) -> list[str]:
        return [t for t in self.source_tokens(source) if t not in self.src_vocab.stoi]

    def metric_sums(self, hypotheses: list[str], batch: list[Example]) -> dict:
        if not self.metrics:  # prompt tables without references: the reward is all validation reports
            return {"n": len(batch)}
        return evaluate_sums([h.split() for h in hypotheses], [[r.split() for r in e.references] for e in batch])

    def scores(self, sums: dict) -> dict:
        """The task's metrics and n: not G2P's wer (1 - word_acc, a word's error rate where words are the
        sequences), which no table row shows."""
        if not self.metrics:
            return {"n": int(sums["n"])}
        scores = scores_from_sums(sums)
        return {m.key: scores[m.key] for m in self.metrics} | {"n": scores["n"]}


class G2P(TextTask):
    """CMUdict (the `cmudict` package): a word's letters -> its ARPAbet phonemes with stress; case folded."""

    name = "g2p"
    main_metric = "word_acc"
    metrics = (Metric("word_acc", "word accuracy"), Metric("wer", "word error rate", higher_is_better=False),
               Metric("per", "phoneme error rate", higher_is_better=False),
               Metric("wer_nostress", "WER without stress", higher_is_better=False))
    # A warm start that has converged: the rate halves at each validation without a better word accuracy and MLE
    # ends below 2.5e-4 (docs/g2p.md), so the RL phase and its equal-time control start where more MLE barely
    # helps. --mle-steps is then a maximum. The equal-time MLE control runs after RL: the closing table's third
    # column, the shipped demo's honest comparison.
    flag_defaults = dict(lr_decay=0.5, mle_steps=10000, compare_mle=True)

    def __init__(self, cfg):
        super().__init__(cfg, char_source=True, char_target=False, fold_case=True)

    def metric_sums(self, hypotheses: list[str], batch: list[Example]) -> dict:
        """Also the word error rate without stress digits, the measure of the stress-free CMUdict literature."""
        hyps, refs = [h.split() for h in hypotheses], [[r.split() for r in e.references] for e in batch]
        return {**evaluate_sums(hyps, refs), "correct_nostress": stress_free_correct(hyps, refs)}

    def scores(self, sums: dict) -> dict:
        return {**scores_from_sums(sums), "wer_nostress": 1.0 - sums["correct_nostress"] / sums["n"]}

    def splits(self):
        return load_cmudict()


class TSV(PromptTables, TextTask):
    """`--train FILE --valid FILE [--test FILE]`: UTF-8 `source<TAB>target` lines; repeated sources are several
    references. Or prompt tables (.jsonl, .json, .csv, .parquet: `twophase.tasks.prompts`), one example per row;
    the built-in LSTM takes string prompts, and its output vocabulary is the references' tokens and those of
    --target-vocab FILE (without either, the prompts' tokens: a reward wanting another token needs the file). With
    --hf-model, `twophase.tasks.build` makes it a Hugging Face model's TSV task instead (`twophase.tasks.hf.HFTSV`),
    whichever way `tsv` was found (built-in or entry point)."""

    name = "tsv"
    flags = LSTM_FLAGS | {"train", "valid", "test", "char_source", "char_target", "lowercase_source", "max_src_len",
                          "too_long", "hf_model", "target_vocab"}
    # Exact match can be near zero on such data (translation, say): the best checkpoint is the best reward.
    main_metric = None

    def __init__(self, cfg):
        super().__init__(cfg, char_source=cfg.char_source, char_target=cfg.char_target,
                         fold_case=cfg.lowercase_source)
        self.lengths = None  # load_tsv's token counts of the lines (HFTSV: its tokenizer's); None: whitespace tokens

    def load_data(self) -> None:
        if not is_table(self.cfg.train):
            for flag, path in (("--valid", self.cfg.valid), ("--test", self.cfg.test)):
                if is_table(path):
                    raise DataError(f"{flag} {path}: a table beside the TSV --train file; give every split in one "
                                    "format")
            return super().load_data()
        self.load_tables()
        if self.src_vocab is None:
            self.src_vocab = Vocab.build(self.source_tokens(e.source) for e in self.train)
            refs = [r.split() for e in self.train for r in e.references]
            given = self.output_tokens()  # --target-vocab: the tokens a reward wants
            if not refs and not given:  # prompts alone: the outputs are spelt in the prompts' tokens
                refs = [self.source_tokens(e.source) for e in self.train]
            self.tgt_vocab = Vocab.build([*refs, given])

    def describe(self) -> str:
        """`tsv`, or on prompt tables `tsv (JSONL prompts)`: the files' format, which the name does not say."""
        if not is_table(self.cfg.train):
            return super().describe()
        kind = os.path.splitext(str(self.cfg.train))[1].lstrip(".").upper()
        return f"{super().describe()} ({kind} prompts{', chat messages' if self.chat else ''})"

    def prompt_text(self, prompt, where: str) -> str:
        if isinstance(prompt, list):
            raise DataError(f"{where}: a conversational prompt (chat messages) needs --hf-model, whose tokenizer's "
                            "chat template renders it")
        return prompt

    def count_tokens(self, sources: list[str], references: list[list[str]]):
        """Sources and references in the built-in vocabularies' tokens (references re-split for --char-target)."""
        for refs in references:
            refs[:] = [" ".join(tokenize_source(r, self.char_target)) for r in refs]
        return [len(self.source_tokens(s)) for s in sources], [[len(r.split()) for r in refs] for refs in references]
    def source_problem(self, source: str, max_len: int) -> str | None:
        """Sources longer than --max-src-len were refused in training: so they are in decoding."""
        count = len(self.source_tokens(source))
        if count > self.cfg.max_src_len:
            return f"source has {count} tokens, more than the training limit of --max-src-len {self.cfg.max_src_len}"
        return None

    def splits(self):
        cfg = self.cfg
        if cfg.train is None or cfg.valid is None:
            raise DataError("the tsv task needs --train FILE and --valid FILE")
        limits = dict(max_source_len=cfg.max_src_len, max_target_len=cfg.max_len - 1, too_long=cfg.too_long,
                      lowercase_source=self.fold_case, lengths=self.lengths, limit_names=limit_names(cfg))
        out = []
        for flag, path in (("--train", cfg.train), ("--valid", cfg.valid), ("--test", cfg.test)):
            data = load_tsv(path, self.char_source, self.char_target, **limits) if path else None
            if data is not None and data.skipped:
                self.notes.append(f"{flag}: skipped {data.skipped} lines longer than the limits (--too-long skip)")
            out.append(data)
        return tuple(out)
