"""The public attention blocks (`twophase.additive_attention`, `twophase.dot_attention`) against the plain formula
written with autograd, in float64: values and gradients with respect to the user's parameters and inputs, for
grouped and ungrouped owners and padded sources; gradcheck; what their graph keeps; CUDA's rules on the CPU."""
import pytest
import torch

import twophase
from twophase.system.memory import SavedTensorMeter

from guards import cuda_deterministic_ops, deterministic_algorithms

# owners: B x K rows (grouped from source 0), a chunk's run of sources 1..2 (grouped from 1), and any order
OWNERS = {"grouped": [0, 0, 1, 1, 2, 2], "grouped from 1": [1, 1, 1, 2, 2, 2], "scattered": [2, 0, 1, 0, 2]}


def _inputs(g, N, B=3, S=5, H=4, A=3, dtype=torch.float64):
    """Decoder states h (N, H), encoder outputs y (B, S, H), and the user's W (A, H), U (A, H), v (1, A)."""
    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    return rand(N, H), rand(B, S, H), rand(A, H), rand(A, H), rand(1, A)


def _mask(B=3, S=5):
    lengths = torch.tensor([5, 2, 4])[:B]
    return torch.arange(S)[None, :] < lengths[:, None]  # (B, S)


def plain_additive(h, y, W, U, v, owner, mask):
    """The formula as a user writes it: every row's keys and values copied through owner."""
    energy = torch.tanh((h @ W.T)[:, None, :] + (y @ U.T)[owner]) @ v[0]  # (N, S)
    alpha = torch.softmax(energy.masked_fill(~mask[owner], float("-inf")), dim=-1)
    return (alpha[:, :, None] * y[owner]).sum(1)  # (N, H)


def plain_dot(h, y, W, owner, mask):
    energy = ((h @ W.T)[:, None, :] * y[owner]).sum(-1)  # (N, S)
    alpha = torch.softmax(energy.masked_fill(~mask[owner], float("-inf")), dim=-1)
    return (alpha[:, :, None] * y[owner]).sum(1)


def blocks_additive(h, y, W, U, v, owner, mask):
    return twophase.additive_attention(h @ W.T, y @ U.T, y, v, owner, mask)


def blocks_dot(h, y, W, owner, mask):
    return twophase.dot_attention(h @ W.T, y, y, owner, mask)


@pytest.mark.parametrize("layout", OWNERS)
@pytest.mark.parametrize("kind", ["additive", "dot"])
def test_blocks_equal_the_plain_formula_and_its_gradients(kind, layout):
    g = torch.Generator().manual_seed(1)
    owner = torch.tensor(OWNERS[layout])
    h, y, W, U, v = _inputs(g, len(owner), A=3 if kind == "additive" else 4)  # a dot query is H-sized
    args = (h, y, W, U, v) if kind == "additive" else (h, y, W)
    got_fn, want_fn = (blocks_additive, plain_additive) if kind == "additive" else (blocks_dot, plain_dot)
    weight = torch.randn(len(owner), y.shape[2], generator=g, dtype=torch.float64)  # a loss that mixes every output
    results = []
    for fn in (got_fn, want_fn):
        out = fn(*args, owner, _mask())
        results.append([out, *torch.autograd.grad((out * weight).sum(), args)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["grouped from 1", "scattered"])
def test_gradcheck(layout):
    g = torch.Generator().manual_seed(2)
    owner, mask = torch.tensor(OWNERS[layout]), _mask()
    h, y, W, U, v = _inputs(g, len(owner))
    q, keys = (h @ W.T).detach().requires_grad_(), (y @ U.T).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, y, v: twophase.additive_attention(q, k, y, v, owner, mask),
                                    (q, keys, y, v))
    assert torch.autograd.gradcheck(lambda q, k, y: twophase.dot_attention(q, k, y, owner, mask),
                                    (torch.randn(len(owner), 4, dtype=torch.float64, requires_grad=True), y, y))


@pytest.mark.parametrize("layout", ["grouped", "scattered"])
def test_the_graph_keeps_no_source_sized_tensor_per_row(layout):
    """Per row, the blocks' graph keeps H- and S-sized tensors (the query, the weights), never an (S, A) or (S, D)
    one: S = 40, A = D = 32 and 6 rows; the plain formula keeps three of them (the gathered keys' sum's tanh, and
    the copied values), which is what the bound tells apart."""
    g = torch.Generator().manual_seed(3)
    owner = torch.tensor(OWNERS[layout])
    N, S, A = len(owner), 40, 32
    h, y, W, U, v = _inputs(g, N, S=S, H=A, A=A)
    mask = torch.ones(3, S, dtype=torch.bool)
    per_row_source = N * S * A * 8  # one (N, S, A) float64 tensor
    kept = {}
    for name, fn in (("blocks", twophase.additive_attention), ("plain", None)):
        q, keys = h @ W.T, y @ U.T
        with SavedTensorMeter([q, keys, y, v]) as meter:
            if fn is None:
                out = (torch.softmax(torch.tanh(q[:, None, :] + keys[owner]) @ v[0], -1)[:, :, None] * y[owner]).sum(1)
            else:
                out = fn(q, keys, y, v, owner, mask)
        kept[name] = meter.peak_bytes
        del out
    assert kept["plain"] >= 2 * per_row_source
    assert kept["blocks"] < per_row_source / 4


@pytest.mark.parametrize("layout", ["grouped", "scattered"])
def test_cuda_deterministic_rules_hold_forward_and_backward(layout):
    """The blocks' forward and backward run no op that CUDA refuses under deterministic algorithms
    (`--deterministic`), checked on the CPU by tests/guards.py."""
    g = torch.Generator().manual_seed(4)
    owner = torch.tensor(OWNERS[layout])
    h, y, W, U, v = _inputs(g, len(owner), A=4)
    with cuda_deterministic_ops(), deterministic_algorithms():
        out = blocks_additive(h, y, W, U, v, owner, _mask()) + blocks_dot(h, y, W, owner, _mask())
        out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (h, y, W, U, v))


def test_autocast_runs_backward_in_the_parameters_dtype():
    """Under bf16 autocast (--amp bf16) the blocks compute in bf16 and the gradients come back in float32."""
    g = torch.Generator().manual_seed(5)
    owner = torch.tensor(OWNERS["scattered"])
    h, y, W, U, v = _inputs(g, len(owner), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = blocks_additive(h, y, W, U, v, owner, _mask())
    out.float().sum().backward()
    assert all(x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all() for x in (h, y, W, U, v))
