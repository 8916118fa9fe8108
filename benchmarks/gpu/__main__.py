"""The GPU check in one command: does twophase do on this accelerator what its tests show on the CPU?

    python -m benchmarks.gpu                           # every section on the GPU, within 8 minutes; gpu_report.json
    python -m benchmarks.gpu --device cpu --quick      # a dry run of every section at toy sizes (CI)
    python -m benchmarks.gpu --sections a,c            # some sections only
    python -m benchmarks.gpu --fetch-wheels wheels/       # on a machine with network: what the GPU machine lacks

Sections (docs/gpu.md says what each figure means and what good values look like):
    (a) chunked = whole-batch gradient, float32, default and deterministic algorithms, repeated runs bitwise
    (b) the seed's setting, two-phase against one-phase: max_memory_allocated / reserved, step time, host syncs
    (c) OOM halving in phase two, forced under a small memory budget: the chunk sizes tried
    (d) a bf16 and an fp16 step: finite loss and gradients, phase one's scores against phase two's log-probs
    (e) phase one against Hugging Face `generate`
    (f) with 2+ GPUs: torchrun over NCCL, data-parallel and --fsdp, 2 processes = 1
    (g) the largest beam K that fits a 32 GiB card, two-phase and one-phase, at the seed's setting
    (h) train.py --task karel --preset karel-paper for half a minute: steps per second, the paper's schedule sized
Each section runs in a fresh process with a time limit, all of them within one time budget (--budget: a section
the budget no longer covers is skipped, saying so); a failure is recorded with its one-line error and the rest go
on. One JSON report (its path printed: --out, else $OUT/gpu_report.json where $OUT is set, else
./gpu_report.json) is rewritten after every section, so a run killed at any point leaves every finished section.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from twophase.config import parse_size
from .common import prepare_environment
from .runner import SECTIONS, run_all, worker
from .summary import summary

# seconds per section at most; the Karel run last, its limit cut to what the budget leaves (its own data, ~45 s
# to generate on first use, before its steps)
LIMITS = {"full": dict(a=50, b=70, c=25, d=40, e=50, f=30, g=85, h=150),
          "quick": dict(a=150, b=90, c=60, d=90, e=90, f=60, g=90, h=90)}  # a loaded CI core
BUDGET_S = 460.0  # the whole run: 8 minutes with the start and the summary


def _sections(text: str) -> tuple[str, ...]:
    letters = tuple(x.strip() for x in text.split(",") if x.strip())
    if not letters or any(x not in SECTIONS for x in letters):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(SECTIONS)}, got {text!r}")
    return letters


def _seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto (cuda where available), cuda, cuda:N or cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes: a dry run of every section in seconds")
    p.add_argument("--sections", type=_sections, default=tuple(SECTIONS),
                   help=f"comma-separated letters ({','.join(SECTIONS)})")
    p.add_argument("--out", help="the report's path (default: $OUT/gpu_report.json, else ./gpu_report.json)")
    p.add_argument("--inline", action="store_true", help="run the sections in this process (no isolation)")
    p.add_argument("--memory-budget", type=parse_size, default=None,
                   help="(c): phase two's graph budget, as train.py's --memory-budget (default 256MiB; --quick 8KiB)")
    p.add_argument("--karel-seconds", type=_seconds, default=None,
                   help="(h): seconds train.py runs at most (default 30; --quick 60, though its run ends by itself)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads in each section (default: torch's own; 1 with --quick on the CPU)")
    p.add_argument("--limit", type=_seconds, default=None, help="seconds per section at most (default: per section)")
    p.add_argument("--budget", type=_seconds, default=None,
                   help=f"seconds for every section together (default {BUDGET_S:.0f}; --quick none); a section it no "
                        "longer covers is skipped")
    p.add_argument("--fetch-wheels", metavar="DIR", help="download the wheels the GPU machine lacks into DIR, then "
                   "exit (needs network; see docs/gpu.md)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: expected at least 1, got {args.threads}")
    if args.device != "auto":
        import torch
        try:
            torch.device(args.device)
        except RuntimeError:
            p.error(f"--device: expected auto, cpu, cuda or cuda:N, got {args.device!r}")
    return args


def report_path(out: str | None) -> Path:
    if out:
        return Path(out)
    return Path(os.environ["OUT"]) / "gpu_report.json" if os.environ.get("OUT") else Path("gpu_report.json")


def environment(device: str) -> dict:
    """What the report was measured on."""
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "device": device, "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "cpu_threads": torch.get_num_threads(), "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
        env["memory_gib"] = torch.cuda.get_device_properties(torch.device(device)).total_memory / 2 ** 30
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        prepare_environment()
        return worker(json.loads(args.worker))
    if args.fetch_wheels:
        from .wheels import fetch
        return fetch(Path(args.fetch_wheels))
    prepare_environment()  # before anything initialises CUDA
    from .common import resolve_device
    device = str(resolve_device(args.device))
    grid = "quick" if args.quick else "full"
    limits = {k: args.limit or v for k, v in LIMITS[grid].items()}
    budget = args.budget or (None if args.quick else BUDGET_S)
    options = {"device": device, "quick": args.quick,
               "memory_budget": args.memory_budget or (8 * 2 ** 10 if args.quick else 256 * 2 ** 20),
               "threads": args.threads or (1 if args.quick and device == "cpu" else None),
               "karel_seconds": args.karel_seconds or (60.0 if args.quick else 30.0)}
    path = report_path(args.out)
    print(f"twophase GPU check on {device} ({grid} sizes), sections {','.join(args.sections)}, budget "
          f"{f'{budget:.0f} s' if budget else 'none'}; report: {path}")
    start = time.perf_counter()
    report = {"environment": environment(device), "options": options, "limits_s": limits, "budget_s": budget,
              "complete": False, "sections": {}, "total_seconds": 0.0}

    def keep(outcomes: dict) -> None:
        report.update(sections=outcomes, total_seconds=round(time.perf_counter() - start, 1))
        write_report(report, path)

    keep({})  # the environment first: a run killed in its first section leaves where it ran
    run_all(args.sections, options, args.inline, limits, budget_s=budget, done=keep)
    report["complete"] = True
    keep(report["sections"])
    print("\n" + summary(report))
    print(f"\nreport written: {path}")
    return 0


def write_report(report: dict, path: Path) -> None:
    """The report as it stands, replacing the last one whole (written beside it, then renamed over it: a run
    killed while writing leaves the previous report, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(part, path)


if __name__ == "__main__":
    sys.exit(main())
