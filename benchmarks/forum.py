"""The forum post's model in phase two: `examples/forum_model.py` (twophase's attention blocks) against the same
model written the obvious way, each against a naive step, with sampled and with beam candidates.

    nice python -m benchmarks.forum                      # the targets' sizes: B 8, K 32, S 50, T 24, H 256, V 5k
    nice python -m benchmarks.forum --tiny               # seconds: a smoke run (tests)

`ObviousForumSeq2Seq` is `ForumSeq2Seq` (the same parameters) with the attention a user writes first: every row's
keys and values copied through owner at every step, and the tanh kept for backward.

A step is one RL gradient: K candidates per source (sampled, or a beam of K), REINFORCE coefficients with a
per-source mean baseline on a synthetic reward (uniform per candidate, fixed seed), and their gradient. EOS is
banned, so every candidate runs to T (the worst case for memory). Variants, per model and candidate kind:
    naive          the search with the graph of every step kept (`phase1.onephase`), then one backward
    accumulate b   the same over sub-batches of b sources, one backward each (exact with per-source baselines)
    chunk C        phase one without a graph, then `rescore_backward` in chunks of C rows (prefix tree)
    auto           the same with the chunk `--rescore-chunk auto` picks for a budget of a quarter of the obvious
                   model's naive activations (`system.profiling.ChunkPlanner`)
For each: the CPU time of a step (process time, the median of --repeats after a warm-up step; one thread) and its
peak tensor memory (`system.memory.AllocationPeak`, on a separate untimed step): `activations` is that peak less
the parameter-sized gradients the step creates; `phase two's` the same for `rescore_backward` alone (the search's
own transients left out). The gradients' agreement (two-phase against naive, float64) is
checked at a small size of the same models.

Letters: B sources, K candidates per source, S source length, T target length, H hidden, V vocabulary.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # forum_model, beside the checkout

import torch  # noqa: E402

import twophase  # noqa: E402
from forum_model import ForumSeq2Seq  # noqa: E402
from twophase.phase1.onephase import one_phase_backward, one_phase_search  # noqa: E402
from twophase.system.memory import AllocationPeak  # noqa: E402
from twophase.system.profiling import ChunkPlanner  # noqa: E402

from . import stepcost  # noqa: E402

TARGETS = dict(batch=8, samples=32, src_len=50, max_len=24, hidden=256, vocab=5000)
TINY = dict(batch=2, samples=4, src_len=6, max_len=4, hidden=16, vocab=40)
MB = 2**20


class ObviousForumSeq2Seq(ForumSeq2Seq):
    """ForumSeq2Seq with its attention written the obvious way (the same parameters)."""

    def attend(self, enc, owner, h):
        Uy, y, mask = enc["Uy"][owner], enc["y"][owner], enc["mask"][owner]  # (N, S, H) copies, (N, S)
        energy = self.v(torch.tanh(self.W(h)[:, None, :] + Uy)).squeeze(-1)  # (N, S): the tanh kept for backward
        alpha = torch.softmax(energy.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.bmm(alpha[:, None, :], y).squeeze(1)  # (N, H)


def models(sizes: dict, dtype=torch.float32) -> dict:
    """{"blocks": ForumSeq2Seq, "obvious": the same parameters in ObviousForumSeq2Seq}, EOS banned."""
    torch.manual_seed(0)
    blocks = ForumSeq2Seq(sizes["vocab"], sizes["vocab"], sizes["hidden"]).to(dtype)
    obvious = ObviousForumSeq2Seq(sizes["vocab"], sizes["vocab"], sizes["hidden"]).to(dtype)
    obvious.load_state_dict(blocks.state_dict())
    for model in (blocks, obvious):
        model.banned[model.eos_id] = True  # every candidate runs to T
    return {"blocks": blocks, "obvious": obvious}


def batch(sizes: dict):
    g = torch.Generator().manual_seed(1)
    B, S = sizes["batch"], sizes["src_len"]
    return torch.randint(3, sizes["vocab"], (B, S), generator=g), torch.full((B,), S)


def coefficients(s: twophase.Samples, first: int, B: int, K: int) -> torch.Tensor:
    """REINFORCE with a per-source mean baseline over all B sources, for the rows of sources first, first + 1...
    (the reward of a candidate: uniform, fixed by its source and rank)."""
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(B, K, generator=g, dtype=torch.float64)[first:first + len(s) // K].reshape(-1)
    return twophase.objectives.reinforce(rewards, s.owner, len(s) // K, baseline="mean") * (len(s) // K) / B


def search(model, source, kind: str, K: int, T: int, graph: bool):
    g = torch.Generator().manual_seed(3)
    if graph:
        return one_phase_search(model, source, kind, K, T, generator=g)
    if kind == "beam":
        return twophase.beam_search(model, source, K, T), None
    return twophase.sample(model, source, K, T, generator=g), None


def sub_batch(source, lo: int, hi: int):
    src, lengths = source
    return src[lo:hi], lengths[lo:hi]


def step_fn(model, source, kind: str, sizes: dict, variant: str, chunk: int | None = None, every: int | None = None):
    """One RL gradient of `variant` ("naive", "accumulate", "two-phase"), into the parameters' .grad."""
    B, K, T = sizes["batch"], sizes["samples"], sizes["max_len"]

    def naive():
        for lo in range(0, B, every or B):
            part = sub_batch(source, lo, min(B, lo + (every or B)))
            s, log_p = search(model, part, kind, K, T, graph=True)
            one_phase_backward(log_p, coefficients(s, lo, B, K))

    def two_phase():
        s, _ = search(model, source, kind, K, T, graph=False)
        twophase.rescore_backward(model, source, s, coefficients(s, 0, B, K), chunk_size=chunk)

    return two_phase if variant == "two-phase" else naive


def phase_two_peak(model, source, kind: str, sizes: dict, chunk: int) -> float:
    """Bytes of phase two's own peak (`rescore_backward` alone) less the parameter-sized gradients it creates."""
    s, _ = search(model, source, kind, sizes["samples"], sizes["max_len"], graph=False)
    c = coefficients(s, 0, sizes["batch"], sizes["samples"])
    model.zero_grad(set_to_none=True)
    with AllocationPeak() as peak:
        twophase.rescore_backward(model, source, s, c, chunk_size=chunk)
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes - _parameter_bytes(model)


def _parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(model, step, repeats: int) -> dict:
    """{"cpu_s", "peak_mb" (`stepcost.measure`), "activations_mb": the peak less the parameter-sized gradients}."""
    out = stepcost.measure(step, model, repeats)
    return {**out, "activations_mb": out["peak_mb"] - _parameter_bytes(model) / MB}


def planned_chunk(model, source, kind: str, sizes: dict, budget_bytes: float) -> int:
    s, _ = search(model, source, kind, sizes["samples"], sizes["max_len"], graph=False)
    return ChunkPlanner(int(budget_bytes)).chunk_size(model, source, s, coefficients(s, 0, sizes["batch"],
                                                                                       sizes["samples"]))


def gradient_agreement(sizes: dict) -> dict:
    """Largest |two-phase - naive| / max|naive| over all parameters, float64, per model and kind."""
    out = {}
    source = batch(sizes)
    for name, model in models(sizes, torch.float64).items():
        for kind in ("sample", "beam"):
            grads = []
            for variant, chunk in (("naive", None), ("two-phase", 3)):
                model.zero_grad(set_to_none=True)
                step_fn(model, source, kind, sizes, variant, chunk)()
                grads.append([p.grad.clone() for p in model.parameters()])
            scale = max(float(g.abs().max()) for g in grads[0])
            out[f"{name} {kind}"] = max(float((a - b).abs().max()) for a, b in zip(*grads)) / scale
    return out


def run(sizes: dict, chunks: tuple, accumulate: tuple, repeats: int, log=print) -> dict:
    torch.set_num_threads(1)
    source, rows = batch(sizes), []
    pair = models(sizes)
    for kind in ("sample", "beam"):
        for name in ("obvious", "blocks"):
            model = pair[name]
            variants = [("naive", None, None)] + [("accumulate", None, b) for b in accumulate] + \
                       [("two-phase", c, None) for c in chunks]
            for variant, chunk, every in variants:
                row = dict(model=name, kind=kind, variant=variant, chunk=chunk, every=every,
                           **measure(model, step_fn(model, source, kind, sizes, variant, chunk, every), repeats))
                if variant == "two-phase":
                    row["phase_two_mb"] = phase_two_peak(model, source, kind, sizes, chunk) / MB
                rows.append(row)
                log(json.dumps(row))
            naive_obvious = next(r for r in rows if r["kind"] == kind and r["model"] == "obvious"
                                 and r["variant"] == "naive")
            chunk = planned_chunk(model, source, kind, sizes, naive_obvious["activations_mb"] * MB / 4)
            row = dict(model=name, kind=kind, variant="auto", chunk=chunk, every=None,
                       **measure(model, step_fn(model, source, kind, sizes, "two-phase", chunk), repeats),
                       phase_two_mb=phase_two_peak(model, source, kind, sizes, chunk) / MB)
            rows.append(row)
            log(json.dumps(row))
    small = dict(TINY, vocab=50, hidden=12, src_len=7, max_len=5)
    return {"sizes": sizes, "rows": rows, "gradients": gradient_agreement(small)}


def table(report: dict) -> str:
    """The rows as a markdown table, per candidate kind and model: time against that model's naive step, memory."""
    lines = ["| candidates | model | variant | CPU s | x naive | peak MB | activations MB | phase two's MB |",
             "|---|---|---|---|---|---|---|---|"]
    naive = {(r["kind"], r["model"]): r["cpu_s"] for r in report["rows"] if r["variant"] == "naive"}
    for r in report["rows"]:
        variant = {"naive": "naive", "accumulate": f"accumulate {r['every']}", "two-phase": f"chunk {r['chunk']}",
                   "auto": f"auto (chunk {r['chunk']})"}[r["variant"]]
        phase_two = f"{r['phase_two_mb']:,.0f}" if "phase_two_mb" in r else ""
        lines.append(f"| {r['kind']} | {r['model']} | {variant} | {r['cpu_s']:.2f} | "
                     f"{r['cpu_s'] / naive[r['kind'], r['model']]:.2f} | {r['peak_mb']:,.0f} | "
                     f"{r['activations_mb']:,.0f} | {phase_two} |")
    return "\n".join(lines)


def targets(report: dict) -> list[str]:
    """The issue's targets read off the rows, one line each."""
    rows, lines = report["rows"], []

    def pick(**want):
        return [r for r in rows if all(r[k] == v for k, v in want.items())]
    for kind in ("sample", "beam"):
        naive_obvious = pick(model="obvious", kind=kind, variant="naive")[0]
        for chunk in sorted({r["chunk"] for r in pick(kind=kind, variant="two-phase")}):
            mine, theirs = pick(model="blocks", kind=kind, variant="two-phase", chunk=chunk)[0], \
                pick(model="obvious", kind=kind, variant="two-phase", chunk=chunk)[0]
            lines.append(f"{kind} chunk {chunk}: blocks / obvious activations "
                         f"{mine['activations_mb'] / theirs['activations_mb']:.2f} (the step), "
                         f"{mine['phase_two_mb'] / theirs['phase_two_mb']:.2f} (phase two)")
        limit = naive_obvious["peak_mb"] / 4
        for name in ("blocks", "obvious"):
            naive = pick(model=name, kind=kind, variant="naive")[0]
            fits = [r for r in pick(model=name, kind=kind) if r["variant"] in ("two-phase", "auto")
                    and r["peak_mb"] <= limit]
            if not fits:
                lines.append(f"{kind} {name}: no chunk within a quarter of the obvious naive peak ({limit:.0f} MB)")
                continue
            best = max(fits, key=lambda r: (r["chunk"], r["variant"] == "two-phase"))
            lines.append(f"{kind} {name}: chunk {best['chunk']} ({best['variant']}, peak {best['peak_mb']:.0f} MB "
                         f"<= {limit:.0f} MB): {best['cpu_s'] / naive['cpu_s']:.2f}x naive's time")
    lines += [f"gradients {k}: {v:.1e}" for k, v in report["gradients"].items()]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The forum model in phase two (see the module docstring).")
    p.add_argument("--tiny", action="store_true", help="a toy size in seconds")
    p.add_argument("--chunks", default="16,32,64,128,256", help="two-phase chunk sizes (rows)")
    p.add_argument("--accumulate", default="1,2", help="sub-batch sizes (sources) for gradient accumulation")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per variant (the median is reported)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    sizes = TINY if args.tiny else TARGETS
    report = run(sizes, tuple(int(x) for x in args.chunks.split(",")),
                 tuple(int(x) for x in args.accumulate.split(",")), args.repeats)
    print(table(report))
    for line in targets(report):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
