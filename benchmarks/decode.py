"""Benchmark: twophase's phase one (`twophase.sample`) against Hugging Face `generate` on the same model, whole
and per decode step.

    python -m benchmarks.decode                                # the HF bench's T5 and causal LM (benchmarks.hf)
    python -m benchmarks.decode --config batch=4 samples=8 completion=32 --rounds 5
    python -m benchmarks.decode --search beam               # beam search, K beams, against generate's

Both sample K completions per prompt from the full distribution (temperature 1, no top-k / top-p) for a fixed
number of new tokens: random weights over V words end a row with eos about once in V draws, and both run every
row through every step anyway. `--search beam`: both keep the K best of K*V extensions per source each step
(`generate` with num_beams=K, no length penalty, no early stop). `generate` gets `num_return_sequences=K`, so it
prefills (causal) the B*K rows where twophase prefills the B prompts once; both encode (T5) B sources. A decode
step's cost is the slope between a short and a long run, (time(T) - time(T0)) / (T - T0); what is left at T0 is
the prefill.

Timing on a shared machine: one process, one thread, the methods alternated within each round (order swapped
every round), the median of the rounds; the ratios twophase / generate are the figures to read.

`--compile BACKEND` adds a third method, twophase's search through `twophase.compiled(wrapper, BACKEND)` (phase
one's decode step through torch.compile); its compiling happens in the warm-up, reported apart (wall seconds,
graphs compiled), and the ratios then read compiled / eager as well.

Letters: B prompts, K samples per prompt, N = B*K rows, P prompt length, T new tokens, T0 the short run's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from twophase.compiling import compiled
from twophase.phase1.search import beam_search, sample
from . import hf

SHORT = 4  # T0: new tokens of the short run


def generate(wrapper, source: dict, K: int, T: int, seed: int, search: str = "sample"):
    """`generate`'s sampling of K completions per prompt (or its beam search of K beams), T new tokens (no
    early stop on eos)."""
    torch.manual_seed(seed)
    how = (dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0) if search == "sample" else
           dict(do_sample=False, num_beams=K, length_penalty=0.0, early_stopping=False))
    return wrapper.model.generate(
        input_ids=source["input_ids"], attention_mask=source["attention_mask"], num_return_sequences=K,
        max_new_tokens=T, eos_token_id=wrapper.eos_id, pad_token_id=wrapper.pad_id, **how)


def twophase(wrapper, source: dict, K: int, T: int, seed: int, search: str = "sample"):
    if search == "beam":
        return beam_search(wrapper, source, K, T)
    return sample(wrapper, source, K, T, generator=torch.Generator().manual_seed(seed))


METHODS = {"twophase": twophase, "generate": generate}
SEARCHES = ("sample", "beam")


def compare(cell: dict, rounds: int, search: str = "sample", backend: str | None = None) -> dict:
    """Median seconds per method at T0 and T new tokens, alternated round by round, and their per-step slope."""
    torch.set_num_threads(cell["threads"])
    wrapper, source = hf.build(cell)
    K, T = cell["samples"], cell["completion"]
    methods = dict(METHODS)
    if backend is not None:  # --compile: the same search through the compiled decode step
        fast = compiled(wrapper, backend=backend)
        methods["compiled"] = lambda _, *args: twophase(fast, *args)
    times = {(m, n): [] for m in methods for n in (SHORT, T)}
    warm = {}
    with torch.inference_mode():
        for name, fn in methods.items():  # warm-up: allocator, lazy imports, compiling
            start = time.perf_counter()
            fn(wrapper, source, K, SHORT, 0, search)
            warm[name] = time.perf_counter() - start
        for r in range(rounds):
            order = list(methods) if r % 2 == 0 else list(methods)[::-1]
            for n in (SHORT, T):
                for name in order:
                    start = time.perf_counter()
                    methods[name](wrapper, source, K, n, r, search)
                    times[name, n].append(time.perf_counter() - start)
    out = {"model": cell["model"], "search": search}
    if backend is not None:
        out["compiling"] = {"warmup_s": warm["compiled"] - warm["twophase"], "graphs": fast.compiles,
                            "failure": fast.failure}
    for name in methods:
        short, whole = (statistics.median(times[name, n]) for n in (SHORT, T))
        out[name] = {"whole_s": whole, "step_ms": 1e3 * (whole - short) / (T - SHORT),
                     "prefill_s": short - SHORT * (whole - short) / (T - SHORT)}
    out["ratio"] = {k: out["twophase"][k] / out["generate"][k] for k in ("whole_s", "step_ms")}
    if backend is not None:
        out["compiled_ratio"] = {k: out["compiled"][k] / out["twophase"][k] for k in ("whole_s", "step_ms")}
    return out


def table(results: list[dict], cell: dict) -> str:
    lines = [f"B={cell['batch']} K={cell['samples']} P={cell['prompt']} T={cell['completion']} H={cell['width']} "
             f"L={cell['layers']} V={cell['vocab']}, {cell['threads']} thread(s), {SHORT} and "
             f"{cell['completion']} new tokens",
             "", "| model | search | method | whole s | per decode step ms | prefill + rest s |",
             "|---|---|---|---|---|---|"]
    for r in results:
        at = f"| {r['model']} | {r.get('search', 'sample')} |"
        for name in [m for m in (*METHODS, "compiled") if m in r]:
            m = r[name]
            lines.append(f"{at} {name} | {m['whole_s']:.2f} | {m['step_ms']:.1f} | {m['prefill_s']:.2f} |")
        lines.append(f"{at} twophase / generate | {r['ratio']['whole_s']:.2f} | {r['ratio']['step_ms']:.2f} | |")
        if "compiled" in r:
            c = r["compiling"]
            lines.append(f"{at} compiled / twophase | {r['compiled_ratio']['whole_s']:.2f} | "
                         f"{r['compiled_ratio']['step_ms']:.2f} | compiling {c['warmup_s']:.1f} s, "
                         f"{c['graphs']} graphs{', failed: ' + c['failure'] if c['failure'] else ''} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE", help=f"override sizes: "
                   f"{', '.join(hf.DEFAULTS)}")
    p.add_argument("--models", default=",".join(hf.MODELS), help="comma-separated subset of t5,causal")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per method (default 3)")
    p.add_argument("--search", default="sample", help="comma-separated subset of sample,beam (default sample)")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="also time the search through twophase.compiled with this torch.compile backend (inductor)")
    args = p.parse_args(argv)
    cell = hf.parse_args(["--config", *args.config] if args.config else []).sizes
    models = args.models.split(",")
    if not models or any(m not in hf.MODELS for m in models):
        p.error(f"--models: expected a comma-separated subset of {','.join(hf.MODELS)}, got {args.models!r}")
    searches = args.search.split(",")
    if not searches or any(x not in SEARCHES for x in searches):
        p.error(f"--search: expected a comma-separated subset of {','.join(SEARCHES)}, got {args.search!r}")
    if args.rounds < 1:
        p.error(f"--rounds: expected at least 1, got {args.rounds}")
    results = [compare(dict(cell, model=m), args.rounds, x, args.compile) for m in models for x in searches]
    print(table(results, cell))
    return 0


if __name__ == "__main__":
    sys.exit(main())
