"""examples/forum_model.py, the forum post's model written with twophase's attention blocks: it passes
check_model, its log-probabilities are the obvious model's (benchmarks/forum.py: the plain attention formula),
and phase two's gradient, at every chunk size and with prefix sharing, equals one backward of a naive loss through
the obvious model's steps, in float64."""
import pytest
import torch

import twophase
from benchmarks.forum import ForumSeq2Seq, ObviousForumSeq2Seq


def _pair(seed=0):
    torch.manual_seed(seed)
    model = ForumSeq2Seq(9, 11, hidden=6).double()
    obvious = ObviousForumSeq2Seq(9, 11, hidden=6).double()
    obvious.load_state_dict(model.state_dict())
    return model, obvious


def _source():
    return torch.tensor([[3, 4, 5, 6, 7], [8, 3, 0, 0, 0], [4, 4, 6, 0, 0]]), torch.tensor([5, 2, 3])


def _naive_log_probs(model, source, s):
    """(N,) log p of the candidates by the model's steps, every row teacher-forced from bos, one graph."""
    enc = model.encode(source)
    state = model.init_state(enc, s.owner)
    prev, total = torch.full_like(s.owner, model.bos_id), 0
    for t in range(s.tokens.shape[1]):
        state, log_probs = model.step(enc, s.owner, prev, state)
        tok = log_probs.gather(1, s.tokens[:, t:t + 1]).squeeze(1)
        total = total + torch.where(t < s.lengths, tok, torch.zeros_like(tok))
        prev = s.tokens[:, t]
    return total


def test_check_model_passes():
    model, _ = _pair()
    twophase.check_model(model, _source())


@pytest.mark.parametrize("kind", ["sample", "beam"])
def test_log_probs_equal_the_obvious_models_and_search_scores(kind):
    model, obvious = _pair(1)
    source = _source()
    s = (twophase.sample(model, source, 4, max_len=5, generator=torch.Generator().manual_seed(0)) if kind == "sample"
         else twophase.beam_search(model, source, 4, max_len=5))
    with torch.no_grad():
        mine, theirs = _naive_log_probs(model, source, s), _naive_log_probs(obvious, source, s)
    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.scores.double(), theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["sample", "beam"])
@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_phase_two_gradient_equals_a_naive_backward_through_the_obvious_model(kind, chunk):
    model, obvious = _pair(2)
    source = _source()
    s = (twophase.sample(model, source, 5, max_len=6, generator=torch.Generator().manual_seed(3)) if kind == "sample"
         else twophase.beam_search(model, source, 5, max_len=6))
    c = torch.randn(len(s), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    loss = twophase.rescore_backward(model, source, s, c, chunk_size=chunk)
    want = (c * _naive_log_probs(obvious, source, s)).sum()
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-12)
    for (name, p), q in zip(model.named_parameters(), obvious.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
        assert p.grad.grad_fn is None, name  # a gradient, not a graph that holds the chunks


def test_auto_chunk_counts_what_the_models_own_step_keeps():
    """--rescore-chunk auto for a model with only `step`: the planner's probe (a few rows through phase two's own
    path) prices each model's graph, so the chunk it picks fits the budget, and the blocks model, which keeps no
    (S, H) tensor per row and step, gets several times the obvious model's rows."""
    from twophase.system.memory import SavedTensorMeter
    from twophase.system.profiling import ChunkPlanner

    torch.manual_seed(5)
    S, budget = 30, 100_000
    source = torch.randint(3, 9, (4, S)), torch.tensor([S, 20, 25, S])
    chunks = {}
    for model in _pair(5):
        s = twophase.sample(model, source, 16, max_len=6, generator=torch.Generator().manual_seed(6))
        c = torch.randn(len(s), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        chunks[type(model).__name__] = chunk = ChunkPlanner(budget).chunk_size(model, source, s, c)
        assert 1 < chunk < len(s)  # the budget binds: what follows tests the plan

        def graph(rows, sharing=True):
            """Bytes saved for backward at the peak of phase two in chunks of `rows`: the encoder's graph and
            its cut outputs (whatever the chunk), and the largest chunk's graph."""
            with SavedTensorMeter(list(model.parameters()) + list(model.buffers())) as meter:
                twophase.rescore_backward(model, source, s, c, chunk_size=rows, prefix_sharing=sharing)
            return meter.peak_bytes
        one_row = graph(1)  # the encoder's part, and a row's (a few KB) on top: the tolerance
        assert graph(chunk) - one_row <= budget, (type(model).__name__, chunk)
        assert graph(2 * chunk + 1, sharing=False) - one_row > 0.9 * budget  # and not needlessly small
    assert chunks["ForumSeq2Seq"] >= 3 * chunks["ObviousForumSeq2Seq"], chunks
