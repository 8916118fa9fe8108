"""A task plug-in: `python train.py --task reverse_task:ReverseDigits` (run from this directory) trains the
user-defined `Reverser` of custom_model.py with the whole training command: MLE warm start, two-phase RL,
validation, checkpoints, --resume, twophase-decode. Nothing in twophase knows this file.

The reward, `reversal`, is source-aware: it reads `sources` (the digits given) and ignores the references, as an
execution reward or a verifier would.

    cd examples && python ../train.py --task reverse_task:ReverseDigits --save-dir /tmp/reverse
    echo "3 1 4 1 5" | python -m twophase.train.decode --checkpoint /tmp/reverse/checkpoint_best.pt

The checkpoint records this folder, so decoding works from any directory. Digits are 0-7 (the model's
vocabulary): a line with others is refused with its line number.
"""
import random

import torch

from custom_model import DIGITS, EOS, PAD, Reverser
from twophase.tasks import Example, Metric, Task


def digits(text: str) -> list[int]:
    return [int(d) for d in text.split()]


def parse_digits(line: str) -> str:
    """A decode input line as a source: digits 0-7 separated by spaces (anything else has no token)."""
    words = line.split()
    bad = [w for w in words if w not in {str(d) for d in range(DIGITS)}]
    if bad:
        raise ValueError(f"expected digits 0-{DIGITS - 1} separated by spaces, got {bad[0]!r}")
    return " ".join(words)


def reversal(hypotheses, references, sources):
    """Matching positions between the output and the reversed source, over the longer of the two."""
    out = []
    for hyp, src in zip(hypotheses, sources):
        got, want = hyp.split(), src.split()[::-1]
        out.append(sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1))
    return out


class ReverseDigits(Task):
    name = "reverse-digits"
    default_reward = "reverse_task:reversal"
    metrics = (Metric("exact", "reversed exactly"),)
    main_metric = "exact"
    # This task's recipe: defaults for train.py's flags (those given on the command line still win).
    flag_defaults = dict(hidden_size=32, batch_size=16, beam_size=4, max_len=7, mle_steps=150, rl_steps=100,
                         save_dir="runs/reverse")
    flags = frozenset({"hidden_size"})  # the train.py data/model flags it reads (others, given, are refused)

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def load_data(self) -> None:
        rng = random.Random(0)  # the same splits in every run: --resume and decode see the same data

        def split(n):
            texts = [" ".join(str(rng.randrange(8)) for _ in range(rng.randint(2, 5))) for _ in range(n)]
            return [Example(t, [" ".join(t.split()[::-1])]) for t in texts]
        self.train, self.valid, self.test = split(2000), split(200), split(200)

    def build_model(self):
        return Reverser(hidden=self.cfg.hidden_size)

    def collate(self, batch, device):
        rows = [[3 + d for d in digits(ex.source)] for ex in batch]
        src = torch.full((len(rows), max(map(len, rows))), PAD)  # (B, S) right-padded: Reverser's source
        for i, row in enumerate(rows):
            src[i, :len(row)] = torch.tensor(row)
        return src.to(device)

    def target_ids(self, example):
        return [[3 + d for d in digits(r)] for r in example.references]

    def parse_source(self, line):
        return parse_digits(line)

    def detokenize(self, ids):
        ids = ids[:ids.index(EOS)] if EOS in ids else ids
        return " ".join(str(i - 3) for i in ids if i >= 3)

    def metric_sums(self, hypotheses, batch):
        return {"exact": sum(h in ex.references for h, ex in zip(hypotheses, batch)), "n": len(batch)}

    def scores(self, sums):
        return {"exact": sums["exact"] / max(sums["n"], 1), "n": sums["n"]}
