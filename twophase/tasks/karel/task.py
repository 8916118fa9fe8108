"""`--task karel`: program synthesis from input/output examples with an execution reward (Bunel et al., 2018).

Each example is a generated Karel task: the model sees its five specification pairs (`Example.source`, also the
`spec` field the reward reads) and writes a program; the sixth pair (`Example.hidden`, never offered to a
reward) is read by validation metrics only. The data is generated once by `generate_dataset` (seed 0, whatever --seed: every training seed
sees the same tasks) and cached under its default directory ($TWOPHASE_CACHE_DIR/karel, else
~/.cache/twophase/karel), keyed by the sizes and the generator's parameters.

Sizes: --train-size (default 10,000 programs), --valid-size (default 500) and twice as many test programs as
validation ones (default 1,000; the test split is drawn first, from its own stream, so it never moves with
--train-size, and a smaller one is a prefix of a larger one). Worlds are
8x8, programs at most 30 tokens with control statements nested at most 3 deep (`GeneratorParams` defaults):
small enough for a CPU, deep enough that several programs often fit a specification.

Validation metrics, on the best beam candidate: `generalization` (passes all six pairs: top-1 generalization of
Bunel et al.), `exact_match` (the reference program, token for token), `spec_accuracy` (passes the five pairs the
model saw), `syntax_error_rate`, `runtime_error_rate` (crashed or timed out on a specification pair).

A line of `twophase-decode` is a JSON list of [input, output] pairs of worlds in `World.to_text` format.
"""
from __future__ import annotations

import json
import time

import numpy as np
import torch

from ...vocab import SPECIALS, Vocab
from .. import TaskError
from ..base import Example, Metric, Task
from ..data import DataError
from . import architecture, dataset
from .dsl import VOCAB
from .generate import GeneratorParams
from .reward import OK, RUNTIME, SYNTAX, outcome
from .world import World

DEFAULT_TRAIN, DEFAULT_VALID = 10_000, 500
DATA_SEED = 0


def as_example(task) -> Example:
    """A generated task (`generate.Example`) as the trainer's Example: spec in, program out, held-out aside."""
    spec = tuple(task.spec)
    return Example(spec, [task.program], {"spec": spec}, hidden={"held_out": task.held_out})


def pair_array(pair) -> np.ndarray:
    """(32, R, C) uint8: the input world's 16 channels, then the output's."""
    return np.concatenate([pair[0].to_array(), pair[1].to_array()])


class Karel(Task):
    name = "karel"
    default_reward = "twophase.tasks.karel.reward:karel"  # also the `karel` entry point of twophase.rewards
    metrics = (Metric("generalization", "generalization (top-1)"), Metric("exact_match", "exact match"),
               Metric("spec_accuracy", "passes the 5 spec pairs"),
               Metric("syntax_error_rate", "syntax errors", higher_is_better=False),
               Metric("runtime_error_rate", "crashes and time-outs", higher_is_better=False))
    main_metric = "generalization"
    # The recipe `train.py --task karel` runs (docs/karel.md): MLE, beam-RL, the equal-time MLE control and
    # three test passes in about 15 minutes of one core's time (measured: 7 minutes with 600 RL steps), well
    # within 25 minutes on 2 CPU cores. Hidden 128, not 256: an MLE step at 256 cost 3.5x more. The beam
    # objective with K = 16, as Bunel et al.'s RL_beam.
    flag_defaults = dict(hidden_size=128, embed_dim=64, max_len=31, mle_steps=3000, objective="beam",
                         beam_size=16, rl_steps=2000, rl_lr=5e-4, eval_every=1000, save_dir="runs/karel")

    def __init__(self, cfg):
        super().__init__()
        if cfg.train or cfg.valid or cfg.test:
            raise TaskError("--task karel generates its data; --train, --valid and --test are not used")
        problem = architecture.check(cfg)  # --karel-model and its sizes
        if problem:
            raise TaskError(problem)
        self.cfg = cfg
        self.params = GeneratorParams()
        self.vocab = Vocab(list(SPECIALS) + list(VOCAB))

    # ---- data and state
    def load_data(self) -> None:
        cfg, p = self.cfg, self.params
        n_valid = cfg.valid_size or DEFAULT_VALID
        counts = dict(n_train=cfg.train_size or DEFAULT_TRAIN, n_valid=n_valid, n_test=2 * n_valid)
        header = dataset._header({s: counts[f"n_{s}"] for s in dataset.SPLITS}, DATA_SEED, p)
        path = dataset.default_cache_dir() / f"{header['key']}.jsonl"
        cached, start = path.exists(), time.perf_counter()
        try:
            splits = dataset.generate_dataset(**counts, seed=DATA_SEED, **p.as_dict())
        except (ValueError, RuntimeError) as err:
            raise DataError(f"karel data: {err}") from None
        self.train, self.valid, self.test = ([as_example(t) for t in splits[s]] for s in dataset.SPLITS)
        verb = "loaded" if cached else f"generated in {time.perf_counter() - start:.0f} s and cached"
        self.notes.append(f"karel: {len(self.train)} train / {len(self.valid)} valid / {len(self.test)} test tasks "
                          f"{verb}: {path}")
        longest = max(len(r.split()) for ex in self.train for r in ex.references)
        if cfg.max_len < longest + 1:
            self.notes.append(f"karel: warning: --max-len {cfg.max_len} cannot hold the longest training program "
                              f"({longest} tokens + EOS); use --max-len {longest + 1} or more")

    def state_dict(self) -> dict:
        return {"vocab": self.vocab.itos, "params": self.params.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.vocab, self.params = Vocab(state["vocab"]), GeneratorParams(**state["params"])

    # ---- model
    def build_model(self):
        return architecture.build(self.cfg, len(self.vocab), self.params.rows, self.params.cols)

    def collate(self, batch: list[Example], device) -> torch.Tensor:
        grids = np.stack([np.stack([pair_array(pair) for pair in ex.source]) for ex in batch])  # (B, P, 32, R, C)
        return torch.from_numpy(grids).to(device=device, dtype=torch.float32)

    def target_ids(self, example: Example) -> list[list[int]]:
        return [self.vocab.encode(r.split()) for r in example.references]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(self.vocab.decode(ids))

    # ---- decoding
    def parse_source(self, line: str):
        """A JSON list of [input, output] pairs of worlds in text format, of the training grid size."""
        try:
            pairs = json.loads(line)
            spec = tuple((World.from_text(a, "input"), World.from_text(b, "output")) for a, b in pairs)
        except (ValueError, TypeError) as err:
            raise DataError(f"karel source: expected a JSON list of [input, output] world texts ({err})") from None
        p = self.params
        if not spec or any((w.rows, w.cols) != (p.rows, p.cols) for pair in spec for w in pair):
            raise DataError(f"karel source: expected one or more pairs of {p.rows}x{p.cols} worlds")
        return spec

    # ---- validation
    def metric_sums(self, hypotheses: list[str], batch: list[Example]) -> dict:
        sums = dict.fromkeys(("generalization", "exact_match", "spec_ok", SYNTAX, RUNTIME), 0)
        for hyp, ex in zip(hypotheses, batch):
            result = outcome(hyp, ex.fields["spec"])
            sums["spec_ok"] += result == OK
            sums[SYNTAX] += result == SYNTAX
            sums[RUNTIME] += result == RUNTIME
            sums["generalization"] += result == OK and outcome(hyp, [ex.hidden["held_out"]]) == OK
            sums["exact_match"] += hyp.split() in [r.split() for r in ex.references]
        return {**sums, "n": len(batch)}

    def scores(self, sums: dict) -> dict:
        n = max(sums["n"], 1)
        return {"generalization": sums["generalization"] / n, "exact_match": sums["exact_match"] / n,
                "spec_accuracy": sums["spec_ok"] / n, "syntax_error_rate": sums[SYNTAX] / n,
                "runtime_error_rate": sums[RUNTIME] / n, "n": sums["n"]}
