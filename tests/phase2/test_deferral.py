"""phase2.deferral: a step's F.linear, F.embedding and torch.lstm_cell with their weight gradients summed once per
chunk give plain autograd's gradients (float64), whether phase two collects them or adds them into .grad, with a
padding row, a weight used both deferred and directly, and the calls it must leave alone."""
import pytest
import torch
import torch.nn.functional as F

from twophase.phase2 import deferral


def _parts():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(7, 4, padding_idx=0).double()
    cell = torch.nn.LSTMCell(4, 3).double()
    out = torch.nn.Linear(3, 7).double()
    return emb, cell, out


def _loss(emb, cell, out, steps):
    """Three steps of an embedding, an LSTM cell and an output layer whose weight is also read directly."""
    h = c = torch.zeros(2, 3, dtype=torch.float64)
    total = 0
    for ids in steps:
        h, c = cell(emb(ids), (h, c))
        total = total + (F.log_softmax(out(h), -1) * torch.arange(7.0, dtype=torch.float64)).sum()
        total = total + out(torch.stack([h, 2 * h], dim=1)).square().mean()  # an (n, 2, H) input: rows of rows
    return total + (out.weight ** 2).sum()  # a direct use: autograd's share beside the deferred one


STEPS = [torch.tensor([1, 0]), torch.tensor([0, 3]), torch.tensor([5, 5])]  # padding id 0 fed twice


@pytest.mark.parametrize("collect", [True, False])
def test_deferred_gradients_equal_autograd(collect):
    parts = _parts()
    params = [p for m in parts for p in m.parameters()]
    want = torch.autograd.grad(_loss(*parts, STEPS), params)
    with deferral.Deferred(params) as deferred:
        loss = _loss(*parts, STEPS)
    assert type(loss.grad_fn.next_functions[0][0]).__name__ != "AccumulateGrad"
    if collect:
        got = deferred.add(params, torch.autograd.grad(loss, params, allow_unused=True), collect=True)
    else:
        loss.backward(inputs=params)
        assert deferred.add(params, [], collect=False) == []
        got = [p.grad for p in params]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        assert g.grad_fn is None and not g.requires_grad  # summed without a graph (the inputs saved do need grad)
    assert not got[0][0].any()  # the padding row


def test_only_the_given_parameters_and_plain_calls_are_deferred():
    emb, cell, out = _parts()
    with deferral.Deferred([out.weight]):
        y = out(torch.randn(2, 3, dtype=torch.float64))  # deferred
        z = F.linear(torch.randn(2, 3, dtype=torch.float64), cell.weight_hh[:7, :3])  # not a given parameter
        e = F.embedding(torch.tensor([1]), out.weight, max_norm=1.0)  # max_norm renormalises: left alone
        with torch.no_grad():
            n = out(torch.randn(2, 3, dtype=torch.float64))  # no graph: left alone
        wide = out(torch.randn(deferral.DEFERRED_BELOW_ROWS, 3, dtype=torch.float64))  # a step of many rows
    assert type(y.grad_fn).__name__ == "DeferredLinearBackward"
    assert type(wide.grad_fn).__name__ == "AddmmBackward0"
    assert type(z.grad_fn).__name__ != "DeferredLinearBackward"
    assert type(e.grad_fn).__name__ == "EmbeddingBackward0" and n.grad_fn is None
