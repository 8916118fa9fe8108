"""`--task countdown`: numbers and a target in, an RPN expression out, judged by a checker (docs/countdown.md).

The model is the built-in LSTM encoder-decoder: the source is the problem's tokens (`3 7 25 = 250`), the output
one token per number and per operator. The splits are generated (`problems`, seed 0 whatever --seed, so every
training seed sees the same problems) and cached as TSV files, which the run records as its --train, --valid and
--test; a user's TSV file given as --train, --valid or --test replaces that split. A training problem without a
solution (a share `--countdown-hidden` of the generated ones, 80% by default) has no reference: MLE never sees it, RL trains on it
with the checker (`reward.countdown`, the task's default reward).

Sizes: --train-size problems (default 20,000), --valid-size validation problems and as many test problems
(default 1,000 each). The output vocabulary is the operators and every number of a training source.

Metrics: `solved` (the checker accepts the best candidate) and `solved_at_k` (it accepts one of the --eval-beam
candidates; the recipe sets --eval-beam to --beam-size, the K of RL).
"""
from __future__ import annotations

from ...config import section_fields
from ...vocab import SPECIALS, Vocab
from .. import TaskError
from ..base import Example, Metric
from ..data import DataError
from ..text import LSTM_FLAGS, TextTask
from . import problems
from .grammar import RPNGrammar
from .problems import Params, parse_source
from .reward import solved
from .rpn import OPS, solve

DEFAULT_TRAIN, DEFAULT_VALID = 20_000, 1_000


def as_example(p: problems.Problem) -> Example:
    return Example(p.source, [p.solution] if p.solution else [])


class Countdown(TextTask):
    name = "countdown"
    default_reward = "twophase.tasks.countdown.reward:countdown"  # also the `countdown` entry point of rewards
    metrics = (Metric("solved", "solved (top-1)"), Metric("solved_at_k", "solved by one of the beam"))
    main_metric = "solved"
    flags = LSTM_FLAGS | {"train", "valid", "test", "train_size"} | frozenset(section_fields("countdown"))
    # The recipe `train.py --task countdown` runs (docs/countdown.md), sized on the validation split: MLE at a
    # constant rate (its top-1 stops rising within 1,000 steps) and RL from its best validation; beam-RL
    # (Bunel et al.'s objective) with K 8, and the checker's solved_at_k over the same K; the grammar keeps
    # every candidate a well-formed expression. 80% of the training problems come without a solution
    # (--countdown-hidden's default).
    flag_defaults = dict(hidden_size=256, embed_dim=64, max_len=12, grammar="on", mle_steps=2000,
                         rl_from_best=True, objective="beam", beam_size=8, eval_beam=8, rl_steps=1500, rl_lr=2e-4,
                         eval_every=500, save_dir="runs/countdown", compare_mle=True)

    def __init__(self, cfg):
        super().__init__(cfg, char_source=False, char_target=False)
        self.params = Params(cfg.countdown_numbers, cfg.countdown_max, cfg.countdown_target_min,
                             cfg.countdown_target_max, cfg.countdown_hidden)
        problem = self.params.check()
        if problem:
            raise TaskError(problem)
        self.counts: list[int] | None = None  # how many numbers a problem has (the grammar's), saved
        self.files: dict[str, str] = {}

    # ---- data and state
    def load_data(self) -> None:
        cfg = self.cfg
        given = {s: getattr(cfg, s) for s in problems.SPLITS if getattr(cfg, s)}
        files = dict(given)
        if len(given) < len(problems.SPLITS):
            valid = cfg.valid_size or DEFAULT_VALID
            counts = {"train": cfg.train_size or DEFAULT_TRAIN, "valid": valid, "test": valid}
            try:
                paths, cached = problems.cached_files(counts, self.params)
            except ValueError as err:
                raise DataError(f"countdown data: {err}") from None
            files = {s: str(given.get(s) or paths[s]) for s in problems.SPLITS}
            self.notes.append(f"countdown: {'loaded' if cached else 'generated and cached'} "
                              f"{paths['train'].parent}")
        self.files = files
        splits = {s: problems.read_tsv(path) for s, path in files.items()}
        self.problems = splits
        self.train, self.valid, self.test = ([as_example(p) for p in splits[s]] for s in problems.SPLITS)
        hidden = sum(not ex.references for ex in self.train)
        self.notes.append(f"countdown: {len(self.train)} train problems ({hidden} without a solution: RL only) / "
                          f"{len(self.valid)} valid / {len(self.test)} test")
        if self.src_vocab is None:  # a fresh run; --resume and decode restore the saved ids
            self.src_vocab = Vocab.build(self.source_tokens(ex.source) for ex in self.train)
            numbers = sorted({n for p in splits["train"] for n in p.numbers})
            self.tgt_vocab = Vocab(list(SPECIALS) + list(OPS) + [str(n) for n in numbers])
            self.counts = sorted({len(p.numbers) for s in problems.SPLITS for p in splits[s]})

    def data_files(self) -> dict:
        """The files the splits were read from, generated or given (`Task.data_files`)."""
        return dict(self.files)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "counts": self.counts}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.counts = state["counts"]

    def grammar(self, max_len: int) -> RPNGrammar:
        return RPNGrammar(self.tgt_vocab.itos, self.tgt_vocab.stoi["</s>"], self.counts, max_len)

    # ---- decoding
    def parse_source(self, line: str) -> str:
        """`3 7 25 = 250` or `3 7 25 250`: the numbers, then the target; a TSV line's SOURCE (what precedes a
        tab), so a split's file decodes as it is."""
        try:
            numbers, target = parse_source(line.partition("\t")[0])
        except ValueError as err:
            raise DataError(f"countdown source: {err}") from None
        return problems.Problem(numbers, target).source

    # ---- validation
    def metric_sums(self, hypotheses: list[str], batch: list[Example]) -> dict:
        return {"solved": sum(solved(h, ex.source) for h, ex in zip(hypotheses, batch)), "n": len(batch)}

    def nbest_metric_sums(self, nbest: list[list[str]], batch: list[Example]) -> dict:
        sums = self.metric_sums([hyps[0] for hyps in nbest], batch)
        sums["in_beam"] = sum(any(solved(h, ex.source) for h in hyps) for hyps, ex in zip(nbest, batch))
        return sums

    def scores(self, sums: dict) -> dict:
        n = max(sums["n"], 1)
        out = {"solved": sums["solved"] / n}
        if "in_beam" in sums:
            out["solved_at_k"] = sums["in_beam"] / n
        return {**out, "n": sums["n"]}

    def closing_lines(self) -> list[str]:
        """The exhaustive solver's share of the test problems: the ceiling (100% on generated problems)."""
        test = self.problems.get("test") or []
        if not test:
            return []
        found = sum(solve(p.numbers, p.target) is not None for p in test)
        return [f"countdown: the exhaustive solver (rpn.solve) solves {found / len(test):.2%} of the "
                f"{len(test)} test problems: a testbed for the method, not an application"]
