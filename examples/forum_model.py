"""A model of your own with attention, written with twophase's attention blocks (see docs/byom.md, "memory and
speed of your own step").

An nn.LSTM encoder and an LSTMCell decoder fed [embedding of the previous token; previous context], with additive
attention v . tanh(W h + U y): the model of a forum post, as its author would write it against
`twophase.SequenceModel`. `U y` is computed once per source in `encode`; `step` calls
`twophase.additive_attention`, which reads each source's keys and values once for all its rows and keeps no
(N, S, A) tanh for backward, so phase two holds a few H-sized tensors per row and step rather than three
(S, H)-sized ones (docs/results/2026-12-05-forum-model.md).

    python examples/forum_model.py --steps 60     # check_model, then REINFORCE on a copy task

Letters: B sources, S source length, N rows (owner (N,) maps a row to its source), H hidden = embedding =
attention size, V target vocabulary.
"""
import argparse

import torch
from torch import nn

import twophase


class ForumSeq2Seq(nn.Module):
    """source: (src (B, S) right-padded with pad_id, lengths (B,)), the built-in `Seq2Seq`'s convention."""

    pad_id, bos_id, eos_id = 0, 1, 2  # twophase.vocab's specials: a built-in task's ids use them

    def __init__(self, src_vocab: int, tgt_vocab: int, hidden: int = 512):
        super().__init__()
        H = hidden
        self.src_embed = nn.Embedding(src_vocab, H, padding_idx=self.pad_id)
        self.tgt_embed = nn.Embedding(tgt_vocab, H, padding_idx=self.pad_id)
        self.encoder = nn.LSTM(H, H, batch_first=True)
        self.W, self.U, self.v = nn.Linear(H, H, bias=False), nn.Linear(H, H), nn.Linear(H, 1, bias=False)
        self.cell = nn.LSTMCell(2 * H, H)  # input: [embedding of the previous token; previous context]
        self.out = nn.Linear(H, tgt_vocab)
        banned = torch.zeros(tgt_vocab, dtype=torch.bool)
        banned[[self.pad_id, self.bos_id]] = True  # never generated: probability zero
        self.register_buffer("banned", banned, persistent=False)

    def encode(self, source):
        src, lengths = source
        S = src.shape[1]
        packed = nn.utils.rnn.pack_padded_sequence(self.src_embed(src), lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        out, (h, c) = self.encoder(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=S)  # (B, S, H)
        mask = torch.arange(S, device=src.device)[None, :] < lengths.to(src.device)[:, None]  # (B, S)
        return {"y": y, "Uy": self.U(y), "mask": mask, "h": h[0], "c": c[0]}  # U y once per source

    def init_state(self, enc, owner):
        h = enc["h"][owner]  # (N, H)
        return h, enc["c"][owner], torch.zeros_like(h)  # (h, c, previous context)

    def attend(self, enc, owner, h):
        """(N, H) the context of decoder states h (N, H)."""
        return twophase.additive_attention(self.W(h), enc["Uy"], enc["y"], self.v.weight, owner, enc["mask"])

    def step(self, enc, owner, prev, state):
        h, c, ctx = state
        h, c = self.cell(torch.cat([self.tgt_embed(prev), ctx], dim=-1), (h, c))
        ctx = self.attend(enc, owner, h)
        logits = self.out(h).masked_fill(self.banned, float("-inf"))  # (N, V)
        return (h, c, ctx), logits.log_softmax(-1)


def copy_batch(B: int, S: int, vocab: int, g: torch.Generator):
    """Sources of 3..S tokens (ids 3..vocab-1), right-padded with 0: the task is to copy them."""
    lengths = torch.randint(3, S + 1, (B,), generator=g)
    src = torch.randint(3, vocab, (B, S), generator=g) * (torch.arange(S)[None, :] < lengths[:, None])
    return src, lengths


def copied(src: torch.Tensor, lengths: torch.Tensor, s: twophase.Samples) -> torch.Tensor:
    """(N,) the fraction of a candidate's positions that copy its source (over the longer of the two)."""
    out = []
    for row, n, b in zip(s.tokens.tolist(), s.lengths.tolist(), s.owner.tolist()):
        got, want = row[:n - 1] if row[n - 1] == ForumSeq2Seq.eos_id else row[:n], src[b, :lengths[b]].tolist()
        out.append(sum(x == y for x, y in zip(got, want)) / max(len(got), len(want)))
    return torch.tensor(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    vocab, B, K, S = 12, 16, 8, 5
    model = ForumSeq2Seq(vocab, vocab, args.hidden)
    twophase.check_model(model, copy_batch(2, S, vocab, g))  # raises twophase.ModelError naming a broken rule
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    draws = torch.Generator().manual_seed(1)
    for step in range(args.steps + 1):
        src, lengths = copy_batch(B, S, vocab, g)
        s = twophase.sample(model, (src, lengths), num_samples=K, max_len=S + 1, generator=draws)
        reward = copied(src, lengths, s)
        if step % 10 == 0:
            print(f"step {step}: mean reward {reward.mean():.3f}")
        optimizer.zero_grad()
        c = twophase.objectives.reinforce(reward, s.owner, B, baseline="mean")
        twophase.rescore_backward(model, (src, lengths), s, c, chunk_size=32)
        optimizer.step()


if __name__ == "__main__":
    main()
