"""Section (d): one RL step of the LSTM under autocast in bf16 and in fp16 (train.py's --amp, `system.amp`).

Phase one (beam search) and phase two (`rescore_backward`, fp16 with the loss scale carried by the coefficients as
the trainer does) both run under the same autocast. Reported per precision: whether the loss and every gradient are
finite (fp16's after unscaling), the gradient's relative distance from float32's on the same candidates, and how far
phase one's search scores are from phase two's log-probabilities of the same candidates, per sequence in nats:
through `rescore_backward` itself (a one-hot coefficient gives back one row's log p; a few rows) and through the
model's teacher-forced scorer (`protocol.score`, every row). The float32 row gives the scale of plain rounding.
Each precision's chunked gradient is also compared with the whole batch's in one chunk (`chunked_vs_whole_rel_diff`:
float32's is rounding; bf16's, the rounding of bf16 products summed in another grouping).

`recurrent_dtypes`: what the LSTM computed in (a forward hook on each recurrent layer, the dtypes of the fused RNN
operator the dispatcher ran), under twophase's autocast and under a plain `torch.autocast`: cuDNN's RNN autocast
path may compute in float16 whatever the autocast dtype, and oneDNN may have no bf16 LSTM at all; where either,
`amp.rnns_in_float32` is true and twophase runs the recurrent layers in float32 (`rnns_in_float32`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._python_dispatch import TorchDispatchMode

from twophase import protocol
from twophase.phase2.rescoring import rescore_backward
from twophase.phase1.search import beam_search
from twophase.system import amp
from .common import cudnn_retry, grads, one_line, relative_error, seed_lstm

FULL = dict(batch=4, beam=16, src_len=30, max_len=30, hidden=512, embed=256, vocab=10000, src_vocab=1000, chunk=32)
QUICK = dict(batch=2, beam=3, src_len=5, max_len=4, hidden=16, embed=8, vocab=30, src_vocab=20, chunk=4)
PROBED_ROWS = 4  # rows whose log p phase two gives back one by one


def step(model, source, sizes: dict, mode: str, device: torch.device) -> dict:
    """One step under --amp `mode`: its figures, its unscaled gradient against float32's on the same
    candidates and coefficients, and its chunked gradient against the whole batch's in one chunk (same mode)."""
    model.zero_grad(set_to_none=True)
    with amp.autocast(mode, device):
        with torch.no_grad():
            cand = beam_search(model, source, sizes["beam"], sizes["max_len"])
    g = torch.Generator().manual_seed(4)
    coefficients = (torch.rand(len(cand), generator=g) - 0.5).to(device)  # (N,)
    scaler = amp.grad_scaler(mode, device)
    scaled, scale = amp.scale_coefficients(coefficients, scaler)

    def backward(chunk: int):
        model.zero_grad(set_to_none=True)
        with amp.autocast(mode, device):
            loss = rescore_backward(model, source, cand, scaled, chunk) / scale
        for p in model.parameters():
            if p.grad is not None and scale != 1.0:
                p.grad.div_(scale)
        return loss, grads(model)

    loss, gradients = backward(sizes["chunk"])
    row = {"loss": loss, "loss_finite": bool(torch.isfinite(torch.tensor(loss))),
           "gradients_finite": all(bool(torch.isfinite(x).all()) for x in gradients if x is not None),
           "loss_scale": scale, "candidates": len(cand), "chunk": sizes["chunk"]}
    row["chunked_vs_whole_rel_diff"] = relative_error(gradients, backward(len(cand))[1])
    model.zero_grad(set_to_none=True)
    rescore_backward(model, source, cand, coefficients, sizes["chunk"])  # float32: no autocast
    row["grad_rel_diff_vs_float32"] = relative_error(gradients, grads(model))
    row.update(score_differences(model, source, cand, sizes, mode, device))
    model.zero_grad(set_to_none=True)
    return row


def rnn_dtypes(model, source, mode: str, device: torch.device) -> dict:
    """What the recurrent layers computed in under --amp `mode`, through twophase's autocast (`amp.autocast`,
    what training runs) and through a plain `torch.autocast` of the same dtype: each layer's output dtype (a
    forward hook on every nn.RNNBase and nn.RNNCellBase) and the input dtype of each recurrent operator the
    dispatcher ran below autocast (`_cudnn_rnn` on CUDA, oneDNN's `mkldnn_rnn_layer` on the CPU), over a short
    beam search (the encoder's nn.LSTM, the decoder's cell)."""
    out = {"rnns_in_float32": amp.rnns_in_float32(mode, device)}
    for label, context in (("twophase", lambda: amp.autocast(mode, device)),
                           ("torch_autocast", lambda: torch.autocast(device.type, dtype=amp.MODES[mode]))):
        layers, ops = {}, {}

        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            y = y.data if isinstance(y, PackedSequence) else y
            layers.setdefault(type(module).__name__, set()).add(str(y.dtype).removeprefix("torch."))

        class RecurrentOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if "rnn" in name or "lstm" in name or "gru" in name:
                    x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
                    if x is not None:
                        ops.setdefault(name, set()).add(str(x.dtype).removeprefix("torch."))
                return func(*args, **(kwargs or {}))

        handles = [m.register_forward_hook(hook) for m in model.modules()
                   if isinstance(m, (nn.RNNBase, nn.RNNCellBase))]
        try:
            with context(), torch.no_grad(), RecurrentOps():
                beam_search(model, source, 2, 2)
            out[label] = {"layers": {k: sorted(v) for k, v in layers.items()},
                          "operators": {k: sorted(v) for k, v in ops.items()}}
        except RuntimeError as err:  # plain autocast where the library has no kernel: that is the finding
            out[label] = {"error": one_line(err)}
        finally:
            for h in handles:
                h.remove()
    return out


def score_differences(model, source, cand, sizes: dict, mode: str, device: torch.device) -> dict:
    """|phase one's score - phase two's log p| per sequence: a few rows through rescore_backward (one-hot
    coefficients), every row through protocol.score; both under the same autocast as the search."""
    rows = min(PROBED_ROWS, len(cand))
    tree = []
    for i in range(rows):
        one_hot = torch.zeros(len(cand), device=device)
        one_hot[i] = 1.0
        with amp.autocast(mode, device):
            log_p = rescore_backward(model, source, cand, one_hot, sizes["chunk"])
        tree.append(abs(log_p - float(cand.scores[i])))
    model.zero_grad(set_to_none=True)
    with amp.autocast(mode, device), torch.no_grad(), protocol.eval_mode(model):
        scored = protocol.score(model, model.encode(source), cand.tokens, cand.owner).float()  # (N,)
    diff = (scored - cand.scores.float()).abs()  # (N,)
    return {"rescore_max_abs_diff_nats": max(tree), "rescore_rows": rows,
            "score_max_abs_diff_nats": float(diff.max()), "score_mean_abs_diff_nats": float(diff.mean())}


def measured(model, source, sizes: dict, mode: str, device: torch.device) -> dict:
    """step(), again with cuDNN off where cuDNN refuses the LSTM's backward in evaluation mode (then said)."""
    row, refusal = cudnn_retry(step, model, source, sizes, mode, device)
    return dict(row, cudnn_refused=refusal, cudnn="off") if refusal else row


def run(options: dict) -> dict:
    device = torch.device(options["device"])
    sizes = QUICK if options["quick"] else FULL
    model, _, source = seed_lstm(sizes, device)
    out = {"config": sizes, "float32": measured(model, source, sizes, "off", device)}
    for mode in ("bf16", "fp16"):
        try:
            amp.check_device(mode, device)
        except ValueError as why:
            out[mode] = {"skipped": str(why)}
            continue
        try:
            out[mode] = measured(model, source, sizes, mode, device)
        except Exception as err:  # noqa: BLE001 (the other precision still runs)
            out[mode] = {"error": one_line(err)}
        out[mode]["recurrent_dtypes"] = rnn_dtypes(model, source, mode, device)
    return out
