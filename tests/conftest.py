import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from twophase import Seq2Seq

# train.py's end-of-run picture (matplotlib, about a second a run) is drawn only by the tests that look at it; set
# here, before any test, so the suite's subprocesses inherit it too
os.environ["TWOPHASE_PICTURE"] = "off"

# The tests live in folders that mirror the package (tests/phase1, tests/train, ...) and share helpers by module
# name (`from test_cli import _fails_with_one_line`, `import hf_tiny`): every folder is on the path, as the one
# folder was before, so a test imports another folder's helpers whatever order pytest collects them in.
_HERE = Path(__file__).resolve().parent
for _folder in sorted(p for p in _HERE.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.insert(1, str(_folder))


def _refuse_eval_rnn_graph(module, args):
    """What cuDNN does on a GPU, done on every device: an nn.LSTM/GRU/RNN that records a graph in evaluation
    mode cannot be back-propagated there ("cudnn RNN backward can only be called in training mode"). Phase two
    and the one-phase baseline must run such a module in training mode with its dropout at 0 (the same
    arithmetic); this hook makes every test that records such a graph fail on the CPU as it would on a GPU."""
    if not isinstance(module, nn.RNNBase) or module.training or not torch.is_grad_enabled():
        return None
    if any(p.requires_grad for p in module.parameters(recurse=False)):
        raise RuntimeError(f"cudnn RNN backward can only be called in training mode: {type(module).__name__} "
                           f"records a graph in evaluation mode (tests/conftest.py's guard)")
    return None


def _refuse_non_contiguous_rnn_state(module, args):
    """What cuDNN does on a GPU, done on every device: an nn.LSTM/GRU/RNN given an initial state hx (or an LSTM's
    cell state cx) that is not contiguous stops there ("rnn: hx is not contiguous"), where the CPU kernel reads any
    strides: an expanded or permuted state must be made contiguous before the call."""
    if not isinstance(module, nn.RNNBase) or len(args) < 2 or args[1] is None:
        return None
    if isinstance(args[0], nn.utils.rnn.PackedSequence) and args[0].sorted_indices is not None:
        return None  # the module reorders the state by index_select first: a contiguous copy reaches the kernel
    for name, state in zip(("hx", "cx"), args[1] if isinstance(args[1], tuple) else (args[1],)):
        if not state.is_contiguous():
            raise RuntimeError(f"rnn: {name} is not contiguous: {type(module).__name__} given a state of shape "
                               f"{tuple(state.shape)} and strides {state.stride()}, which cuDNN refuses "
                               f"(tests/conftest.py's guard)")
    return None


# For the whole suite, every test: module-level global hooks, called before every module's forward.
_EVAL_RNN_GUARD = torch.nn.modules.module.register_module_forward_pre_hook(_refuse_eval_rnn_graph)
_RNN_STATE_GUARD = torch.nn.modules.module.register_module_forward_pre_hook(_refuse_non_contiguous_rnn_state)


@contextlib.contextmanager
def rnn_graph_mode(model):
    """A test's own reference pass that records a graph: the model in evaluation mode, its nn.LSTM/GRU/RNN modules
    in training mode (what cuDNN back-propagates through), each checked to have no inter-layer dropout, so the
    arithmetic is evaluation mode's; the modes restored afterwards."""
    model.eval()
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    for m in rnns:
        assert m.dropout == 0 or m.num_layers == 1, f"{m} would drop out in training mode"
        m.train()
    try:
        yield model
    finally:
        for m in rnns:
            m.eval()


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
