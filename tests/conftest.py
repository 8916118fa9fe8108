import os

import pytest
import torch

from twophase import Seq2Seq

# train.py's end-of-run picture (matplotlib, about a second a run) is drawn only by the tests that look at it; set
# here, before any test, so the suite's subprocesses inherit it too
os.environ["TWOPHASE_PICTURE"] = "off"


def tiny_model(src_vocab=9, tgt_vocab=7, hidden=16, embed=8, bidirectional=False, seed=0):
    """A tiny fp64 model with weights large enough to give peaked, varied distributions."""
    torch.manual_seed(seed)
    model = Seq2Seq(src_vocab, tgt_vocab, embed_dim=embed, hidden_size=hidden, bidirectional=bidirectional).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model.eval()


def toy_batch(lengths=(3, 1, 5), src_vocab=9, seed=1):
    """Sources right-padded with PAD (0), ids in [4, src_vocab)."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    src = torch.zeros(len(lengths), S, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, src_vocab, (n,), generator=g)
    return src, torch.tensor(lengths)


def take_grads(model):
    """Every parameter's gradient (zeros where none), then cleared: one gradient per call."""
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture
def model():
    return tiny_model()


@pytest.fixture
def batch():
    return toy_batch()


@pytest.fixture
def one_thread():
    """Torch on one thread: tiny tensors gain nothing from a second one, which only stalls when other
    processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
