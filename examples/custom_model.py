"""Bring your own model: train a user-defined GRU with twophase's library API (see docs/byom.md).

The model only follows `twophase.SequenceModel` (three ids; encode, init_state, step): twophase never looks
inside it. The task reverses digit strings; the reward is computed from the SOURCE (no reference needed): the
fraction of positions where the output equals the reversed source. A few MLE steps on reference rows warm the
model up, then REINFORCE on sampled candidates trains it on the reward itself.

    python examples/custom_model.py --steps 200
"""
import argparse

import torch
from torch import nn

from twophase import Samples, greedy, objectives, rescore_backward, sample

PAD, BOS, EOS, DIGITS = 0, 1, 2, 8  # digit d is token 3 + d
VOCAB = 3 + DIGITS


class Reverser(nn.Module):
    """A GRU encoder-decoder without attention. source: (B, S) digit tokens, right-padded with PAD."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.src_embed = nn.Embedding(VOCAB, hidden)
        self.encoder = nn.GRU(hidden, hidden, batch_first=True)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.out = nn.Linear(hidden, VOCAB)

    def encode(self, source):
        lengths = (source != PAD).sum(1)
        packed = nn.utils.rnn.pack_padded_sequence(self.src_embed(source), lengths, batch_first=True,
                                                   enforce_sorted=False)
        return self.encoder(packed)[1][0]  # (B, H): enc may be any tree of tensors with leading dimension B

    def init_state(self, enc, owner):
        return enc[owner]  # (N, H): row i decodes source owner[i]

    def step(self, enc, owner, prev, state):
        h = self.cell(self.embed(prev), state)
        logits = self.out(h).index_fill(1, torch.tensor([PAD, BOS], device=h.device), float("-inf"))  # never proposed
        return h, logits.log_softmax(-1)  # the new state, (N, V) normalised log-probabilities


def batch(n: int, g: torch.Generator, max_digits: int = 5):
    """n random digit strings (B, S) and their reversals + EOS (B, S + 1), both right-padded with PAD."""
    lengths = torch.randint(2, max_digits + 1, (n,), generator=g)
    src = torch.full((n, max_digits), PAD)
    tgt = torch.full((n, max_digits + 1), PAD)
    for i, k in enumerate(lengths.tolist()):
        src[i, :k] = 3 + torch.randint(DIGITS, (k,), generator=g)
        tgt[i, :k] = src[i, :k].flip(0)
        tgt[i, k] = EOS
    return src, tgt


def reward(src: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(N,) for each candidate row and its source: matching positions / max(output length, source length)."""
    out = []
    for s, y in zip(src.tolist(), tokens.tolist()):
        want = [t for t in s if t != PAD][::-1]
        got = y[:y.index(EOS)] if EOS in y else [t for t in y if t != PAD]
        out.append(sum(a == b for a, b in zip(got, want)) / max(len(got), len(want)))
    return torch.tensor(out, dtype=torch.float64)


def evaluate(model, src) -> float:
    best = greedy(model, src, max_len=src.shape[1] + 1)  # one row per source, in source order
    return float(reward(src[best.owner], best.tokens).mean())


def at_least(low: int):
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return int(text)
    return parse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(0), default=150, help="REINFORCE steps after the warm start")
    parser.add_argument("--mle-steps", type=at_least(0), default=60, help="MLE warm-start steps on reference rows")
    parser.add_argument("--batch-size", type=at_least(1), default=32)
    parser.add_argument("--samples", type=at_least(1), default=8, help="candidates sampled per source")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tensors this small gain nothing from a second thread, which stalls on a busy machine
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    model = Reverser()
    device = next(model.parameters()).device  # sources, indices and the sampler's generator go where the model is
    draws = torch.Generator(device=device).manual_seed(args.seed)  # the sampler's; g makes the data, on the CPU
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    held_out = batch(256, torch.Generator().manual_seed(12345))[0].to(device)
    print(f"reward before training: {evaluate(model, held_out):.3f}")

    for _ in range(args.mle_steps):  # maximum likelihood: the reference rows with objectives.mle coefficients
        src, tgt = (x.to(device) for x in batch(args.batch_size, g))
        refs = Samples.of_targets(tgt, torch.arange(len(src), device=device), PAD, EOS)
        optimizer.zero_grad()
        rescore_backward(model, src, refs, objectives.mle(refs.owner, len(src)), chunk_size=64)
        optimizer.step()
    print(f"reward after {args.mle_steps} MLE steps: {evaluate(model, held_out):.3f}")

    for _ in range(args.steps):  # phase one: sample without a graph; phase two: chunked re-scoring with c_i
        src = batch(args.batch_size, g)[0].to(device)
        cand = sample(model, src, num_samples=args.samples, max_len=src.shape[1] + 1, generator=draws)
        r = reward(src[cand.owner], cand.tokens)  # on the CPU: objectives move it to the samples' device
        c = objectives.reinforce(r, cand.owner, len(src), baseline="mean")
        optimizer.zero_grad()
        rescore_backward(model, src, cand, c, chunk_size=64)
        optimizer.step()
    print(f"reward after {args.steps} RL steps: {evaluate(model, held_out):.3f}")


if __name__ == "__main__":
    main()
