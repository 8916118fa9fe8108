"""Special ids that coincide: pad_id == eos_id (GPT-2 has no pad token) and bos_id == eos_id (BART starts
decoding from its eos). Search must still end rows with eos_id, and never propose the other special id."""
import itertools

import pytest
import torch

from twophase import beam_search, sample
from twophase.protocol import step_score


class Bigram:
    """A toy SequenceModel: the next token's distribution depends on the previous token only; eos_id is
    likely, so most rows end early."""

    def __init__(self, V, pad_id, bos_id, eos_id):
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.table = torch.randn(V, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        self.table[:, eos_id] += 1.0

    def encode(self, source):
        return torch.zeros(source, 1, dtype=torch.float64)  # (B, 1): source is the number of sources

    def init_state(self, enc, owner):
        return torch.zeros(len(owner), 1, dtype=torch.float64)

    def step(self, enc, owner, prev, state):
        return state, torch.log_softmax(self.table[prev], dim=-1)


def _brute_force(model, V, max_len):
    """Every candidate row of length <= max_len with its log-probability."""
    allowed = [v for v in range(V) if v not in (model.pad_id, model.bos_id) or v == model.eos_id]
    rows = {}
    for n in range(1, max_len + 1):
        for seq in itertools.product(allowed, repeat=n):
            if model.eos_id in seq[:-1]:
                continue
            tokens = torch.tensor([list(seq) + [model.pad_id] * (max_len - n)])
            if n < max_len and seq[-1] != model.eos_id:
                continue  # an open row shorter than max_len is not a candidate
            rows[seq] = float(step_score(model, model.encode(1), tokens, torch.zeros(1, dtype=torch.long)))
    return rows


@pytest.mark.parametrize("pad_id, bos_id, eos_id", [(0, 1, 0), (0, 2, 2)], ids=["pad=eos", "bos=eos"])
def test_search_ends_rows_when_ids_coincide(pad_id, bos_id, eos_id):
    V, max_len = 5, 3
    model = Bigram(V, pad_id, bos_id, eos_id)
    exact = _brute_force(model, V, max_len)
    K = len(exact)
    s = beam_search(model, 1, K, max_len)
    found = {tuple(row[:n].tolist()): float(sc) for row, n, sc in zip(s.tokens, s.lengths, s.scores)}
    assert found.keys() == exact.keys()
    assert all(abs(found[k] - exact[k]) < 1e-9 for k in exact)
    assert any(k[-1] == eos_id and len(k) < max_len for k in found)
    drawn = sample(model, 4, 8, max_len, generator=torch.Generator().manual_seed(1))
    assert bool((drawn.lengths < max_len).any())
    for row, n in zip(drawn.tokens.tolist(), drawn.lengths.tolist()):
        assert tuple(row[:n]) in exact
