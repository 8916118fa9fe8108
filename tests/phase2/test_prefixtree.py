"""Phase two over the candidates' prefix tree: the tree itself, and the same exact gradient and loss as one graph
over every row, for the built-in LSTM and for a model written only against the protocol (`step`, no `score`)."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from twophase import Samples, beam_search, objectives, protocol, rescore_backward, sample
from twophase.phase2 import prefixtree
from twophase.phase2.rescoring import shares_prefixes

from conftest import rnn_graph_mode, tiny_model, toy_batch

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- a model that only follows the protocol
@dataclass
class Memory:
    summary: torch.Tensor  # (B, H) float
    length: torch.Tensor  # (B,) long


class StepOnlyGRU(nn.Module):
    """GRU decoder over a mean-pooled float source; ids pad 4, bos 0, eos 3; enc a dataclass, the state a dict
    of a float hidden and a long step counter (a tree of mixed dtypes); dropout, so a phase two run in training
    mode would score with noise. No `score`: phase two runs `step`."""

    pad_id, bos_id, eos_id = 4, 0, 3

    def __init__(self, feat=3, vocab=7, hidden=12, dropout=0.3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(feat, hidden)
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.GRUCell(2 * hidden, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.drop = nn.Dropout(dropout)
        self.double()
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(2.5)  # peaked, varied distributions

    def encode(self, source):
        return Memory(torch.tanh(self.proj(source).mean(dim=1)), torch.full((len(source),), source.shape[1]))

    def init_state(self, enc, owner):
        return {"h": enc.summary[owner], "t": torch.zeros_like(owner)}

    def step(self, enc, owner, prev, state):
        x = torch.cat([self.drop(self.embed(prev)), enc.summary[owner]], dim=-1)
        h = self.cell(x, state["h"])
        logits = self.out(self.drop(h)) + state["t"][:, None].to(h.dtype) * 0.1  # the counter matters
        logits = logits.index_fill(1, torch.tensor([self.pad_id, self.bos_id]), float("-inf"))
        return {"h": h, "t": state["t"] + 1}, logits.log_softmax(-1)


def _lstm():
    model, (src, lens) = tiny_model(), toy_batch()
    return model, (src, lens)


def _gru():
    source = torch.randn(3, 4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return StepOnlyGRU().train(), source  # left in training mode: phase two must score it in eval mode


MODELS = {"lstm": _lstm, "step-only": _gru}


def _candidates(model, source, kind, k=4, max_len=5):
    if kind == "beam":
        return beam_search(model, source, beam_size=k, max_len=max_len)
    return sample(model, source, num_samples=k, max_len=max_len, generator=torch.Generator().manual_seed(0))


def _coefficients(name, s, B):
    g = torch.Generator().manual_seed(5)
    r = torch.rand(len(s), generator=g, dtype=torch.float64)
    if name == "mle":
        return objectives.mle(s.owner, B)
    if name == "reinforce":
        return objectives.reinforce(r, s.owner, B, "mean")
    if name == "beam":
        return objectives.beam(r, s.scores, s.owner, B, tokens=s.tokens)
    return objectives.mrt(r, s.scores, s.owner, B, alpha=0.5, tokens=s.tokens)


def _reference(model, source, s, c):
    """Gradients and loss of sum_i c_i log p_i in one graph over every row, in evaluation mode."""
    with protocol.scoring_mode(model):
        model.zero_grad()
        loss = (c * protocol.step_score(model, model.encode(source), s.tokens, s.owner)).sum()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], float(loss.detach())


def _check(model, got_loss, want, tol=1e-9):
    grads, loss = want
    assert got_loss == pytest.approx(loss, rel=tol, abs=1e-10)
    for p, w in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, w, rtol=tol, atol=1e-12)


# ---------------------------------------------------------------- the tree
def test_tree_of_hand_made_rows():
    # source 0: [5 6 3], [5 6 7 3], [5 6 3] again, [8 3]; source 1: [5 6 3]; eos 3, pad 0
    tokens = torch.tensor([[5, 6, 3, 0], [5, 6, 7, 3], [5, 6, 3, 0], [8, 3, 0, 0], [5, 6, 3, 0]])
    owner, lengths = torch.tensor([0, 0, 0, 0, 1]), torch.tensor([3, 4, 3, 2, 3])
    c = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0], dtype=torch.float64)
    order = prefixtree.sort_rows(tokens, owner, lengths)
    assert order.tolist() == [0, 2, 1, 3, 4]  # [5 6 3] < [5 6 7 3] < [8 3]; ended rows before continuations
    nodes = prefixtree.build(tokens[order], owner[order], lengths[order], c[order])
    # depth 0: (0, 5) (0, 8) (1, 5); depth 1: (0, 5 6) (0, 8 3) (1, 5 6); depth 2: 3, 7 under 0's 5 6, 3 under 1's
    assert nodes.offsets == [0, 3, 6, 9, 10] and nodes.positions == 15 and len(nodes) == 10
    assert nodes.tokens.tolist() == [5, 8, 5, 6, 3, 6, 3, 7, 3, 3]
    assert nodes.owner.tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 1, 0]
    assert nodes.parent.tolist() == [0, 0, 0, 0, 1, 2, 0, 0, 2, 1]
    assert nodes.weights.tolist() == [7, 8, 16, 7, 8, 16, 5, 2, 16, 2]
    assert nodes.inputs(bos_id=1).tolist() == [1, 1, 1, 5, 8, 5, 6, 6, 6, 7]
    # the nodes each sorted row adds, and any range's node count from them
    added = prefixtree.new_nodes(tokens[order], owner[order], lengths[order])
    assert added.tolist() == [3, 0, 2, 2, 3] and int(added.sum()) == len(nodes)
    for a in range(5):
        for b in range(a, 5):
            rows = order[a:b + 1]
            want = len(prefixtree.build(tokens[rows], owner[rows], lengths[rows], c[rows]))
            assert int(lengths[rows[0]] + added[a + 1:b + 1].sum()) == want


def test_unsorted_rows_give_a_larger_but_exact_tree():
    model, source = _lstm()
    s = _candidates(model, source, "beam")
    c = _coefficients("beam", s, 3)
    shuffled = torch.randperm(len(s), generator=torch.Generator().manual_seed(0))
    order = prefixtree.sort_rows(s.tokens, s.owner, s.lengths)
    sorted_tree = prefixtree.build(s.tokens[order], s.owner[order], s.lengths[order], c[order])
    mixed = prefixtree.build(s.tokens[shuffled], s.owner[shuffled], s.lengths[shuffled], c[shuffled])
    assert len(sorted_tree) < len(mixed) <= mixed.positions == int(s.lengths.sum())
    with rnn_graph_mode(model):
        enc = model.encode(source)
    with torch.no_grad():
        want = float((c * model.score(enc, s.tokens, s.owner)).sum())
        for nodes in (sorted_tree, mixed):
            assert float(prefixtree.step_loss(model, enc, nodes)) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", ["beam", "sample"])
@pytest.mark.parametrize("objective", ["mle", "reinforce", "beam", "mrt"])
def test_tree_gradient_equals_one_graph_over_rows(kind, objective):
    """The step path of a protocol-only model (the LSTM's tree path is test_rescoring.py's default)."""
    model, source = _gru()
    assert shares_prefixes(model)
    s = _candidates(model, source, kind)
    c = _coefficients(objective, s, B=3)
    want = _reference(model, source, s, c)
    for chunk in range(1, len(s) + 1):
        for oom_retry in (False, True):  # straight into .grad, or collected first (CUDA's default)
            model.zero_grad()
            stats = {}
            loss = rescore_backward(model, source, s, c, chunk_size=chunk, oom_retry=oom_retry, stats=stats)
            _check(model, loss, want)
            assert stats["rows"] == int((c != 0).sum()) and stats["nodes"] <= stats["positions"]
    assert model.training  # handed back in the mode it came in


@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_reference_rows_and_row_path(name):
    """MLE rows ride along (Samples.cat); prefix_sharing=False decodes rows and gives the same numbers."""
    model, source = MODELS[name]()
    s = _candidates(model, source, "beam")
    longest = int(s.lengths.masked_fill(s.owner != 1, 0).argmax())
    first = int(s.tokens[longest, 0])  # a reference sharing a prefix with a candidate (not its eos)
    if name == "lstm":  # pad 0, eos 2
        tokens = [[5, 6, 2, 0], [first, 3, 2, 0], [2, 0, 0, 0]]
    else:  # pad 4, eos 3
        tokens = [[5, 6, 3, 4], [first, 2, 3, 4], [3, 4, 4, 4]]
    refs = Samples.of_targets(torch.tensor(tokens), torch.tensor([0, 1, 2]), model.pad_id, model.eos_id)
    both = Samples.cat([s, refs], model.pad_id)
    c = objectives.mix(_coefficients("beam", s, 3), objectives.mle(refs.owner, 3), mle_weight=0.3)
    want = _reference(model, source, both, c)
    counts = {}
    for share, chunk in ((True, 3), (False, 3), (True, len(both))):
        model.zero_grad()
        stats = {}
        _check(model, rescore_backward(model, source, both, c, chunk_size=chunk, prefix_sharing=share,
                                       stats=stats), want)
        counts[share, chunk] = stats
    assert counts[False, 3]["nodes"] == counts[False, 3]["positions"] == int(both.lengths.sum())
    assert counts[True, len(both)]["nodes"] < counts[False, 3]["nodes"]  # beams share prefixes


def test_chunks_are_the_largest_runs_of_sorted_rows_within_their_rows_and_nodes(monkeypatch):
    model, source = _lstm()
    s = _candidates(model, source, "beam", k=6, max_len=6)
    c = _coefficients("mrt", s, 3)
    live = s.select((c != 0).nonzero().squeeze(1))
    order = prefixtree.sort_rows(live.tokens, live.owner, live.lengths)
    rows = live.select(order)
    built = []
    real = prefixtree.build

    def counted(*args):
        built.append((len(args[0]), real(*args)))
        return built[-1][1]

    monkeypatch.setattr(prefixtree, "build", counted)
    T = int(s.lengths.max())
    stats = {"nodes": 100}
    for chunk in (1, 2, 5):
        built.clear()
        rescore_backward(model, source, s, c, chunk_size=chunk, stats=stats)
        assert all(len(nodes) <= chunk * T and n <= chunk for n, nodes in built)
        start = 0
        for n, _ in built[:-1]:  # one more row would not have fit: too many rows, or too many nodes
            more = slice(start, start + n + 1)
            assert n == chunk or len(real(rows.tokens[more], rows.owner[more], rows.lengths[more],
                                          c[:n + 1])) > chunk * T
            start += n
        assert start + built[-1][0] == len(rows)
    assert stats["nodes"] > 100 and stats["rows"] == 3 * len(rows) and stats["chunks"] >= 3


# ---------------------------------------------------------------- out of memory, bf16
@pytest.mark.parametrize("name", list(MODELS))
def test_out_of_memory_halves_the_tree_chunk_and_stays_exact(monkeypatch, name):
    model, source = MODELS[name]()
    s = _candidates(model, source, "beam", k=5, max_len=6)
    c = _coefficients("beam", s, B=3)
    want = _reference(model, source, s, c)
    sizes = []
    real = prefixtree.build

    def counted(*args):
        nodes = real(*args)
        sizes.append(len(nodes))
        return nodes

    def fail_late_in_backward(grad):  # after the output layer's gradient: a plain backward would have added it
        if sizes[-1] > 10:
            raise torch.cuda.OutOfMemoryError("injected")
        return grad

    monkeypatch.setattr(prefixtree, "build", counted)
    weight = model.cell.weight_ih
    handle = weight.register_hook(fail_late_in_backward)
    model.zero_grad()
    loss = rescore_backward(model, source, s, c, chunk_size=8, oom_retry=True)
    handle.remove()
    T = int(s.lengths.max())
    assert sizes[0] > 10 and all(n <= 10 for n in sizes[-3:]) and max(sizes) <= 8 * T
    _check(model, loss, want)


def test_step_only_model_under_bf16(one_thread):
    """The step path under CPU bf16 autocast, against one graph over the rows under the same autocast: the same
    bf16 products at different batch shapes, so ~u = 2^-9 relative (see test_amp.py); 3e-2 as there."""
    model, source = _gru()
    model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = _candidates(model, source.float(), "beam")
        c = _coefficients("beam", s, 3)
        grads, loss = _reference(model, source.float(), s, c)
        for chunk in (len(s), 2):
            model.zero_grad()
            got = rescore_backward(model, source.float(), s, c, chunk_size=chunk)
            assert got == pytest.approx(loss, rel=3e-2, abs=1e-3)
            for p, w in zip(model.parameters(), grads):
                assert p.grad.dtype == torch.float32
                assert float((p.grad - w).norm() / w.norm().clamp_min(1e-30)) <= 3e-2


@pytest.mark.parametrize("collect", [False, True])
def test_gradient_is_exact_under_saved_tensor_hooks(collect):
    """Packing hooks (the saved-tensor meter, activation offloading) hand saved tensors back as other tensor
    objects: the LSTM cell's deferred weight gradients must still reach the parameters themselves."""
    model, source = _lstm()
    s = _candidates(model, source, "beam")
    c = _coefficients("beam", s, 3)
    want = _reference(model, source, s, c)
    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: [x], lambda held: held[0]):
        loss = rescore_backward(model, source, s, c, chunk_size=3, oom_retry=collect)
    _check(model, loss, want)
