"""Section (a): phase two's chunked gradient against the whole batch's, on the device, in float32, with and without
deterministic algorithms.

For each model (the seed's LSTM, the pooled Karel model, the paper's Karel model, a tiny GPT-2 and a tiny T5), beam
search gives N candidates; fixed random coefficients c make the loss sum_i c_i log p(y_i | x_i). The reference is
one backward of that loss over all rows at once (`protocol.score`: the model's teacher-forced scorer, no chunks, no
prefix tree, no hand-written output layer); each case is `rescore_backward` in chunks of C rows, decoding through
the prefix tree ("tree", where the model shares prefixes) or row by row ("rows"), its chunks' gradients collected
before being added ("collect", the OOM-safe way CUDA defaults to) or added straight into .grad ("direct"). Every
case runs twice: `repeat_bitwise_equal` says whether the two gradients are the same bits, which deterministic
algorithms must make true on any device. Where cuDNN refuses an RNN's backward in evaluation mode, the model's rows
are measured again with cuDNN off and carry the refusal (`cudnn_refused`). TF32 is off throughout (cuDNN's
convolutions use it by default), so float32 means float32.
"""
from __future__ import annotations

import torch

from twophase import protocol
from twophase.phase1.search import beam_search
from twophase.phase2.rescoring import rescore_backward, shares_prefixes
from .common import (bitwise_equal, cudnn_retry, deterministic, full_float32, grads, one_line, relative_error,
                     seed_lstm, tiny_hf, tiny_hf_source)

SIZES = {  # per model; chunks: rows per chunk (N: the whole batch in one chunk)
    "full": dict(lstm=dict(batch=4, beam=8, src_len=12, max_len=12, hidden=256, embed=128, vocab=2000, src_vocab=200),
                 karel=dict(batch=4, beam=8, pairs=5, grid=8, hidden=128, embed=64, vocab=52, max_len=16),
                 hf=dict(batch=4, beam=4, prompt=10, max_len=8, width=64, layers=2, vocab=256), chunks=(1, 5)),
    "quick": dict(lstm=dict(batch=2, beam=3, src_len=5, max_len=4, hidden=12, embed=6, vocab=20, src_vocab=15),
                  karel=dict(batch=2, beam=2, pairs=2, grid=4, hidden=8, embed=6, vocab=12, max_len=4),
                  hf=dict(batch=2, beam=2, prompt=4, max_len=3, width=16, layers=1, vocab=24), chunks=(2,)),
}
MODELS = ("lstm", "karel", "karel-paper", "gpt2", "t5")


def build(name: str, sizes: dict, device: torch.device):
    """(model, source, K, T) of one model at the section's sizes, random weights, float32."""
    if name == "lstm":
        s = sizes["lstm"]
        model, _, source = seed_lstm(s, device)
        return model, source, s["beam"], s["max_len"]
    if name in ("karel", "karel-paper"):
        from twophase.models.karel import KarelModel
        from twophase.models.karel_paper import KarelPaperModel
        s = sizes["karel"]
        torch.manual_seed(0)
        R = C = s["grid"]
        if name == "karel":
            model = KarelModel(s["vocab"], R, C, embed_dim=s["embed"], hidden_size=s["hidden"], channels=(8, 8))
        else:
            model = KarelPaperModel(s["vocab"], R, C, embed_dim=s["embed"], hidden_size=s["hidden"], channels=8,
                                    blocks=1, pair_dim=s["hidden"], layers=2)
        g = torch.Generator().manual_seed(1)
        grids = (torch.rand(s["batch"], s["pairs"], 32, R, C, generator=g) < 0.2).float()  # (B, P, 32, R, C)
        return model.to(device).eval(), grids.to(device), s["beam"], s["max_len"]
    s = sizes["hf"]
    model = tiny_hf(name, device, vocab=s["vocab"], width=s["width"], layers=s["layers"])
    return model, tiny_hf_source(name, device, s["batch"], s["prompt"], s["vocab"]), s["beam"], s["max_len"]


def whole_batch_gradient(model, source, samples, coefficients) -> list:
    """The reference: one backward of sum_i c_i log p_i over every row, the model's own teacher-forced scorer."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad(), protocol.scoring_mode(model):
        log_p = protocol.score(model, model.encode(source), samples.tokens, samples.owner)  # (N,)
        (coefficients.to(log_p.dtype) * log_p).sum().backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def chunked_gradient(model, source, samples, coefficients, chunk: int, tree: bool, collect: bool) -> list:
    model.zero_grad(set_to_none=True)
    rescore_backward(model, source, samples, coefficients, chunk, oom_retry=collect, prefix_sharing=tree)
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def model_rows(name: str, sizes: dict, device: torch.device, setting: str) -> list[dict]:
    """One model's rows under one setting ('default' or 'deterministic'): the reference's repeat, then every
    (mode, chunk) case's error against it and its repeat. A failing case is a row with its one-line error."""
    with deterministic(setting == "deterministic"), full_float32():
        model, source, K, T = build(name, sizes, device)
        with torch.no_grad():
            samples = beam_search(model, source, K, T)
        N = len(samples)
        g = torch.Generator().manual_seed(2)
        coefficients = (0.5 + torch.rand(N, generator=g)).to(device)  # (N,) positive: no cancelling to zero
        reference = whole_batch_gradient(model, source, samples, coefficients)
        again = whole_batch_gradient(model, source, samples, coefficients)
        rows = [dict(model=name, setting=setting, mode="whole-batch", chunk=N, rows=N,
                     repeat_bitwise_equal=bitwise_equal(reference, again))]
        modes = [("tree", True), ("rows", False)] if shares_prefixes(model) else [("rows", False)]
        for mode, tree in modes:
            for collect in (True, False):
                for chunk in sorted({*sizes["chunks"], N}):
                    row = dict(model=name, setting=setting, mode=f"{mode}/{'collect' if collect else 'direct'}",
                               chunk=chunk, rows=N)
                    try:
                        first = chunked_gradient(model, source, samples, coefficients, chunk, tree, collect)
                        second = chunked_gradient(model, source, samples, coefficients, chunk, tree, collect)
                        row.update(rel_error=relative_error(first, reference),
                                   repeat_bitwise_equal=bitwise_equal(first, second))
                    except Exception as err:  # noqa: BLE001 (the report records each failure and goes on)
                        row["error"] = one_line(err)
                    rows.append(row)
        return rows


def run(options: dict) -> dict:
    device = torch.device(options["device"])
    sizes = SIZES["quick" if options["quick"] else "full"]
    rows = []
    for setting in ("default", "deterministic"):
        for name in MODELS:
            try:
                found, refusal = cudnn_retry(model_rows, name, sizes, device, setting)
                rows.extend(dict(r, cudnn_refused=refusal) if refusal else r for r in found)
            except Exception as err:  # noqa: BLE001 (a model that cannot even search or score: one row)
                rows.append(dict(model=name, setting=setting, mode="setup", error=one_line(err)))
    errors = [r["rel_error"] for r in rows if "rel_error" in r]
    worst = {}
    for r in rows:
        if "rel_error" in r:
            key = f"{r['model']}/{r['setting']}"
            worst[key] = max(worst.get(key, 0.0), r["rel_error"])
    determ = [r["repeat_bitwise_equal"] for r in rows if r["setting"] == "deterministic" and
              "repeat_bitwise_equal" in r]
    return {"dtype": "float32", "rows": rows, "max_rel_error": max(errors) if errors else None,
            "max_rel_error_by_model": worst,
            "cudnn_refused": sorted({r["model"] for r in rows if r.get("cudnn_refused")}),
            "deterministic_repeats_bitwise_equal": all(determ) if determ else None,
            "failed_cases": sum("error" in r for r in rows)}
