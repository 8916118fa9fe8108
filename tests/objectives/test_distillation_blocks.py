"""Distillation's memory per block of logits: the divergence holds a few (m, V) blocks at once, whatever V (the
profiler's allocation record, `AllocationPeak`); the output layer's block loop frees each block's tensors before
it makes the next block's. Each with its numbers checked against plain float64 autograd of the formula."""
import math

import pytest
import torch

from twophase.models import outputlayer
from twophase.objectives.distill import divergence_and_gradient
from twophase.system.memory import AllocationPeak

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(z, zt, beta, temperature):
    """(m,) D of the module docstring by plain autograd in float64 (no token banned), and dD/dz summed."""
    z = z.double().detach().requires_grad_()
    s, t = torch.log_softmax(z / temperature, -1), torch.log_softmax(zt.double() / temperature, -1)
    p, q = s.exp(), t.exp()
    if beta == 0.0:
        D = (q * (t - s)).sum(-1)
    elif beta == 1.0:
        D = (p * (s - t)).sum(-1)
    else:
        m = torch.log((1 - beta) * p + beta * q)
        D = beta * (q * (t - m)).sum(-1) + (1 - beta) * (p * (s - m)).sum(-1)
    (grad,) = torch.autograd.grad(D.sum(), z)
    return D.detach(), grad


def _blocks(m, V, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(m, V, generator=g, dtype=torch.float64),
            3 * torch.randn(m, V, generator=g, dtype=torch.float64))


# beside the student's block z: the (m, V) blocks held at once, one boolean block (a quarter) for a moment, and
# with a temperature one more for the scaled logits
HELD = {1.0: 2, 0.0: 3, 0.5: 4}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_divergence_holds_a_few_blocks(beta, temperature):
    m, V = 16, 5000
    z, zt = _blocks(m, V, seed=0)
    block = m * V * 8
    with AllocationPeak() as peak:
        D, grad = divergence_and_gradient(z, zt.clone(), beta, temperature)  # the teacher's block consumed
    held = HELD[beta] + 0.25 + (temperature != 1.0)
    assert peak.peak_bytes <= held * block + 4096, peak.peak_bytes / block
    assert peak.end_bytes <= block + 4096  # the gradient (and D) alone remain
    want_D, want = reference(z, zt, beta, temperature)
    torch.testing.assert_close(D, want_D, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


def test_a_banned_token_gets_no_gradient_and_no_nan():
    """Tokens both models ban (logit -inf) have probability 0: they add nothing to D and get a 0 gradient."""
    z, zt = _blocks(4, 50, seed=1)
    banned = torch.zeros(50, dtype=torch.bool)
    banned[[0, 2]] = True
    for beta in (0.0, 0.5, 1.0):
        D, grad = divergence_and_gradient(z.masked_fill(banned, -math.inf), zt.masked_fill(banned, -math.inf),
                                          beta, 0.7)
        want_D, want = reference(z[:, ~banned], zt[:, ~banned], beta, 0.7)
        assert torch.isfinite(D).all() and (grad[:, banned] == 0).all()
        torch.testing.assert_close(D, want_D, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad[:, ~banned], want, rtol=1e-10, atol=1e-12)


def test_each_block_is_freed_before_the_next():
    """The by-hand output layer over M positions in blocks of 8 rows: its peak is its outputs, one block's logits
    and logsumexp's temporary of them, not one more (the previous block's, kept until the next replaced it)."""
    g = torch.Generator().manual_seed(2)
    M, H, V, rows = 64, 8, 4000, 8
    h, weight, bias = torch.randn(M, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    target, w = torch.randint(0, V, (M,), generator=g), torch.randn(M, generator=g)
    banned = torch.zeros(V, dtype=torch.bool)
    block = rows * V * 4
    outputs = (M + M * H + V * H + V) * 4  # log p, d/dh, d/dweight, d/dbias
    with AllocationPeak() as peak:
        tok, dh, dw, db = outputlayer.target_log_probs_and_grads(h, weight, bias, target, banned, w, block=rows)
    assert peak.peak_bytes <= outputs + 2.25 * block, (peak.peak_bytes - outputs) / block
    hr, weightr, biasr = (x.double().requires_grad_() for x in (h, weight, bias))
    logp = torch.log_softmax(hr @ weightr.t() + biasr, -1).gather(1, target[:, None]).squeeze(1)
    (w.double() * logp).sum().backward()
    for got, want in ((tok, logp), (dh, hr.grad), (dw, weightr.grad), (db, biasr.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
