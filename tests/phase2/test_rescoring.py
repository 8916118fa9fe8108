"""Phase two computes exactly the gradient of sum_i c_i log p(y_i | x), whatever the chunk size."""
import pytest
import torch

from twophase import Samples, beam_search, objectives, rescore_backward, sample
from twophase.vocab import PAD

from conftest import rnn_graph_mode, tiny_model, toy_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a second thread only stalls on a busy machine


def _candidates(model, src, lens, kind):
    if kind == "beam":
        return beam_search(model, (src, lens), beam_size=4, max_len=5)
    return sample(model, (src, lens), num_samples=4, max_len=5, generator=torch.Generator().manual_seed(0))


def _coefficients(name, s, B):
    g = torch.Generator().manual_seed(5)
    r = torch.rand(len(s), generator=g, dtype=torch.float64)
    if name == "mle":
        return objectives.mle(s.owner, B)
    if name.startswith("reinforce-"):
        baseline = name.split("-")[1]
        greedy = torch.rand(B, generator=g, dtype=torch.float64)
        return objectives.reinforce(r, s.owner, B, baseline, greedy_rewards=greedy)
    if name == "beam":
        return objectives.beam(r, s.scores, s.owner, B, tokens=s.tokens)
    return objectives.mrt(r, s.scores, s.owner, B, alpha=0.5, tokens=s.tokens)


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


OBJECTIVES = ["mle", "reinforce-none", "reinforce-mean", "reinforce-loo", "reinforce-greedy", "beam", "mrt"]


@pytest.mark.parametrize("kind", ["beam", "sample"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_chunked_gradient_equals_one_piece_gradient(kind, objective):
    model = tiny_model(bidirectional=(kind == "sample"))
    src, lens = toy_batch()
    s = _candidates(model, src, lens, kind)
    c = _coefficients(objective, s, B=3)
    N = len(s)

    model.zero_grad()
    with rnn_graph_mode(model):
        lp = model.sequence_log_probs(src, lens, s.tokens, s.owner)  # one graph over every row
    (c * lp).sum().backward()
    want = _grads(model)
    assert sum(float(g.abs().sum()) for g in want) > 0

    for chunk in range(1, N + 2):
        for oom_retry in (False, True):  # straight into .grad (CPU default), or collected first (CUDA default)
            model.zero_grad()
            value = rescore_backward(model, (src, lens), s, c, chunk_size=chunk, oom_retry=oom_retry)
            assert value == pytest.approx(float((c * lp).sum().detach()), abs=1e-10)
            for g, w in zip(_grads(model), want):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_chunks_split_sources_and_rows_in_any_order():
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "beam")
    perm = torch.randperm(len(s), generator=torch.Generator().manual_seed(0))
    shuffled = s.select(perm)
    c = torch.linspace(-1, 1, len(s), dtype=torch.float64)
    model.zero_grad()
    rescore_backward(model, (src, lens), s, c, chunk_size=len(s))
    want = _grads(model)
    model.zero_grad()
    rescore_backward(model, (src, lens), shuffled, c[perm], chunk_size=3)
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_gradient_accumulates_into_existing_grad():
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "sample")
    c = torch.ones(len(s), dtype=torch.float64)
    model.zero_grad()
    rescore_backward(model, (src, lens), s, c, chunk_size=2)
    once = _grads(model)
    rescore_backward(model, (src, lens), s, c, chunk_size=5)
    for g, w in zip(_grads(model), once):
        torch.testing.assert_close(g, 2 * w, rtol=1e-9, atol=1e-12)


def test_zero_coefficients_touch_nothing():
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "beam")
    model.zero_grad(set_to_none=True)
    assert rescore_backward(model, (src, lens), s, torch.zeros(len(s), dtype=torch.float64), chunk_size=2) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_mixed_reference_and_candidate_rows():
    """The MLE term rides along as extra rows: one encoder pass, same chunking, exact gradient."""
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "beam")
    refs = Samples(tokens=torch.tensor([[5, 2, 0], [4, 6, 2], [2, 0, 0]]), lengths=torch.tensor([2, 3, 1]),
                   owner=torch.tensor([0, 1, 2]), scores=torch.zeros(3, dtype=torch.float64))
    rl = objectives.beam(torch.rand(len(s), dtype=torch.float64), s.scores, s.owner, 3, tokens=s.tokens)
    c = objectives.mix(rl, objectives.mle(refs.owner, 3), mle_weight=0.3)
    both = Samples.cat([s, refs], PAD)
    model.zero_grad()
    with rnn_graph_mode(model):
        lp = torch.cat([model.sequence_log_probs(src, lens, s.tokens, s.owner),
                        model.sequence_log_probs(src, lens, refs.tokens, refs.owner)])
    (c * lp).sum().backward()
    want = _grads(model)
    model.zero_grad()
    rescore_backward(model, (src, lens), both, c, chunk_size=4)
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", [0, -3])
def test_impossible_chunk_size_is_refused(bad):
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "beam")
    with pytest.raises(ValueError, match="chunk_size"):
        rescore_backward(model, (src, lens), s, torch.ones(len(s)), chunk_size=bad)


@pytest.mark.parametrize("path", ["decoder_states", "score"])
def test_out_of_memory_halves_the_chunk_and_stays_exact(monkeypatch, path):
    """Both row paths (prefix_sharing=False; the prefix tree's are in test_prefixtree.py): output layer by hand,
    wrapped at decoder_states, and the plain autograd one taken when `score` is replaced."""
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "beam")
    c = _coefficients("beam", s, B=3)
    model.zero_grad()
    rescore_backward(model, (src, lens), s, c, chunk_size=len(s))
    want = _grads(model)

    sizes = []
    real = getattr(model, path)

    def counted(enc, tokens, owner):
        sizes.append(len(tokens))
        return real(enc, tokens, owner)

    def fail_late_in_backward(grad):
        # The decoder cell's gradient comes after the output layer's: a plain .backward() would already have
        # accumulated part of the failed chunk into .grad.
        if sizes[-1] > 3:
            raise torch.cuda.OutOfMemoryError("injected")
        return grad

    monkeypatch.setattr(model, path, counted)
    if path == "score":  # the generic path: autograd through `score`, not the output layer by hand
        monkeypatch.setattr(model, "weighted_score_backward", None)
    handle = model.cell.weight_ih.register_hook(fail_late_in_backward)
    model.zero_grad()
    rescore_backward(model, (src, lens), s, c, chunk_size=8, oom_retry=True, prefix_sharing=False)  # CUDA default
    handle.remove()
    assert sizes[:3] == [8, 4, 2] and max(sizes[3:]) <= 2  # halved twice, then the rest at the new size
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_out_of_memory_without_retry_is_raised(monkeypatch):
    """On the CPU (oom_retry off by default) a chunk adds into .grad as it goes, so it cannot be redone."""
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "beam")
    sizes = []

    def score(enc, tokens, owner):
        sizes.append(len(tokens))
        raise torch.cuda.OutOfMemoryError("injected")

    monkeypatch.setattr(model, "score", score)
    monkeypatch.setattr(model, "weighted_score_backward", None)
    monkeypatch.setattr(model, "weighted_tree_backward", None)  # a model with its own `score` scores rows
    with pytest.raises(torch.cuda.OutOfMemoryError):
        rescore_backward(model, (src, lens), s, torch.ones(len(s), dtype=torch.float64), chunk_size=8)
    assert sizes == [8]


def test_out_of_memory_with_a_single_row_is_raised(monkeypatch):
    model = tiny_model()
    src, lens = toy_batch()
    s = _candidates(model, src, lens, "beam")

    def score(enc, tokens, owner):
        raise torch.cuda.OutOfMemoryError("injected")

    monkeypatch.setattr(model, "score", score)
    monkeypatch.setattr(model, "weighted_score_backward", None)
    monkeypatch.setattr(model, "weighted_tree_backward", None)  # a model with its own `score` scores rows
    with pytest.raises(torch.cuda.OutOfMemoryError):
        rescore_backward(model, (src, lens), s, torch.ones(len(s), dtype=torch.float64), chunk_size=2, oom_retry=True)


def test_rows_and_coefficients_go_to_the_encoder_outputs_device(monkeypatch):
    """Samples and coefficients made on the CPU (`Samples.from_completions`, rewards computed on the host) for
    a model elsewhere are moved to the device of its encoder output before anything is decoded. The meta device
    stands in for a GPU: the model runs there shape-only, and the plan sees where the rows went."""
    from twophase.models.karel import KarelModel
    from twophase.phase2 import rescoring

    model = KarelModel(12, 4, 4, embed_dim=4, hidden_size=6, channels=(3, 3)).to("meta")
    source = torch.zeros(2, 2, 32, 4, 4, device="meta")
    s = Samples.of_targets(torch.tensor([[5, 6, 1], [7, 1, 0], [5, 1, 0]]), torch.tensor([0, 0, 1]),
                           model.pad_id, model.eos_id)
    seen = []

    class Seen(Exception):
        pass

    def plan(model, samples, tree):
        seen.append({f: getattr(samples, f).device.type for f in ("tokens", "lengths", "owner", "scores")})
        raise Seen

    monkeypatch.setattr(rescoring, "ChunkPlan", plan)
    with pytest.raises(Seen):
        rescore_backward(model, source, s, torch.ones(3), chunk_size=2)
    assert seen == [{"tokens": "meta", "lengths": "meta", "owner": "meta", "scores": "meta"}]
