"""cuDNN back-propagates through nn.LSTM/GRU/RNN only in training mode: scoring_mode runs every such module in
training mode at dropout 0 (evaluation mode's arithmetic) and hands each back as it was; tests/conftest.py's
guard refuses, on every device, a graph recorded through one in evaluation mode. Where no graph is recorded
(search, validation, decoding) they run in evaluation mode, cuDNN's inference kernels."""
import contextlib

import pytest
import torch
from torch import nn

from twophase import objectives, rescore_backward
from twophase.protocol import scoring_mode


class _Stacked(nn.Module):
    """Two LSTM layers with inter-layer dropout, a GRU, and dropout between them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True).double()
        self.gru = nn.GRU(4, 2, batch_first=True).double()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.gru(self.drop(self.lstm(x)[0]))[0]


def test_the_guard_refuses_a_graph_through_an_rnn_in_evaluation_mode():
    net = _Stacked().eval()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="training mode"):
        net(x)
    with torch.no_grad():
        net(x)  # no graph: evaluation mode is fine
    net.requires_grad_(False)(x)  # nothing to differentiate: fine too


def test_scoring_mode_computes_evaluation_modes_numbers_with_a_graph_and_restores_the_modes():
    net = _Stacked().eval()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    with torch.no_grad():
        want = net(x)
    for start in ("train", "eval"):
        net.train(start == "train")
        with scoring_mode(net):
            assert net.lstm.training and net.lstm.dropout == 0 and not net.drop.training
            got = net(x)
            got.sum().backward()
        assert torch.equal(got.detach(), want)  # same arithmetic, repeatable: dropout is off
        assert all(m.training == (start == "train") for m in net.modules()) and net.lstm.dropout == 0.5


def test_scoring_mode_restores_the_modes_after_an_exception_and_keep_leaves_training_dropout_on():
    net = _Stacked().eval()
    with pytest.raises(KeyError):
        with scoring_mode(net):
            raise KeyError("boom")
    assert not net.lstm.training and not net.gru.training and net.lstm.dropout == 0.5
    net.train()
    with scoring_mode(net, keep=True):  # the MLE steps' dropout stays
        assert net.lstm.training and net.lstm.dropout == 0.5 and net.drop.training
    net.eval()
    with scoring_mode(net, keep=True):  # an RNN in evaluation mode still gets cuDNN's mode, at dropout 0
        assert net.lstm.training and net.lstm.dropout == 0 and not net.drop.training
    assert not net.lstm.training and net.lstm.dropout == 0.5


def test_a_model_that_is_not_a_module_has_its_rnn_attributes_switched():
    class Plain:
        def __init__(self):
            self.net = _Stacked().eval()
    model = Plain()
    with scoring_mode(model):
        assert model.net.lstm.training and model.net.lstm.dropout == 0
    assert not model.net.lstm.training and model.net.lstm.dropout == 0.5


def test_phase_two_of_a_dropout_lstm_left_in_evaluation_mode(one_thread):
    """What an RL step does (model.eval() in its rollout, then phase two) on the built-in model, its encoder an nn.LSTM:
    runs under the guard and gives the plain autograd gradient of evaluation mode's scores."""
    from conftest import rnn_graph_mode, tiny_model, toy_batch
    from twophase import beam_search
    model, (src, lens) = tiny_model(), toy_batch()
    s = beam_search(model, (src, lens), 3, 5)
    c = objectives.reinforce(torch.linspace(0, 1, len(s), dtype=torch.float64), s.owner, 3, "mean")
    with rnn_graph_mode(model):
        (c * model.sequence_log_probs(src, lens, s.tokens, s.owner)).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    rescore_backward(model, (src, lens), s, c, chunk_size=2)
    assert not model.encoder.training
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-12)


@contextlib.contextmanager
def _rnn_modes():
    """Every nn.RNNBase forward's `training` flag, in call order, for the block."""
    seen = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.append(module.training) if isinstance(module, nn.RNNBase) else None)
    try:
        yield seen
    finally:
        hook.remove()


def _inference_and_graphs(model, source, targets):
    """name -> a call: the passes that record no graph, then those that do."""
    from twophase import beam_search, check_model, sample
    from twophase.objectives.mismatch import own_token_logps
    from twophase.phase1.onephase import one_phase_search
    from twophase.phase1.sbs import stochastic_beam_search
    from twophase.train.evaluation import reference_scores
    s = beam_search(model, source, 3, 5)
    c = torch.linspace(-1, 1, len(s), dtype=torch.float64)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    inference = {"beam": lambda: beam_search(model, source, 3, 5), "sample": lambda: sample(model, source, 3, 5),
                 "sbs": lambda: stochastic_beam_search(model, source, 3, 5, generator=g()),
                 "check_model": lambda: check_model(model, source, targets),
                 "reference scores": lambda: reference_scores(model, source, targets),
                 "own token logps": lambda: own_token_logps(model, source, s)}
    graphs = {"phase two": lambda: rescore_backward(model, source, s, c, chunk_size=2),
              "one-phase": lambda: one_phase_search(model, source, "sample", 3, 5, generator=g())[1].sum().backward()}
    return inference, graphs


@pytest.mark.parametrize("kind", ["seq2seq", "karel-paper"])
def test_rnns_run_in_training_mode_only_where_a_graph_is_recorded(kind, one_thread):
    """cuDNN's training kernels (and their reserve buffers) where phase two or the one-phase baseline records a
    graph; its inference kernels for search, validation, the model check and the mismatch's own scores."""
    from conftest import tiny_model, toy_batch
    from twophase.samples import Samples
    if kind == "seq2seq":
        model, source = tiny_model(), toy_batch()
    else:
        from twophase.models.karel_paper import KarelPaperModel
        torch.manual_seed(0)
        model = KarelPaperModel(12, 4, 4, embed_dim=6, hidden_size=8, channels=4, blocks=1, pair_dim=8).double()
        source = (torch.rand(2, 2, 32, 4, 4, generator=torch.Generator().manual_seed(1)) < 0.2).double()
    targets = Samples.from_completions([[5, 6, model.eos_id], [4, model.eos_id]], torch.tensor([0, 1]),
                                       model.pad_id, model.eos_id)
    inference, graphs = _inference_and_graphs(model.eval(), source, targets)
    for name, run in {**inference, **graphs}.items():
        with _rnn_modes() as seen:
            run()
        assert seen, name
        assert set(seen) == {name in graphs}, (name, seen)
        assert not any(m.training for m in model.modules()), name  # handed back in evaluation mode
