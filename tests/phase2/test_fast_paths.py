"""The fast paths are the same numbers: grouped (B x K) attention against the general owner path, and phase
two's hand-differentiated output layer against autograd through `Seq2Seq.score`."""
import pytest
import torch

from twophase.models import fused, outputlayer
from twophase import rescore_backward
from twophase.vocab import BOS, PAD

from conftest import tiny_model, toy_batch
from test_rescoring import _candidates, _coefficients, _grads


def _rand(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("owner,want", [([0, 0, 1, 1], (0, 2)), ([2, 3], (2, 1)), ([1, 1, 1], (1, 3)),
                                        ([1, 0], None), ([0, 0, 1], None), ([0, 2], None), ([0, 1, 0, 1], None)])
def test_groups_recognises_only_consecutive_equal_runs(owner, want):
    assert fused.groups(torch.tensor(owner)) == want


@pytest.mark.parametrize("owner", [[0, 0, 0, 1, 1, 1], [1, 1, 2, 2, 3, 3], [2, 2, 2, 2, 2, 2]])
def test_grouped_attention_gradcheck_and_equals_general_path(owner):
    g = torch.Generator().manual_seed(0)
    owner = torch.tensor(owner)
    grp = fused.groups(owner)
    assert grp is not None
    q, keys, v = _rand(6, 3, g=g), _rand(4, 5, 3, g=g), _rand(1, 3, g=g)
    alpha, memory = _rand(6, 5, g=g), _rand(4, 5, 2, g=g)
    assert torch.autograd.gradcheck(lambda *x: fused.AttentionEnergies.apply(*x, owner, grp), (q, keys, v))
    assert torch.autograd.gradcheck(lambda *x: fused.AttentionContext.apply(*x, owner, grp), (alpha, memory))
    for fn, args in ((fused.AttentionEnergies.apply, (q, keys, v)), (fused.AttentionContext.apply, (alpha, memory))):
        grads = []
        for layout in (grp, None):
            out = fn(*args, owner, layout)
            grads.append([out] + list(torch.autograd.grad(out.square().sum(), args)))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [None, 2])
def test_target_log_probs_and_grads_equal_autograd(block):
    g = torch.Generator().manual_seed(2)
    h, weight, bias = _rand(7, 3, g=g), _rand(6, 3, g=g), _rand(6, g=g)
    target = torch.tensor([2, 5, 3, 2, 4, 5, 3])
    banned = torch.zeros(6, dtype=torch.bool)
    banned[[PAD, BOS]] = True
    w = torch.randn(7, generator=g, dtype=torch.float64)
    tok = outputlayer.target_log_probs(h, weight, bias, target, banned, block)
    want = [tok] + list(torch.autograd.grad(tok, (h, weight, bias), w))
    got = outputlayer.target_log_probs_and_grads(h.detach(), weight.detach(), bias.detach(), target, banned, w, block)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["beam", "sample"])
@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_fused_rescoring_equals_autograd_through_score(kind, chunk):
    model = tiny_model(bidirectional=chunk == 5)
    src, lens = toy_batch()
    s = _candidates(model, src, lens, kind)
    c = _coefficients("beam", s, B=3)
    model.zero_grad()
    fast = rescore_backward(model, (src, lens), s, c, chunk_size=chunk)
    want = _grads(model)
    model.zero_grad()
    # No hand-made paths: rescoring differentiates `score` over the rows with autograd
    model.weighted_tree_backward = model.weighted_score_backward = None
    try:
        plain = rescore_backward(model, (src, lens), s, c, chunk_size=chunk)
    finally:
        del model.weighted_tree_backward, model.weighted_score_backward
    assert fast == pytest.approx(plain, rel=1e-12)
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("grouped", [True, False])
def test_energies_in_row_blocks_equal_one_piece(monkeypatch, grouped):
    from twophase.models import fused as fused_module

    g = torch.Generator().manual_seed(0)
    B, K, S, A = 3, 4, 5, 6
    keys = torch.randn(B, S, A, generator=g, dtype=torch.float64)
    q = torch.randn(B * K, A, generator=g, dtype=torch.float64)
    v = torch.randn(1, A, generator=g, dtype=torch.float64)
    owner = torch.arange(B).repeat_interleave(K) if grouped else torch.randint(0, B, (B * K,), generator=g)
    grp = fused_module.groups(owner) if grouped else None
    whole = fused_module.energies(q, keys, v, owner, grp)
    monkeypatch.setattr(fused_module, "BLOCK_BYTES", S * A * 8 * 3)  # three rows' worth: several blocks
    blocked = fused_module.energies(q, keys, v, owner, grp)
    torch.testing.assert_close(blocked, whole, rtol=1e-12, atol=1e-12)  # blocked and whole matmuls round differently on some CPUs


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_block_sizes_follow_the_device(monkeypatch, device):
    """The output layer's logit blocks and the attention's tanh blocks are `blocks.block_bytes` of the device:
    the module's BLOCK_BYTES on the CPU (here shrunk to force many blocks), far larger on an accelerator (the
    meta device stands in for one: shapes only, nothing computed)."""
    from twophase import blocks
    from twophase.models import outputlayer

    monkeypatch.setattr(fused, "BLOCK_BYTES", 4096)
    M, H, V, S, A = 64, 4, 256, 8, 4
    calls = {"logits": 0, "tanh": 0}
    real_logits, real_tanh = outputlayer.logits, fused._tanh_pre

    def logits(*args):
        calls["logits"] += 1
        return real_logits(*args)

    def tanh_pre(*args):
        calls["tanh"] += 1
        return real_tanh(*args)

    monkeypatch.setattr(outputlayer, "logits", logits)
    monkeypatch.setattr(fused, "_tanh_pre", tanh_pre)
    opts = dict(device=device, dtype=torch.float32)
    if device == "cpu":
        h, weight, bias = torch.zeros(M, H, **opts), torch.zeros(V, H, **opts), torch.zeros(V, **opts)
        target, banned = torch.zeros(M, dtype=torch.long), torch.zeros(V, dtype=torch.bool)
        outputlayer.target_log_probs_and_grads(h, weight, bias, target, banned, torch.ones(M, **opts))
    else:  # the output layer asks autocast about its device, which meta has not: its block size directly
        calls["logits"] = -(-M // outputlayer._block_rows(M, V, torch.float32, torch.device(device)))
    fused.energies(torch.zeros(M, A, **opts), torch.zeros(2, S, A, **opts), torch.zeros(1, A, **opts),
                   torch.zeros(M, dtype=torch.long, device=device))
    block = blocks.block_bytes(device, 4096)
    assert calls["logits"] == -(-M // max(1, block // (V * 4)))
    assert calls["tanh"] == -(-M // max(1, block // (S * A * 4)))
    assert (calls["logits"], calls["tanh"]) == ((16, 2) if device == "cpu" else (1, 1))
