"""Phase two's graph: the fused Functions are exact, and a chunk's saved bytes do not grow with V, S or K."""
import pytest
import torch
import torch.nn.functional as F

from twophase import Samples, Seq2Seq, beam_search
from twophase.models import fused, outputlayer
from twophase.system.memory import AllocationPeak, SavedTensorMeter, graph_bytes
from twophase.vocab import BOS, EOS, PAD

from conftest import rnn_graph_mode, tiny_model, toy_batch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rand(*shape, g, device="cpu", dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_()


# ---------------------------------------------------------------- exactness of each Function
@pytest.mark.parametrize("device", DEVICES)
def test_attention_energies_gradcheck(device):
    g = torch.Generator().manual_seed(0)
    q, keys, v = _rand(5, 3, g=g, device=device), _rand(2, 4, 3, g=g, device=device), _rand(1, 3, g=g, device=device)
    owner = torch.tensor([1, 0, 1, 1, 0], device=device)  # rows sharing a source: keys' gradients must add up
    assert torch.autograd.gradcheck(lambda *x: fused.AttentionEnergies.apply(*x, owner), (q, keys, v))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_context_gradcheck(device):
    g = torch.Generator().manual_seed(1)
    alpha, memory = _rand(5, 4, g=g, device=device), _rand(2, 4, 3, g=g, device=device)
    owner = torch.tensor([0, 0, 1, 0, 1], device=device)
    assert torch.autograd.gradcheck(lambda *x: fused.AttentionContext.apply(*x, owner), (alpha, memory))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [None, 1, 2, 4])
def test_target_log_probs_gradcheck(device, block):
    g = torch.Generator().manual_seed(2)
    h, weight, bias = _rand(7, 3, g=g, device=device), _rand(6, 3, g=g, device=device), _rand(6, g=g, device=device)
    target = torch.tensor([2, 5, 3, 2, 4, 5, 3], device=device)
    banned = torch.zeros(6, dtype=torch.bool, device=device)
    banned[[PAD, BOS]] = True
    fn = lambda *x: outputlayer.target_log_probs(*x, target, banned, block)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, weight, bias))


def _plain_score(model, enc, tgt, owner):
    """The unfused teacher forcing (plain autograd through every intermediate), as a reference."""
    def attend(h):
        q = model.attn_W(h)  # (N, A)
        e = model.attn_v(torch.tanh(q[:, None, :] + enc.keys[owner])).squeeze(-1)  # (N, S)
        e = e.masked_fill(~enc.mask[owner], float("-inf"))
        return torch.bmm(torch.softmax(e, dim=-1)[:, None, :], enc.memory[owner]).squeeze(1)  # (N, D)

    N, T = tgt.shape
    state, prev, hs = model.init_state(enc, owner), torch.full((N,), BOS), []
    for t in range(T):
        x = torch.cat([model.tgt_embed(prev), attend(state[0])], dim=-1)
        state = model.cell(x, state)
        hs.append(state[0])
        prev = tgt[:, t]
    logp = F.log_softmax(model.out(torch.stack(hs, dim=1)).masked_fill(model.banned, float("-inf")), dim=-1)
    pad = tgt == PAD
    return logp.gather(-1, tgt.masked_fill(pad, EOS)[..., None]).squeeze(-1).masked_fill(pad, 0.0).sum(dim=1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_fused_score_matches_plain_autograd(dtype, tol):
    model = tiny_model(bidirectional=True).to(dtype)
    src, lens = toy_batch()
    s = beam_search(model, (src, lens), beam_size=4, max_len=5)
    c = torch.linspace(-1, 2, len(s), dtype=dtype)
    grads = []
    for score in (model.score, lambda enc, tgt, owner: _plain_score(model, enc, tgt, owner)):
        model.zero_grad()
        with rnn_graph_mode(model):
            lp = score(model.encode((src, lens)), s.tokens, s.owner)
        (c * lp).sum().backward()
        grads.append([lp.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_graph_and_graph_free_attention_agree_bitwise():
    model = tiny_model()
    src, lens = toy_batch()
    owner = torch.tensor([0, 2, 2, 1])
    with rnn_graph_mode(model):
        enc = model.encode((src, lens))
    h = torch.randn(4, 16, dtype=torch.float64)
    with torch.no_grad():
        plain = model.attend(enc, owner, h)
    recorded = model.attend(enc, owner, h.requires_grad_())
    assert recorded.grad_fn is not None and torch.equal(recorded.detach(), plain)


# ---------------------------------------------------------------- the meter
def test_meter_counts_a_storage_once_and_sees_it_released():
    x = torch.randn(100, 10, requires_grad=True)
    with SavedTensorMeter(resident=[x]) as meter:
        y = torch.tanh(x * 2)  # mul saves nothing for a constant; tanh saves its output, 4000 bytes
        z = (y[:50] * y[50:]).sum()  # two views of y's storage: no more bytes
    assert meter.peak_bytes == meter.total_bytes == meter.live_bytes == 4000
    z.backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == 4000


# ---------------------------------------------------------------- phase two's graph size
CHUNK = 16


def _model(V, seed=0):
    torch.manual_seed(seed)
    return Seq2Seq(40, V, embed_dim=16, hidden_size=32).eval()


def _sources(S, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([S, max(1, S // 2), S, max(1, S - 1)][:B])
    src = torch.randint(4, 40, (B, S), generator=g).masked_fill(torch.arange(S) >= lens[:, None], PAD)  # (B, S)
    return src, lens


def _candidates(V, K, T=6, B=2, seed=0):
    """K rows per source, every row T tokens long (EOS last), so chunks differ only in what is measured."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, V, (B * K, T), generator=g)  # (B*K, T), never PAD or BOS
    tokens[:, -1] = EOS
    return Samples(tokens, torch.full((B * K,), T), torch.arange(B).repeat_interleave(K), torch.zeros(B * K))


def _bytes(model, src, lens, s, prefix_sharing=True):
    c = torch.linspace(-1, 1, len(s))
    return graph_bytes(model, (src, lens), s, c, chunk_size=CHUNK, prefix_sharing=prefix_sharing)


def test_chunk_graph_does_not_grow_with_beam_size():
    model, (src, lens) = _model(V=300), _sources(S=10, B=2)
    beams = {K: beam_search(model, (src, lens), beam_size=K, max_len=6) for K in (8, 64)}
    assert all(int(s.lengths.max()) == 6 for s in beams.values())  # both have a chunk of the longest rows
    small, big = (_bytes(model, src, lens, beams[K], prefix_sharing=False) for K in (8, 64))
    assert big / small <= 1.3, (small, big)
    # A prefix tree's chunk decodes at most CHUNK * T nodes, each costing what a row's step does: no more graph
    # (K=8's 16 rows fit in one chunk of 48 nodes: half the graph; K=64 fills its chunks)
    shared = {K: _bytes(model, src, lens, beams[K]) for K in (8, 64)}
    assert shared[8] < 0.7 * small and shared[64] <= 1.02 * big, (shared, small, big)


def test_chunk_graph_does_not_grow_with_vocabulary():
    src, lens = _sources(S=10)
    small, big = (_bytes(_model(V), src, lens, _candidates(V, K=8)) for V in (500, 20000))
    assert big / small <= 1.5, (small, big)


def test_chunk_graph_barely_grows_with_source_length():
    model, s = _model(V=500), _candidates(500, K=8)
    small, big = (_bytes(model, *_sources(S), s) for S in (5, 50))
    # What remains is the attention weights (N, S) per step, next to O(H) per row for the LSTM.
    assert big / small <= 1.5, (small, big)


def test_allocation_peak_follows_allocations_and_frees():
    MiB = 2**20
    with AllocationPeak() as m:
        a = torch.empty(MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(MiB // 2, dtype=torch.uint8)
    assert (m.peak_bytes, m.end_bytes) == (3 * MiB, 2.5 * MiB)
    del b, c
