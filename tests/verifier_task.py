"""A verifier-only task for tests: digit strings to reverse, no references at all; the reward reads the source
(`--task verifier_task:Verifier`, this folder on sys.path). `NaNVerifier`: its model's log-probabilities are NaN.
`FrozenNoise`: its model holds a frozen parameter drawn anew at every build."""
import random

import torch

from twophase.models.seq2seq import Seq2Seq
from twophase.tasks import Example, Task
from twophase.vocab import pad_batch

DIGITS = 4  # digit d is token 3 + d (after pad, bos, eos)


def reversal(hypotheses, references, sources):
    """Matching positions between the output and the reversed source, over the longer of the two."""
    out = []
    for hyp, src in zip(hypotheses, sources):
        got, want = hyp.split(), src.split()[::-1]
        out.append(sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1))
    return out


class Verifier(Task):
    name = "verifier"
    default_reward = "verifier_task:reversal"
    flags = frozenset({"hidden_size"})

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def load_data(self):
        rng = random.Random(0)

        def split(n):
            return [Example(" ".join(str(rng.randrange(DIGITS)) for _ in range(rng.randint(1, 3)))) for _ in range(n)]
        self.train, self.valid = split(24), split(6)

    def build_model(self):
        return Seq2Seq(3 + DIGITS, 3 + DIGITS, 8, self.cfg.hidden_size)

    def collate(self, batch, device):
        return pad_batch([[3 + int(d) for d in ex.source.split()] for ex in batch], device)  # (B, S), (B,)

    def target_ids(self, example):
        return [[3 + int(d) for d in r.split()] for r in example.references]

    def detokenize(self, ids):
        ids = ids[:ids.index(2)] if 2 in ids else ids
        return " ".join(str(i - 3) for i in ids if i >= 3)


class NaNModel(Seq2Seq):
    def log_probs(self, state):
        return torch.full_like(super().log_probs(state), float("nan"))

    def step(self, enc, owner, prev, state):
        state, logp = super().step(enc, owner, prev, state)
        return state, torch.full_like(logp, float("nan"))


class NaNVerifier(Verifier):
    def build_model(self):
        return NaNModel(3 + DIGITS, 3 + DIGITS, 8, self.cfg.hidden_size)


class FrozenNoise(Verifier):
    """Its model holds a frozen random parameter that `build_model` draws anew each time: a checkpoint (its
    trainable parameters alone) does not rebuild it, so twophase-decode would decode another model."""

    def build_model(self):
        model = Seq2Seq(3 + DIGITS, 3 + DIGITS, 8, self.cfg.hidden_size)
        model.noise = torch.nn.Parameter(torch.randn(4), requires_grad=False)
        return model
