"""`--task karel`: program synthesis from input/output examples with an execution reward (Bunel et al., 2018).

Each example is a generated Karel task: the model sees five pairs (`Example.source`, also the `spec` field the
reward reads) and writes a program; a validation or test task's sixth pair (`Example.hidden`, never offered to a
reward) is read by its metrics only. The data is generated once by `generate_dataset` (seed 0, whatever --seed:
every training seed sees the same tasks) and cached under its default directory ($TWOPHASE_CACHE_DIR/karel, else
~/.cache/twophase/karel), keyed by the sizes and the generator's parameters.

Sizes: --train-size (default 10,000 programs), --valid-size (default 500) and twice as many test programs as
validation ones (default 1,000), all three cut from one shuffled pool of distinct tasks (`dataset`). Worlds are
8x8, programs at most 30 tokens with control statements nested at most 3 deep (`GeneratorParams` defaults):
small enough for a CPU, deep enough that several programs often fit a specification.

Training shows each task a random 5 of its 6 pairs at every presentation (`present`, as Bunel et al.); during RL
the reward checks all six (--karel-reward-pairs all: what Bunel et al.'s released RL command rewards, see
docs/karel.md) or the five shown (shown). Validation and test keep their fixed five specification pairs and
held-out sixth, and their reward reads the five only.

Validation metrics, on the best beam candidate: `generalization` (passes all six pairs: top-1 generalization of
Bunel et al.), `exact_match` (the reference program, token for token), `spec_accuracy` (passes the five pairs the
model saw), `syntax_error_rate`, `runtime_error_rate` (crashed or timed out on a specification pair); on the
whole beam: `filtered_generalization` (the first candidate that passes the five specification pairs, where one
does, also passes the held-out pair: execution-filtered top-1) and `spec_in_beam` (some candidate passes the five).

A line of `twophase-decode` is a JSON list of [input, output] pairs of worlds in `World.to_text` format.
"""
from __future__ import annotations

import json
import random
import time

import torch

from ...config import section_fields
from ...vocab import SPECIALS, Vocab
from .. import TaskError
from ..base import Example, Metric, Task
from ..data import DataError
from . import architecture, dataset
from .dataset import DATA_SEED, DEFAULT_TRAIN, DEFAULT_VALID, data_key, dataset_counts  # noqa: F401
from .dsl import VOCAB
from .generate import GeneratorParams
from .grammar import KarelGrammar, karel_grammar
from .grids import PairSet, batch_grids, pair_array  # noqa: F401 (pair_array: this module's former home)
from .reward import OK, RUNTIME, SYNTAX, outcome
from .world import World



def as_example(task, train: bool = False) -> Example:
    """A generated task (`generate.Example`) as the trainer's Example: spec in, program out, held-out aside. A
    training task also keeps all its pairs (hidden["pairs"]), from which `Karel.present` draws the shown five."""
    pairs = PairSet(task.pairs)
    spec = pairs.subset(range(len(pairs) - 1))
    hidden = {"held_out": task.held_out, **({"pairs": pairs} if train else {})}
    return Example(spec, [task.program], {"spec": spec}, hidden=hidden)


class Karel(Task):
    name = "karel"
    default_reward = "twophase.tasks.karel.reward:karel"  # also the `karel` entry point of twophase.rewards
    metrics = (Metric("generalization", "generalization (top-1)"), Metric("exact_match", "exact match"),
               Metric("spec_accuracy", "passes the 5 spec pairs"),
               Metric("syntax_error_rate", "syntax errors", higher_is_better=False),
               Metric("runtime_error_rate", "crashes and time-outs", higher_is_better=False),
               Metric("filtered_generalization", "generalization (filtered)"),
               Metric("spec_in_beam", "spec passed in the beam"))
    main_metric = "generalization"
    # its data is generated; its own section (--karel-model, ...) sizes its model
    flags = frozenset({"train_size", "embed_dim", "hidden_size", "dropout"}) | frozenset(section_fields("karel"))
    # The recipe `train.py --task karel` runs (docs/karel.md): MLE with the rate halving after 2 validations
    # without a better generalization, until it would fall below 2.5e-4 (at most 10,000 steps), RL from the best
    # MLE validation's parameters, the equal-time MLE control, and the test split at beams 5 and 64 (the paper's).
    # Hidden 128, not 256: an MLE step at 256 costs several times more, which a CPU run cannot afford. The beam
    # objective with K = 16, as Bunel et al.'s RL_beam. The DSL's grammar constrains every search and score, as
    # the paper's syntax checker (--grammar off: without).
    flag_defaults = dict(hidden_size=128, embed_dim=64, max_len=31, mle_steps=10000, lr_decay=0.5, patience=2,
                         min_lr=2.5e-4, rl_from_best=True, objective="beam", beam_size=16, rl_steps=2000,
                         rl_lr=5e-4, eval_every=500, test_beam=64, save_dir="runs/karel", grammar="on",
                         compare_mle=True)

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
        counts = dataset_counts(cfg.train_size or DEFAULT_TRAIN, cfg.valid_size or DEFAULT_VALID)
        self.data_key = data_key(counts["n_train"], counts["n_valid"], DATA_SEED, p)
        path = dataset.default_cache_dir() / f"{self.data_key}.jsonl"
        cached, start = path.exists(), time.perf_counter()
        try:
            splits = dataset.generate_dataset(**counts, seed=DATA_SEED, **p.as_dict())
        except (ValueError, RuntimeError) as err:
            raise DataError(f"karel data: {err}") from None
        self.generated = splits
        self.train = [as_example(t, train=True) for t in splits["train"]]
        self.valid, self.test = ([as_example(t) for t in splits[s]] for s in ("valid", "test"))
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

    def present(self, examples: list[Example], rng=random) -> list[Example]:
        """Each training task with a random 5 of its 6 pairs (drawn from `rng`, see `Task.present`): the
        model sees those five; the reward checks all six (--karel-reward-pairs all, the default) or the five shown.
        Validation and test examples pass unchanged."""
        every = self.cfg.karel_reward_pairs == "all"
        out = []
        for ex in examples:
            pairs = ex.hidden.get("pairs")
            if pairs is None:
                out.append(ex)
                continue
            order = rng.sample(range(len(pairs)), len(pairs))
            shown = pairs.subset(sorted(order[1:]))
            out.append(Example(shown, ex.references, {"spec": pairs if every else shown},
                               hidden={"held_out": pairs[order[0]]}))
        return out

    # ---- model
    def build_model(self):
        return architecture.build(self.cfg, len(self.vocab), self.params.rows, self.params.cols)

    def grammar(self, max_len: int) -> KarelGrammar:
        return karel_grammar(self.vocab, max_len)  # the DSL's pushdown automaton (grammar.py)

    def collate(self, batch: list[Example], device) -> torch.Tensor:
        """(B, P, 32, R, C) from each task's cached arrays (`grids.batch_grids`: fewer pairs repeat the first)."""
        grids = torch.from_numpy(batch_grids([ex.source for ex in batch]))  # (B, P, 32, R, C) uint8
        return grids.to(device=device, dtype=torch.float32)

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

    def nbest_metric_sums(self, nbest: list[list[str]], batch: list[Example]) -> dict:
        """The best candidate's sums, and the execution-filtered top-1: the first candidate of the beam that
        passes the five specification pairs (the held-out pair decides whether it generalises)."""
        sums = self.metric_sums([hyps[0] for hyps in nbest], batch)
        sums["filtered"] = sums["in_beam"] = 0
        for hyps, ex in zip(nbest, batch):
            first = next((h for h in hyps if outcome(h, ex.fields["spec"]) == OK), None)
            sums["in_beam"] += first is not None
            sums["filtered"] += first is not None and outcome(first, [ex.hidden["held_out"]]) == OK
        return sums

    def scores(self, sums: dict) -> dict:
        n = max(sums["n"], 1)
        out = {"generalization": sums["generalization"] / n, "exact_match": sums["exact_match"] / n,
               "spec_accuracy": sums["spec_ok"] / n, "syntax_error_rate": sums[SYNTAX] / n,
               "runtime_error_rate": sums[RUNTIME] / n}
        if "filtered" in sums:  # summed over whole beams (validation), not over best candidates alone
            out.update(filtered_generalization=sums["filtered"] / n, spec_in_beam=sums["in_beam"] / n)
        return {**out, "n": sums["n"]}

    def closing_lines(self) -> list[str]:
        """The baselines beside the model's figures at the end of a run (computed once, then cached)."""
        from .baselines import cached_report  # the retrieval baseline's index is only built when asked for

        return cached_report(self.generated, self.data_key)
