"""Section (e): phase one (`twophase.sample`, `twophase.beam_search`) against Hugging Face `generate` on the
device, on `benchmarks.decode`'s models and terms (`benchmarks.hf`'s random-weight T5 and Llama-style causal LM;
a fixed number of new tokens; a decode step's cost the slope between a short and a long run).

Per model and search: median wall seconds of each method at T0 and T new tokens (synchronised), ms per decode
step, and the host syncs per decode step of each over one run of T tokens (`count_host_syncs`; on CUDA also
CUDA's own count, `count_cuda_syncs`). twophase's
sampler draws from a generator on the model's device.
"""
from __future__ import annotations

import statistics

import torch

from twophase.phase1.search import sample
from .. import hf
from ..decode import SHORT, generate, twophase
from .common import one_line, syncs_counted, timed

QUICK = dict(batch=2, samples=2, prompt=6, completion=6, width=16, layers=1, heads=2, vocab=40)
FULL = dict(batch=8, samples=16, prompt=64, completion=32)
ROUNDS = {"full": 3, "quick": 1}


def build(cell: dict, device: torch.device):
    wrapper, source = hf.build(cell)
    return wrapper.to(device), {k: v.to(device) for k, v in source.items()}


def ours(wrapper, source, K: int, T: int, seed: int, search: str):
    if search == "beam":
        return twophase(wrapper, source, K, T, seed, "beam")
    device = source["input_ids"].device
    return sample(wrapper, source, K, T, generator=torch.Generator(device).manual_seed(seed))


def compare(cell: dict, search: str, rounds: int, device: torch.device) -> dict:
    wrapper, source = build(cell, device)
    K, T = cell["samples"], cell["completion"]
    methods = {"twophase": ours, "generate": generate}
    out = {"model": cell["model"], "search": search}
    with torch.inference_mode():
        for name, fn in methods.items():
            try:
                fn(wrapper, source, K, SHORT, 0, search)  # warm-up
                times = {n: [timed(lambda: fn(wrapper, source, K, n, r, search), device)[1] for r in range(rounds)]
                         for n in (SHORT, T)}
                short, whole = (statistics.median(times[n]) for n in (SHORT, T))
                with syncs_counted(device) as (syncs, cuda):
                    fn(wrapper, source, K, T, 0, search)
                out[name] = {"whole_s": whole, "step_ms": 1e3 * (whole - short) / (T - SHORT),
                             "host_syncs_per_step": syncs.total / T,
                             "cuda_syncs_per_step": None if cuda is None else cuda.total / T}
            except Exception as err:  # noqa: BLE001 (the other method still runs)
                out[name] = {"error": one_line(err)}
    if "whole_s" in out["twophase"] and "whole_s" in out["generate"]:
        out["ratio_twophase_over_generate"] = {
            k: out["twophase"][k] / max(out["generate"][k], 1e-12) for k in ("whole_s", "step_ms")}
    return out


def run(options: dict) -> dict:
    device = torch.device(options["device"])
    quick = options["quick"]
    cell = dict(hf.DEFAULTS, **(QUICK if quick else FULL))
    rounds = ROUNDS["quick" if quick else "full"]
    results = []
    for model in hf.MODELS:
        for search in ("sample", "beam"):
            try:
                results.append(compare(dict(cell, model=model), search, rounds, device))
            except Exception as err:  # noqa: BLE001 (a model that cannot be built: one row)
                results.append({"model": model, "search": search, "error": one_line(err)})
    return {"config": cell, "short_tokens": SHORT, "rounds": rounds, "results": results}
