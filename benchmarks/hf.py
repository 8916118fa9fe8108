"""Benchmark: a training step of Hugging Face models through twophase against the usual recipes.

    python -m benchmarks.hf                         # a T5 and a Llama-style causal LM, random weights (~15 min)
    python -m benchmarks.hf --config batch=8 samples=16 prompt=128 completion=64
    python -m benchmarks.hf --methods two-phase --vs-generate 3       # and phase one against `generate`

A step = K samples per source (`twophase.sample`), a REINFORCE coefficient per row (random rewards, mean
baseline, the GRPO shape), and the gradient of sum_i c_i log p(y_i | x_i). Methods:
    two-phase   phase one without a graph, then `rescore_backward` in chunks of C rows (`HFSeq2Seq`/`HFCausalLM`)
    one-phase   `one_phase_sample`: the graph of the whole generation kept, then one backward
    trl         phase one as two-phase, then TRL's recipe: per micro-batch of C rows one forward of the whole
                input (the causal LM: prompt + completion, logits of the completion only; T5: encoder + decoder),
                log-softmax, gather, backward; the prompt (source) is re-encoded for each of its K rows
    grpo-trainer  phase one as two-phase, then the real TRL `GRPOTrainer.compute_loss` (trl 1.16, causal LMs
                only; extra `bench`) per micro-batch of C rows, loss_type dr_grpo with the advantages that make its
                gradient the REINFORCE coefficients' (ratio 1, beta 0), no bf16 autocast, no gradient
                checkpointing: TRL's own forward (no position ids: Llama's rotary attention does not mind)
Every method runs in a fresh subprocess (`--worker JSON`), so each peak belongs to one method. `tensors` is the
peak of bytes held by tensors during a step (the profiler's allocation record, `memory.AllocationPeak`), `rss`
the process's peak resident set above its size before the first step. CPU only, float32, one thread by default
(steady on a shared machine; CPU seconds of the process are reported beside wall seconds).

Letters: B sources, K samples per source, N = B*K rows, C rows per chunk, P prompt (source) length, T completion
length, H width, L layers, V vocabulary.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from twophase import objectives
from twophase.phase1.onephase import one_phase_backward, one_phase_sample
from twophase.phase2.rescoring import rescore_backward
from twophase.phase1.search import sample
from twophase.system.memory import AllocationPeak, reset_rss_peak, rss_bytes
from . import checkout_env
from .peers import grpo_trainer, grpo_trainer_backward, trl_backward

DEFAULTS = dict(batch=8, samples=16, prompt=128, completion=64, width=256, layers=4, heads=4, vocab=8000,
                chunk=16, warmup=1, steps=2, seed=0, threads=1)
MODELS = ("t5", "causal")
TIMES = ("phase1_s", "phase2_s", "step_s", "phase2_cpu", "step_cpu")  # wall seconds; CPU seconds of the process
METHODS = ("two-phase", "one-phase", "trl")
CAUSAL_ONLY = ("grpo-trainer",)  # TRL's GRPOTrainer trains causal LMs


def build(cell: dict):
    """(wrapper, source): a random-weight model in evaluation mode and B random sources of P tokens, some
    shorter (a real batch is padded): right-padded for T5, left-padded for the causal LM (as TRL pads)."""
    import transformers as T
    from twophase.models.hf import HFCausalLM, HFSeq2Seq

    torch.manual_seed(cell["seed"])
    H, L, heads, V = cell["width"], cell["layers"], cell["heads"], cell["vocab"]
    if cell["model"] == "t5":
        model = T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=V, d_model=H, d_kv=H // heads, d_ff=4 * H, num_layers=L, num_heads=heads, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
        wrapper = HFSeq2Seq(model.eval())
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=V, hidden_size=H, intermediate_size=4 * H, num_hidden_layers=L, num_attention_heads=heads,
            num_key_value_heads=heads, max_position_embeddings=cell["prompt"] + cell["completion"] + 8,
            pad_token_id=0, eos_token_id=1, bos_token_id=2))
        wrapper = HFCausalLM(model.eval())
    B, P = cell["batch"], cell["prompt"]
    g = torch.Generator().manual_seed(cell["seed"])
    lengths = torch.randint(P // 2, P + 1, (B,), generator=g)  # (B,)
    lengths[0] = P
    at = torch.arange(P)[None, :]  # (1, P)
    mask = (at >= P - lengths[:, None]) if cell["model"] == "causal" else (at < lengths[:, None])  # (B, P)
    ids = torch.randint(3, V, (B, P), generator=g).masked_fill(~mask, 0)
    return wrapper, {"input_ids": ids, "attention_mask": mask.long()}


def coefficients(samples, B: int, seed: int) -> torch.Tensor:
    rewards = torch.rand(len(samples), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return objectives.reinforce(rewards, samples.owner, B, "mean")  # (N,)


def train_step(cell: dict, wrapper, source: dict, window=contextlib.nullcontext) -> dict:
    """One step of the cell's method; returns its phases' seconds and the candidates' mean length. `window()`
    is entered around each phase (an `AllocationPeak` when measuring memory)."""
    B, K, T = cell["batch"], cell["samples"], cell["completion"]
    wrapper.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(cell["seed"] + 1)
    start, start_cpu = time.perf_counter(), time.process_time()
    with window() as one:
        if cell["method"] == "one-phase":
            samples, log_p = one_phase_sample(wrapper, source, K, T, generator=g)
        else:
            samples = sample(wrapper, source, K, T, generator=g)
    mid, mid_cpu = time.perf_counter(), time.process_time()
    c = coefficients(samples, B, cell["seed"])
    with window() as two:
        if cell["method"] == "one-phase":
            one_phase_backward(log_p, c)
            del log_p
        elif cell["method"] == "two-phase":
            rescore_backward(wrapper, source, samples, c, cell["chunk"])
        elif cell["method"] == "grpo-trainer":
            grpo_trainer_backward(cell["_trainer"], wrapper, source, samples, c, cell["chunk"])
        else:
            trl_backward(wrapper, source, samples, c, cell["chunk"])
    end, end_cpu = time.perf_counter(), time.process_time()
    return {"phase1_s": mid - start, "phase2_s": end - mid, "step_s": end - start, "phase2_cpu": end_cpu - mid_cpu,
            "step_cpu": end_cpu - start_cpu,
            "mean_len": float(samples.lengths.double().mean()), "windows": (one, two)}


def run_cell(cell: dict) -> dict:
    """Warm-up and timed steps (median), peak RSS over all of them, then one step under the allocation
    profiler for the tensor peaks (it slows the step, so that step is not timed). A phase's tensor peak is
    measured above what the process held when the phase began; the step's is max(phase one's peak, what phase
    one left held + phase two's peak): the one-phase graph is held from phase one into phase two."""
    torch.set_num_threads(cell["threads"])
    wrapper, source = build(cell)
    if cell["method"] == "grpo-trainer":
        cell = dict(cell, _trainer=grpo_trainer(wrapper, cell))  # built once, outside the timed steps
    reset_rss_peak()
    base = rss_bytes()
    runs = [train_step(cell, wrapper, source) for _ in range(cell["warmup"] + cell["steps"])][cell["warmup"]:]
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    wrapper.zero_grad(set_to_none=True)
    one, two = train_step(cell, wrapper, source, AllocationPeak)["windows"]
    out = {key: statistics.median(r[key] for r in runs) for key in (*TIMES, "mean_len")}
    mib = 2**-20
    cell = {k: v for k, v in cell.items() if k != "_trainer"}
    return dict(cell, **out, rss_mb=max(0, rss_peak) * mib, phase1_mb=one.peak_bytes * mib,
                phase2_mb=two.peak_bytes * mib, tensors_mb=max(one.peak_bytes, one.end_bytes + two.peak_bytes) * mib,
                params_mb=sum(p.numel() * p.element_size() for p in wrapper.parameters()) * mib)


def measure(cell: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.hf", "--worker", json.dumps(cell)],
                          capture_output=True, text=True, timeout=timeout, env=checkout_env())
    if proc.returncode != 0:
        return dict(cell, error=(proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


FIGURES = (*TIMES, "phase1_mb", "phase2_mb", "tensors_mb", "rss_mb")


def measure_capped(cell: dict, max_rows: int, timeout: float) -> dict:
    """A one-phase cell of more than max_rows rows (its graph holds every step's key/value cache: gigabytes) is
    measured at two smaller batches b1 > b2 and extrapolated to the cell's B: memory along the line through both
    (it has a fixed part: parameters, gradients), times in proportion to b1's (the difference of two short,
    noisy times is no slope). Both measurements are kept in the cell; its figures are marked."""
    K, B = cell["samples"], cell["batch"]
    if cell["method"] != "one-phase" or B * K <= max_rows:
        return measure(cell, timeout)
    b1 = max(2, max_rows // K)
    a, b = measure(dict(cell, batch=b1), timeout), measure(dict(cell, batch=b1 // 2), timeout)
    if "error" in a or "error" in b:
        return dict(cell, error=a.get("error") or b.get("error"))
    out = dict(a, batch=B, extrapolated_from=[b1, b1 // 2], measured=[a, b])
    for k in FIGURES:
        out[k] = a[k] * B / b1 if k in TIMES else a[k] + (a[k] - b[k]) / (b1 - b1 // 2) * (B - b1)
    out["tensors_mb"] = max(out["tensors_mb"], out["phase1_mb"])  # a step's peak is at least phase one's
    return out


def table(cells: list[dict]) -> str:
    """Per model one row per method, then each figure's ratio two-phase / method."""
    lines = ["| model | method | phase one s | phase two s (CPU s) | step s (CPU s) | tensors MiB: phase one / "
             "phase two / step | RSS MiB | mean T |", "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for model in dict.fromkeys(c["model"] for c in cells):
        at = {c["method"]: c for c in cells if c["model"] == model}
        for method, c in at.items():
            if "error" in c:
                lines.append(f"| {model} | {method} | error: {c['error']} |||||")
                continue
            star = "*" if "extrapolated_from" in c else ""
            lines.append(f"| {model} | {method}{star} | {c['phase1_s']:.1f} "
                         f"| {c['phase2_s']:.1f} ({c['phase2_cpu']:.1f}) | {c['step_s']:.1f} ({c['step_cpu']:.1f}) "
                         f"| {c['phase1_mb']:.0f} / {c['phase2_mb']:.0f} / {c['tensors_mb']:.0f} | {c['rss_mb']:.0f} "
                         f"| {c['mean_len']:.1f} |")
        two = at.get("two-phase")
        for method, c in at.items():
            if method == "two-phase" or two is None or "error" in two or "error" in c:
                continue
            ratio = {k: two[k] / max(c[k], 1e-9) for k in ("phase2_s", "phase2_cpu", "step_s", "step_cpu", "phase2_mb",
                                                          "tensors_mb", "rss_mb")}
            star = "*" if "extrapolated_from" in c else ""
            r = [f"{v:.2f}" for v in ratio.values()]
            if method == "one-phase":  # its graph is built in phase one, its phase two a bare backward: no match
                r[0] = r[1] = r[4] = "-"
            ratios.append(f"| {model} | two-phase / {method}{star} | {r[0]} ({r[1]}) | {r[2]} ({r[3]}) | "
                          + " | ".join(r[4:]) + " |")
    lines += ["", "| model | ratio | phase two time (CPU) | step time (CPU) | phase two tensors | step tensors | RSS |",
              "|---|---|---|---|---|---|---|"]
    return "\n".join(lines + ratios)


def vs_generate(args) -> str:
    """`benchmarks.decode`'s table for the same sizes and models, run in its own process."""
    cmd = [sys.executable, "-m", "benchmarks.decode", "--models", ",".join(args.models),
           "--rounds", str(args.vs_generate)] + (["--config", *args.config] if args.config else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=checkout_env())
    if proc.returncode != 0:
        return "error: " + (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return proc.stdout.strip()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf", description=__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE",
                   help=f"override sizes: {', '.join(DEFAULTS)}")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of t5,causal")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated subset of two-phase,one-phase,trl,grpo-trainer (the real TRL "
                        "GRPOTrainer, causal only)")
    p.add_argument("--one-phase-rows", type=int, default=32, metavar="R",
                   help="one-phase cells of more than R rows are measured at two smaller batches and extrapolated "
                        "(memory linearly, times in proportion to the batch), marked * (default 32)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per method")
    p.add_argument("--out", help="also write the table (Markdown) and the cells (JSON) to OUT.md / OUT.json")
    p.add_argument("--vs-generate", type=int, default=0, metavar="ROUNDS",
                   help="also time phase one against transformers' generate (benchmarks.decode: whole and per "
                        "decode step), ROUNDS alternated rounds, in a subprocess (default 0: not run)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, allowed in (("models", MODELS), ("methods", METHODS + CAUSAL_ONLY)):
        chosen = getattr(args, name).split(",")
        if not chosen or any(x not in allowed for x in chosen):
            p.error(f"--{name}: expected a comma-separated subset of {','.join(allowed)}, got {getattr(args, name)!r}")
        setattr(args, name, chosen)
    sizes = dict(DEFAULTS)
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS or not value.isdigit():
            p.error(f"--config: expected KEY=INTEGER with KEY in {', '.join(DEFAULTS)}, got {item!r}")
        sizes[key] = int(value)
    args.sizes = sizes
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_cell(json.loads(args.worker))))
        return 0
    s = args.sizes
    print(f"B={s['batch']} K={s['samples']} P={s['prompt']} T={s['completion']} H={s['width']} L={s['layers']} "
          f"V={s['vocab']} C={s['chunk']}; {s['threads']} thread(s), median of {s['steps']} step(s)", flush=True)
    cells = []
    for model in args.models:
        for method in args.methods:
            if model != "causal" and method in CAUSAL_ONLY:
                continue
            cells.append(measure_capped(dict(s, model=model, method=method), args.one_phase_rows, args.timeout))
            print(f"  {model} {method}: " + json.dumps({k: cells[-1].get(k) for k in (
                "phase1_s", "phase2_s", "step_s", "tensors_mb", "rss_mb", "mean_len", "error")}), flush=True)
    text = table(cells)
    if any("extrapolated_from" in c for c in cells):
        text += "\n\n`*` one-phase measured at smaller batches (B = " + ", ".join(
            "/".join(map(str, c["extrapolated_from"])) for c in cells if "extrapolated_from" in c) + \
            "): memory extrapolated linearly in B, times in proportion to B."
    if args.vs_generate > 0:
        text += "\n\nPhase one against `generate` (`python -m benchmarks.decode`):\n\n" + vs_generate(args)
    print("\n" + text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(cells, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
