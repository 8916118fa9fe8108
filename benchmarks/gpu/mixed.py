"""Section (d): one RL step of the LSTM under autocast in bf16 and in fp16 (train.py's --amp, `system.amp`).

Phase one (beam search) and phase two (`rescore_backward`, fp16 with the loss scale carried by the coefficients as
the trainer does) both run under the same autocast. Reported per precision: whether the loss and every gradient are
finite (fp16's after unscaling), the gradient's relative distance from float32's on the same candidates, and how far
phase one's search scores are from phase two's log-probabilities of the same candidates, per sequence in nats:
through `rescore_backward` itself (a one-hot coefficient gives back one row's log p; a few rows) and through the
model's teacher-forced scorer (`protocol.score`, every row). The float32 row gives the scale of plain rounding.
"""
from __future__ import annotations

import torch

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
    candidates and coefficients."""
    model.zero_grad(set_to_none=True)
    with amp.autocast(mode, device):
        with torch.no_grad():
            cand = beam_search(model, source, sizes["beam"], sizes["max_len"])
        g = torch.Generator().manual_seed(4)
        coefficients = (torch.rand(len(cand), generator=g) - 0.5).to(device)  # (N,)
        scaler = amp.grad_scaler(mode, device)
        scaled, scale = amp.scale_coefficients(coefficients, scaler)
        loss = rescore_backward(model, source, cand, scaled, sizes["chunk"]) / scale
    for p in model.parameters():
        if p.grad is not None and scale != 1.0:
            p.grad.div_(scale)
    gradients = grads(model)
    row = {"loss": loss, "loss_finite": bool(torch.isfinite(torch.tensor(loss))),
           "gradients_finite": all(bool(torch.isfinite(x).all()) for x in gradients if x is not None),
           "loss_scale": scale, "candidates": len(cand)}
    model.zero_grad(set_to_none=True)
    rescore_backward(model, source, cand, coefficients, sizes["chunk"])  # float32: no autocast
    row["grad_rel_diff_vs_float32"] = relative_error(gradients, grads(model))
    row.update(score_differences(model, source, cand, sizes, mode, device))
    model.zero_grad(set_to_none=True)
    return row


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
    with amp.autocast(mode, device), torch.no_grad(), protocol.scoring_mode(model):
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
    return out
