"""Benchmark: peak memory and step time of two-phase training against the one-phase baselines.

    python -m benchmarks --quick                # small grid: 2-4 minutes on 2 CPU cores
    python -m benchmarks --device cuda          # the full grid: the seed's configuration, beams 8..256
    python -m benchmarks --speed-only --steps 2       # only the speed target (B2 K32 T30 V10k H512)
    python -m benchmarks --vs-loop 5            # beam search against a bare loop of its arithmetic (bareloop.py)

Methods, on the same random-weight model and random sources:
    two-phase c=C  phase one in inference mode, then `rescore_backward` in chunks of C rows' worth of decoding
                   steps, each distinct (source, prefix) of the candidates decoded once (the default)
    two-phase-noshare c=C   the same with prefix_sharing=False: chunks of C rows, each from its first token
    one-phase      `onephase.one_phase_beam_search` (graph of the whole search) + one backward
    seed-style     the same with `SeedStyleSeq2Seq` (per-beam U y at every step, plain autograd ops)
A step = beam search + beam objective with a synthetic reward (uniform per candidate, fixed seed) + backward
+ Adam step. EOS is banned in every model here, so all candidates run to max_len (T = max_len): random weights
rarely emit it anyway, and it is the worst case for memory.

Every measurement runs in a fresh subprocess (`--worker JSON`), so each peak belongs to one configuration. Peak
memory is `torch.cuda.max_memory_allocated` above the memory allocated before the first step on a GPU; on CPU
the peak RSS (getrusage, after resetting the high-water mark) above the RSS before the first step. `graph` is
the peak of bytes saved for backward (`system.memory.SavedTensorMeter`). Two-phase cells also report the decoded
prefix-tree nodes against the candidates' token positions (nodes/positions: the fraction phase two decodes). A one-phase cell whose estimated memory
exceeds the cap is measured at fewer rows (smaller batch, then beam) and extrapolated linearly in N = B*K.

Letters: B sources, K beam size, N = B*K rows, S source length, T max length, H hidden, V vocabulary.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from twophase.config import parse_size

from . import checkout_env
from .bareloop import vs_loop
from .cell import run_cell
from .report import NOTE, describe_sizes, fmt_cell, label, markdown, plot

SEED_CONFIG = dict(batch=16, beam=64, src_len=50, max_len=50, hidden=512, embed=256, vocab=10000, src_vocab=1000)
SPEED_CONFIG = dict(SEED_CONFIG, batch=2, beam=32, max_len=30, chunk=64)
GRIDS = {  # name: (model/batch sizes, beam sizes, chunk sizes, warm-up steps, timed steps)
    "full": (SEED_CONFIG, (8, 32, 64, 128, 256), (16, 64, 256), 1, 3),
    "quick": (dict(SEED_CONFIG, batch=4, src_len=20, max_len=15, hidden=128, embed=64, vocab=2000),
              (8, 32, 64), (16, 64), 1, 2),
    "tiny": (dict(batch=2, src_len=5, max_len=4, hidden=16, embed=8, vocab=30, src_vocab=20), (2, 4), (4,), 1, 1),
}
SPEED_STEPS = {"full": (1, 3), "quick": (1, 2), "tiny": None}  # the speed target is skipped in the tiny grid


# ---------------------------------------------------------------- the grid, in the parent process
def estimate_bytes(cell: dict) -> float:
    """Rough bytes the one-phase graph keeps (V-sized log-softmax per row and step; seed-style adds its
    (S, A) tanh), with margin for transients: enough to decide whether a cell fits under the cap."""
    itemsize = 8 if cell.get("dtype") == "float64" else 4
    per_row_step = cell["vocab"] + 16 * cell["hidden"] + cell["src_len"]
    if cell["method"] == "seed-style":
        per_row_step += cell["src_len"] * cell["hidden"]
    return 1.5 * itemsize * cell["batch"] * cell["beam"] * cell["max_len"] * per_row_step


def _shrunk(cell: dict, rows: int) -> dict:
    """The cell with batch (then beam) reduced until batch * beam <= rows."""
    batch = max(1, min(cell["batch"], rows // cell["beam"]))
    beam = max(1, min(cell["beam"], rows // batch))
    return dict(cell, batch=batch, beam=beam)


def measure(cell: dict, inline: bool, timeout: float) -> dict:
    """run_cell in a fresh subprocess (or in this one when inline); failures become an `error` field."""
    if inline:
        return run_cell(cell)
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--worker", json.dumps(cell)],
                          capture_output=True, text=True, timeout=timeout, env=checkout_env())
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return dict(cell, error=tail)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_capped(cell: dict, cap: float, inline: bool, timeout: float) -> dict:
    """Measure the cell, or, when its estimate exceeds the cap, two smaller ones and extrapolate linearly."""
    if cell["method"] in TWO_PHASE or estimate_bytes(cell) <= cap:
        return measure(cell, inline, timeout)
    rows = cell["batch"] * cell["beam"]
    fit = max(1, int(rows * cap / (2 * estimate_bytes(cell))))
    small, smaller = _shrunk(cell, fit), _shrunk(cell, fit // 2)
    a, b = measure(small, inline, timeout), measure(dict(smaller, grad_check=False), inline, timeout)
    if "error" in a or "error" in b:
        return dict(cell, error=a.get("error") or b.get("error"), extrapolated=True)
    n1, n2 = a["batch"] * a["beam"], b["batch"] * b["beam"]
    out = dict(cell, extrapolated=True, measured_at=[a["batch"], a["beam"]], rows=rows, target_len=a["target_len"])
    for key in ("peak_mb", "alloc_mb", "graph_mb", "step_s"):
        slope = (a[key] - b[key]) / (n1 - n2) if n1 != n2 else a[key] / n1
        out[key] = a[key] + slope * (rows - n1)
    for key in ("grad_rel_diff", "grad_rel_diff_worst_tensor"):
        if key in a:
            out[key] = a[key]  # measured at the smaller size
    return out


TWO_PHASE = ("two-phase", "two-phase-noshare")
METHODS = TWO_PHASE + ("one-phase", "seed-style")


def methods(chunks, names=METHODS) -> list[tuple[str, int | None]]:
    return [(m, c) for m in names for c in (chunks if m in TWO_PHASE else (None,))]


def run_grid(base: dict, beams, chunks, cap: float, inline: bool, timeout: float, log=print,
             names=METHODS) -> list[dict]:
    cells = []
    for beam in beams:
        for method, chunk in methods(chunks, names):
            cell = dict(base, beam=beam, method=method, chunk=chunk, grad_check=method not in TWO_PHASE)
            if chunk is not None and any(base["batch"] * beam <= c < chunk for c in chunks):
                continue  # chunks at least as wide as all N rows are one and the same run
            result = measure_capped(cell, cap, inline, timeout)
            cells.append(result)
            log(f"  K={beam:<4} {label(method, chunk):<24} " + fmt_cell(result))
    return cells


def speed_target(base: dict, steps, cap: float, inline: bool, timeout: float, log=print) -> dict:
    """The speed target: two-phase (chunk 64), with and without prefix sharing, against one-phase and
    seed-style; ratios < 1 mean faster."""
    warmup, n = steps
    cells = {}
    for method in METHODS:
        cell = dict(base, method=method, chunk=base["chunk"] if method in TWO_PHASE else None, warmup=warmup,
                    steps=n, grad_check=method == "one-phase")
        cells[method] = measure_capped(cell, cap, inline, timeout)
        log(f"  {label(method, cell['chunk']):<24} " + fmt_cell(cells[method]))
    ratios = {}
    for mine, other in [(m, o) for m in TWO_PHASE for o in ("seed-style", "one-phase")] + [TWO_PHASE]:
        if "error" not in cells[other] and "error" not in cells[mine]:
            ratios[f"{mine}/{other}"] = cells[mine]["step_s"] / cells[other]["step_s"]
    return {"config": base, "cells": list(cells.values()), "time_ratios": ratios}


# ---------------------------------------------------------------- command line
def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or key not in (*SEED_CONFIG, "chunk", "dtype", "seed"):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY in {', '.join(SEED_CONFIG)}, chunk, dtype, "
                                         f"seed; got {text!r}")
    return key, value if key == "dtype" else int(value)


def _methods(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    if not names or any(n not in METHODS for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(METHODS)}, got {text!r}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small grid and the speed target: 2-4 minutes on 2 CPU cores, depending on what else runs")
    p.add_argument("--tiny", action="store_true", help="a toy grid in seconds (tests, smoke checks)")
    p.add_argument("--out", default="bench", help="directory for bench.md, bench.json, bench.png (default: bench/)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--config", nargs="+", type=_override, default=[], metavar="KEY=VALUE",
                   help="override grid sizes: batch, src_len, max_len, hidden, embed, vocab, src_vocab, dtype, seed")
    p.add_argument("--beams", type=lambda s: tuple(int(x) for x in s.split(",")), help="beam sizes, e.g. 8,32")
    p.add_argument("--chunks", type=lambda s: tuple(int(x) for x in s.split(",")), help="two-phase chunk sizes")
    p.add_argument("--steps", type=int, help="timed steps per configuration (median reported), speed target too")
    p.add_argument("--speed-only", action="store_true", help="measure the speed target only, no grid")
    p.add_argument("--methods", type=_methods, default=METHODS,
                   help=f"comma-separated grid methods (default: {','.join(METHODS)})")
    p.add_argument("--cpu-mem-cap", type=parse_size, default=16 * 2**30,
                   help="on CPU, one-phase cells estimated above this are extrapolated from smaller ones (16GiB)")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads per worker (default: torch's own; 1 with --quick/--tiny, which stays "
                        "steady on a shared machine)")
    p.add_argument("--no-speed", action="store_true", help="skip the speed-target configuration")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per configuration")
    p.add_argument("--inline", action="store_true", help="measure in this process (no per-configuration peak)")
    p.add_argument("--vs-loop", type=int, default=0, metavar="ROUNDS",
                   help="instead of the grid: the LSTM's beam search against a bare decoding loop of the same "
                        "arithmetic (bareloop.py) at the speed target's sizes (--tiny: the toy's; --config, "
                        "--beams' first, --threads apply; one thread by default), ROUNDS alternated rounds")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vs_loop < 0:
        p.error(f"--vs-loop: expected a number of rounds >= 1, got {args.vs_loop}")
    if args.speed_only and args.no_speed:
        p.error("--speed-only and --no-speed exclude each other")
    return args


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _cap(device: str, cpu_cap: int) -> float:
    if device == "cuda":
        return 0.8 * torch.cuda.get_device_properties(0).total_memory
    return cpu_cap


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_cell(json.loads(args.worker))))
        return 0
    if args.vs_loop:
        return search_vs_loop(args)
    grid = "tiny" if args.tiny else "quick" if args.quick else "full"
    sizes, beams, chunks, warmup, steps = GRIDS[grid]
    device = _device(args.device)
    overrides = dict(args.config)
    threads = args.threads if args.threads is not None else 0 if grid == "full" else 1
    base = dict(sizes, **overrides, device=device, dtype=overrides.get("dtype", "float32"), warmup=warmup,
                steps=args.steps or steps, seed=overrides.get("seed", 0), threads=threads)
    beams, chunks = args.beams or beams, args.chunks or chunks
    cap = _cap(device, args.cpu_mem_cap)
    print(f"{grid} grid on {device}: {describe_sizes(base)}; beams {beams}; "
          f"memory cap {cap / 2**30:.1f} GiB\n{NOTE}")
    report = {"meta": {"grid": grid, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "note": NOTE,
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cap_bytes": cap},
              "grid_config": base, "grid": [] if args.speed_only else run_grid(base, beams, chunks, cap, args.inline,
                                                                                 args.timeout, names=args.methods)}
    speed_steps = SPEED_STEPS[grid] or (1, 1)
    if (SPEED_STEPS[grid] or args.speed_only) and not args.no_speed:
        speed = dict(SPEED_CONFIG, **overrides, device=device, dtype=base["dtype"], seed=base["seed"], threads=threads)
        print("speed target:")
        steps = (speed_steps[0], args.steps or speed_steps[1])
        report["speed"] = speed_target(speed, steps, cap, args.inline, args.timeout)
    return write_report(report, Path(args.out))


def search_vs_loop(args) -> int:
    """--vs-loop: one configuration, both searches in this process; a line of figures and the JSON row."""
    sizes = dict(GRIDS["tiny"][0], beam=GRIDS["tiny"][1][0]) if args.tiny else dict(SPEED_CONFIG, chunk=None)
    overrides = dict(args.config)
    cell = dict(sizes, **overrides, device=_device(args.device), dtype=overrides.get("dtype", "float32"),
                seed=overrides.get("seed", 0), threads=1 if args.threads is None else args.threads)
    if args.beams:
        cell["beam"] = args.beams[0]
    row = vs_loop(cell, args.vs_loop)
    print(f"{describe_sizes(cell)}, median of {args.vs_loop} rounds: "
          f"beam_search {row['search_cpu_s']:.3f} s CPU ({row['search_wall_s']:.3f} s wall), bare loop "
          f"{row['loop_cpu_s']:.3f} s CPU ({row['loop_wall_s']:.3f} s wall): search / loop {row['cpu_ratio']:.2f}x "
          f"CPU, {row['wall_ratio']:.2f}x wall")
    print(json.dumps(row))
    return 0


def write_report(report: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    print("\n" + text)
    (out / "bench.md").write_text(text)
    (out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    if report["grid"] and plot(report["grid"], report["grid_config"], out / "bench.png"):
        print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
