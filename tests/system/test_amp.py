"""--amp: both phases under the same CPU bf16 autocast, the output layer's dtypes, and fp16's loss scaling logic
(exercised with torch's CPU GradScaler: `--amp fp16` itself is CUDA-only and untested here).

bf16 keeps 8 significant bits: one rounding is off by at most u = 2^-9 ~ 2e-3 relative. Tolerances below are
stated against u, or against float32 where both sides run the very same bf16 products."""
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twophase.system import amp
from twophase.train import cli, recipe
from twophase import beam_search, objectives, rescore_backward, sample
from twophase.models import outputlayer
from twophase.train.steps import parts as parts_module
from twophase.train.checkpoint import load, save_atomic
from twophase.config import Config
from twophase.vocab import BOS, PAD

from conftest import rnn_graph_mode, tiny_model, toy_batch
from taskfiles import task_dir

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)
ROOT = Path(__file__).resolve().parents[2]


def _model():
    return tiny_model(hidden=16).float()  # autocast leaves float64 alone: the AMP paths need float32


def _candidates(model, src, lens, kind):
    if kind == "beam":
        return beam_search(model, (src, lens), beam_size=4, max_len=6)
    return sample(model, (src, lens), num_samples=4, max_len=6, generator=torch.Generator().manual_seed(0))


def _rel(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["beam", "sample"])
def test_phase_one_scores_equal_teacher_forced_log_probs_under_bf16(one_thread, kind):
    """Both phases run the same bf16 matmuls on the same inputs and normalise in float32; only float32
    summation order differs (|score| <= ~10, T <= 6), so 1e-4. Scoring outside autocast is ~5e-3 away: the
    tolerance tells a phase run in another precision apart."""
    model, (src, lens) = _model(), toy_batch()
    with torch.autocast(**BF16):
        s = _candidates(model, src, lens, kind)
        with torch.no_grad():
            lp = model.sequence_log_probs(src, lens, s.tokens, s.owner)
    assert s.scores.dtype == lp.dtype == torch.float32
    torch.testing.assert_close(s.scores, lp, rtol=0, atol=1e-4)
    with torch.no_grad():
        assert (s.scores - model.sequence_log_probs(src, lens, s.tokens, s.owner)).abs().max() > 1e-3


@pytest.fixture
def cuda_autocast_policy():
    """CUDA's autocast casts the fused LSTM cell (aten::lstm_cell: inputs, weights and c) to the autocast dtype;
    the CPU's leaves it to its parts (two products in bf16, c as it came). The CPU made to cast it as CUDA does."""
    lib = torch.library.Library("aten", "IMPL")

    def cast_cell(x, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        low = torch.get_autocast_dtype("cpu")
        cast = lambda t: t.to(low) if t is not None and t.is_floating_point() else t  # noqa: E731
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return torch.lstm_cell(cast(x), [cast(h) for h in hx], cast(w_ih), cast(w_hh), cast(b_ih), cast(b_hh))

    lib.impl("lstm_cell", cast_cell, "AutocastCPU")
    with torch.autocast(**BF16):
        assert torch.nn.LSTMCell(2, 2)(torch.ones(1, 2))[1].dtype == torch.bfloat16  # the policy is CUDA's
    yield
    lib._destroy()


@pytest.mark.parametrize("share", [True, False])
def test_phase_two_log_probs_equal_search_scores_under_cudas_autocast_policy(one_thread, cuda_autocast_policy,
                                                                             share):
    """Each row's phase-two log-probability (a one-hot coefficient), over the prefix tree or row by row, against
    its search score under bf16 autocast with CUDA's cast of the LSTM cell: the same arithmetic on the same
    inputs, float32 sums in another order, so 1e-5 (scores ~10; a cell computed in bf16 in one path only is
    ~4e-3 away)."""
    model, (src, lens) = _model(), toy_batch()
    with torch.autocast(**BF16):
        s = _candidates(model, src, lens, "beam")
        got = []
        for i in range(len(s)):
            one_hot = torch.zeros(len(s), dtype=torch.float64)
            one_hot[i] = 1
            got.append(rescore_backward(model, (src, lens), s, one_hot, chunk_size=len(s), prefix_sharing=share))
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), s.scores.double(), rtol=0, atol=1e-5)


def test_chunked_gradient_equals_one_piece_under_bf16(one_thread):
    """One chunk: the same bf16 products as one autograd pass, float32 sums in another order: 1e-5. Several
    chunks round each chunk's bf16 matmul outputs and its share of the encoder-side (bf16) activation gradients
    separately, sums of ~T*N terms whose coefficients cancel per source: measured up to 1.2e-2 (~6u) relative
    per parameter, so 3e-2 (~15u). A lost row or a mis-scaled coefficient moves a gradient by ~1/N ~ 8%."""
    model, (src, lens) = _model(), toy_batch()
    with torch.autocast(**BF16):
        s = _candidates(model, src, lens, "beam")
        c = objectives.beam(torch.rand(len(s), dtype=torch.float64, generator=torch.Generator().manual_seed(5)),
                            s.scores, s.owner, 3, tokens=s.tokens)
        model.zero_grad()
        with rnn_graph_mode(model):
            (c * model.sequence_log_probs(src, lens, s.tokens, s.owner)).sum().backward()
        want = [p.grad.clone() for p in model.parameters()]
        # The prefix tree (prefix_sharing) decodes nodes in batches of other shapes than the rows': its bf16 products
        # may round differently even in one chunk (measured 6e-3), so the several-chunk tolerance.
        for chunk, tol, share in ((len(s), 1e-5, False), (len(s), 3e-2, True), (5, 3e-2, False), (5, 3e-2, True),
                                  (1, 3e-2, True)):
            model.zero_grad()
            rescore_backward(model, (src, lens), s, c, chunk_size=chunk, prefix_sharing=share)
            for p, w in zip(model.parameters(), want):
                assert p.grad.dtype == torch.float32  # parameters' .grad stays float32
                assert _rel(p.grad, w) <= tol, (chunk, _rel(p.grad, w))


def _output_layer(h_dtype):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(9, 16, generator=g).to(h_dtype)
    weight, bias = torch.randn(11, 16, generator=g) / 2, torch.randn(11, generator=g)
    target = torch.randint(2, 11, (9,), generator=g)
    banned = torch.zeros(11, dtype=torch.bool)
    banned[[PAD, BOS]] = True
    return h, weight, bias, target, banned, torch.randn(9, generator=g)


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
def test_fused_output_layer_under_bf16_close_to_float32(h_dtype):
    """Logits from bf16 operands, then float32: log p and the gradients within ~2u of float32 (measured up
    to 3.6e-3 relative), so 1e-2. log p and the parameter gradients come in float32, d/dh in h's dtype. The
    autograd Function (forward and backward) gives the hand-written pass's numbers, even with its backward
    run outside autocast (amp_backward restores forward's state): else its matmuls would be float32."""
    h, weight, bias, target, banned, w = _output_layer(h_dtype)
    want = outputlayer.target_log_probs_and_grads(h.float(), weight, bias, target, banned, w)
    with torch.autocast(**BF16):
        got = outputlayer.target_log_probs_and_grads(h, weight, bias, target, banned, w)
        leaves = [x.clone().requires_grad_() for x in (h, weight, bias)]
        tok = outputlayer.target_log_probs(*leaves, target, banned)
    auto = [tok] + list(torch.autograd.grad(tok, leaves, w))  # backward outside autocast
    assert [x.dtype for x in got] == [torch.float32, h_dtype, torch.float32, torch.float32]
    for a, b, c in zip(got, want, auto):
        assert _rel(a, b) <= 1e-2
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)


def test_bf16_is_refused_where_a_gpu_only_emulates_it(monkeypatch):
    """A T4 or V100: `is_bf16_supported()` says True (emulation counted), without emulation False."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    with pytest.raises(ValueError, match=r"^--amp bf16: Tesla T4 has no native bfloat16 .*use --amp fp16$"):
        amp.check_device("bf16", torch.device("cuda", 0))
    amp.check_device("fp16", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100
    amp.check_device("bf16", torch.device("cuda", 0))


def test_scale_coefficients_and_bad_step_rule():
    c = torch.tensor([0.5, -0.25], dtype=torch.float64)
    assert amp.scale_coefficients(c, None) == (c, 1.0)
    scaled, scale = amp.scale_coefficients(c, torch.amp.GradScaler("cpu", init_scale=8.0))
    assert scale == 8.0 and torch.equal(scaled, 8 * c) and scaled.dtype == torch.float64
    assert amp.counts_as_bad(1.0, None) and amp.counts_as_bad(math.inf, 8.0) and amp.counts_as_bad(1.0, 0.5)
    assert not amp.counts_as_bad(1.0, 8.0)  # the scale backs off instead


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 60, 6)


def _trainer(task, save, **overrides):
    return recipe.setup(Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=16,
                            embed_dim=8, batch_size=4, mle_batch_size=8, beam_size=3, rescore_chunk=5, max_len=8,
                            save_dir=str(save), **overrides))


def test_loss_scaling_in_the_trainer(task, tmp_path, monkeypatch, one_thread):
    """fp16's GradScaler logic on CPU (a CPU scaler injected; power-of-two scales are exact in float32): same
    loss and clipped norm as unscaled, an overflow skips the step and halves the scale without counting as a
    bad step, good steps grow it, and the scale survives a weights-only checkpoint."""
    plain, scaled = _trainer(task, tmp_path / "a"), _trainer(task, tmp_path / "b")
    scaled.trainer.parts.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    rows = [t.train_step("mle") for t in (plain, scaled)]
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)
    assert rows[1]["grad_norm"] == pytest.approx(rows[0]["grad_norm"], rel=1e-5)
    assert scaled.trainer.parts.scaler.get_scale() == 2.0**11  # a good step with growth_interval 1
    before = {k: v.clone() for k, v in scaled.trainer.model.state_dict().items()}
    real = parts_module.rescore_backward

    def overflowing(*args, **kwargs):
        loss = real(*args, **kwargs)
        next(scaled.trainer.model.parameters()).grad.view(-1)[0] = math.inf
        return loss

    monkeypatch.setattr(parts_module, "rescore_backward", overflowing)
    assert scaled.train_step("mle")["skipped"] == 1
    assert scaled.trainer.parts.scaler.get_scale() == 2.0**10 and scaled.state.bad_in_a_row == 0
    assert all(torch.equal(v, before[k]) for k, v in scaled.trainer.model.state_dict().items())
    save_atomic(scaled.state_dict(), tmp_path / "ck.pt")
    resumed = _trainer(task, tmp_path / "c")
    resumed.trainer.parts.scaler = torch.amp.GradScaler("cpu")
    resumed.load_state_dict(load(tmp_path / "ck.pt"))  # weights_only=True
    assert resumed.trainer.parts.scaler.get_scale() == 2.0**10


def test_train_with_amp_bf16_finishes_with_finite_losses(task, tmp_path, one_thread):
    argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(tmp_path),
            "--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8",
            "--beam-size", "3", "--rescore-chunk", "5", "--max-len", "8", "--mle-steps", "3", "--rl-steps", "3",
            "--amp", "bf16"]
    assert cli.main(argv) == 0
    state = load(tmp_path / "checkpoint_last.pt")
    assert state["step"] == 6 and state["config"]["amp"] == "bf16" and "scaler" not in state
    stats = state["stats"]
    assert stats["mle"]["skipped"] == stats["rl"]["skipped"] == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows if r["phase"] != "eval")
    assert all(p.dtype == torch.float32 for p in state["model"].values())


def test_sixteen_bit_boundary_gradients_are_summed_in_float32():
    """Each chunk's bf16 share of an encoder-output gradient moves into a float32 sum: 1 + 300 x 2^-9 stays
    1.5859375 there, where bf16 additions would stay at 1 (ulp 2^-7 at 1: every 2^-9 increment rounds away)."""
    from twophase.models.seq2seq import Encoded
    from twophase.phase2.rescoring import _bank_boundary_grads

    leaf = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    boundary = Encoded(memory=leaf, keys=torch.zeros(1), mask=torch.ones(1, dtype=torch.bool), h0=torch.zeros(1),
                       c0=torch.zeros(1))
    sums = {}
    leaf.grad = torch.ones(3, dtype=torch.bfloat16)
    _bank_boundary_grads(boundary, sums)
    for _ in range(300):
        leaf.grad = torch.full((3,), 2.0**-9, dtype=torch.bfloat16)
        _bank_boundary_grads(boundary, sums)
    assert leaf.grad is None and sums[0].dtype == torch.float32
    assert sums[0].tolist() == [1 + 300 * 2.0**-9] * 3


# ---- a CPU whose oneDNN has no bf16 LSTM primitive (no AVX-512: an AVX2-only EPYC; ONEDNN_MAX_CPU_ISA=AVX2 makes
# any x86 CPU one)
def test_under_float32_rnns_a_recurrent_layer_computes_in_float32_and_autocast_stays_on_around_it():
    lstm, cell = torch.nn.LSTM(4, 3, batch_first=True), torch.nn.Linear(3, 2)
    x = torch.randn(2, 5, 4)
    hooks = (dict(torch.nn.modules.module._global_forward_pre_hooks),
             dict(torch.nn.modules.module._global_forward_hooks))
    hx = (torch.zeros(1, 2, 3, dtype=torch.bfloat16), torch.zeros(1, 2, 3, dtype=torch.bfloat16))
    packed = torch.nn.utils.rnn.pack_padded_sequence(x.bfloat16(), [5, 3], batch_first=True)
    with amp._float32_rnns("cpu", torch.bfloat16):
        out, (h, c) = lstm(x[:1].bfloat16())  # one row, unpacked: the case oneDNN refuses in bf16
        assert out.dtype == h.dtype == c.dtype == torch.float32
        assert lstm(packed, hx)[0].data.dtype == torch.float32
        assert torch.is_autocast_enabled("cpu") and cell(out).dtype == torch.bfloat16  # bf16 around it
        with pytest.raises(RuntimeError):
            lstm(torch.randn(1, 5, 7))  # a forward that raises still leaves autocast as it was
        assert torch.is_autocast_enabled("cpu")
        want, _ = lstm(x[:1].bfloat16().float())  # the same rounded input, in float32
    assert not torch.is_autocast_enabled("cpu")
    assert torch.equal(out, want)  # float32 through and through: the float32 layer's own output
    assert (torch.nn.modules.module._global_forward_pre_hooks, torch.nn.modules.module._global_forward_hooks) == hooks
    double = torch.nn.LSTM(4, 3).double()
    with amp._float32_rnns("cpu", torch.bfloat16):
        assert double(torch.randn(5, 1, 4, dtype=torch.float64))[0].dtype == torch.float64  # left alone


def _bf16_lstm_probe(env: dict) -> str:
    code = ("import torch\n"
            "from twophase.system import amp\n"
            "lstm = torch.nn.LSTM(4, 3, batch_first=True)\n"
            "try:\n"
            "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
            "        lstm(torch.randn(1, 5, 4))\n"
            "    plain = 'runs'\n"
            "except RuntimeError as err:\n"
            "    plain = 'refused' if 'primitive' in str(err) else repr(err)\n"
            "with amp.autocast('bf16', torch.device('cpu')):\n"
            "    out = lstm(torch.randn(1, 5, 4))[0]\n"
            "print(plain, amp.rnns_in_float32('bf16', torch.device('cpu')), out.dtype)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_amp_bf16_finds_whether_onednn_has_a_bf16_lstm_and_runs_it_in_float32_where_not():
    """With oneDNN limited to AVX2 the plain bf16 LSTM is refused ("could not create a primitive descriptor");
    twophase's autocast finds that and runs the layer in float32. Where the limit does not reproduce the refusal
    (another oneDNN), the probe says so and the layer runs in bf16."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", PYTHONPATH=str(ROOT))
    plain, in_float32, dtype = _bf16_lstm_probe(env)
    assert plain in ("refused", "runs")
    assert in_float32 == str(plain == "refused") and dtype == ("torch.float32" if plain == "refused" else dtype)


def test_train_with_amp_bf16_batch_size_1_on_a_cpu_without_a_bf16_lstm(task, tmp_path):
    """A batch of one source (the unpacked LSTM path) at every step under --amp bf16 with oneDNN limited to
    AVX2: the run trains (the LSTM in float32), never a oneDNN traceback."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(tmp_path),
            "--hidden-size", "8", "--embed-dim", "4", "--batch-size", "1", "--mle-batch-size", "1",
            "--beam-size", "2", "--rescore-chunk", "3", "--max-len", "8", "--mle-steps", "2", "--rl-steps", "2",
            "--eval-beam", "1", "--no-compare-mle", "--amp", "bf16"]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert load(tmp_path / "checkpoint_last.pt")["step"] == 4
