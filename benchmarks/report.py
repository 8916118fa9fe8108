"""Benchmark report: the Markdown tables and the PNG plot of `python -m benchmarks`."""
from __future__ import annotations

import math
import sys
from pathlib import Path


NOTE = ("Random weights, random sources and uniform random rewards; EOS banned so every candidate has T = max_len "
        "(the worst case). `*` = extrapolated linearly in rows from smaller batch/beam. Memory is measured above "
        "the process before its first step: peak = CUDA max_memory_allocated, or on the CPU the peak RSS; "
        "tensors = the peak of bytes held by tensors (on CUDA the same figure); graph = bytes saved for backward.")


def label(method: str, chunk) -> str:
    return f"{method} c={chunk}" if chunk is not None else method


def node_fraction(c: dict) -> str:
    """Phase two's decoded prefix-tree nodes per candidate token position, where the cell measured them."""
    return f"{c['nodes'] / c['positions']:.2f}" if c.get("positions") else "-"


def fmt_cell(c: dict) -> str:
    if "error" in c:
        return f"error: {c['error']}"
    star = "*" if c.get("extrapolated") else ""
    grad = f"  grad rel diff {c['grad_rel_diff']:.1e}" if "grad_rel_diff" in c else ""
    return (f"peak {c['peak_mb']:9.1f} MiB{star}  tensors {c.get('alloc_mb', float('nan')):9.1f} MiB{star}  "
            f"graph {c['graph_mb']:9.1f} MiB{star}  {c['step_s']:8.3f} s{star}{grad}")


def _value(c: dict | None, key: str, fmt: str) -> str:
    if c is None:
        return "-"
    if "error" in c:
        return "error"
    if key not in c:  # a report written before the figure existed
        return "-"
    return fmt.format(c[key]) + ("*" if c.get("extrapolated") else "")


def grid_markdown(cells: list[dict]) -> str:
    """One row per beam size; per method peak memory (graph bytes) and step time side by side."""
    cols = list(dict.fromkeys(label(c["method"], c["chunk"]) for c in cells))
    beams = sorted({c["beam"] for c in cells})
    at = {(c["beam"], label(c["method"], c["chunk"])): c for c in cells}
    lines = []
    for title, fmt in (("peak memory MiB / tensors MiB (graph MiB)", None), ("step time s (median)", "{:.3f}")):
        lines += [f"**{title}**", "", "| K | N | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
        for k in beams:
            row = []
            for col in cols:
                c = at.get((k, col))
                row.append(_value(c, "step_s", fmt) if fmt else
                           f"{_value(c, 'peak_mb', '{:.0f}')} / {_value(c, 'alloc_mb', '{:.0f}')} "
                           f"({_value(c, 'graph_mb', '{:.0f}')})")
            n = next(c["batch"] * k for c in cells if c["beam"] == k)
            lines.append(f"| {k} | {n} | " + " | ".join(row) + " |")
        lines.append("")
    fractions = [f"K={c['beam']} {label(c['method'], c['chunk'])}: {node_fraction(c)}" for c in cells
                 if c.get("positions")]
    if fractions:
        lines += ["phase two's decoded nodes / candidate token positions: " + "; ".join(fractions), ""]
    diffs = [f"K={c['beam']} {c['method']}: {c['grad_rel_diff']:.1e}" for c in cells if "grad_rel_diff" in c]
    lines.append("relative gradient difference |g - g_two-phase| / |g_two-phase| (all parameters) on the same "
                 "candidates: " + "; ".join(diffs))
    return "\n".join(lines)


def speed_markdown(speed: dict) -> str:
    lines = ["| method | peak MiB | tensors MiB | graph MiB | step s | nodes/positions |", "|---|---|---|---|---|---|"]
    for c in speed["cells"]:
        lines.append(f"| {label(c['method'], c['chunk'])} | {_value(c, 'peak_mb', '{:.0f}')} | "
                     f"{_value(c, 'alloc_mb', '{:.0f}')} | "
                     f"{_value(c, 'graph_mb', '{:.0f}')} | {_value(c, 'step_s', '{:.3f}')} | {node_fraction(c)} |")
    lines.append("")
    lines.append("time ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in speed["time_ratios"].items()))
    return "\n".join(lines)


def describe_sizes(cfg: dict) -> str:
    return ", ".join(f"{k} {cfg[k]}" for k in ("batch", "beam", "src_len", "max_len", "hidden", "vocab", "chunk",
                                                 "dtype", "device", "threads") if cfg.get(k) is not None)


def markdown(report: dict) -> str:
    meta = report["meta"]
    out = [f"# twophase bench ({meta['grid']} grid, {meta['device']}, torch {meta['torch']})", "", NOTE]
    if report["grid"]:
        out += ["", f"## Beam sizes ({describe_sizes(report['grid_config'])}; beam varies)", "",
                grid_markdown(report["grid"])]
    if report.get("speed"):
        out += ["", f"## Speed target ({describe_sizes(report['speed']['config'])})", "", speed_markdown(report["speed"])]
    return "\n".join(out) + "\n"


def _ticks(low: float, high: float) -> list[float]:
    """Round values for a log axis from low to high: 1-2-5 per decade, or every digit where that gives fewer
    than three (a narrow range), so every label is a plain number."""
    if low <= 0 or high <= 0:
        return []
    decades = range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
    for digits in ((1, 2, 5), range(1, 10)):
        ticks = [d * 10.0**e for e in decades for d in digits if low <= d * 10.0**e <= high]
        if len(ticks) >= 3:
            return ticks
    return ticks


def _plain(value: float, _position=None) -> str:
    """40 and 0.2, not 4×10^1 and 2×10^-1; thousands grouped (10,000)."""
    return f"{value:,.0f}" if value >= 1 else f"{value:.3g}"


def _log_axis(ax, values: list[float]) -> None:
    """A log y axis labelled with plain numbers (matplotlib's default writes minor ticks as 4×10^1); linear where a
    toy grid measured 0."""
    import matplotlib.ticker as mticker

    if not values or min(values) <= 0:
        ax.set_yscale("linear")
        return
    ax.set_yscale("log")
    low, high = min(values), max(values)
    ticks = _ticks(low / 1.15, high * 1.15) or [low, high]
    ax.set_yticks(ticks)
    ax.yaxis.set_major_formatter(mticker.FuncFormatter(_plain))
    ax.yaxis.set_minor_formatter(mticker.NullFormatter())


def plot(cells: list[dict], config: dict, path: Path) -> bool:
    """Peak memory (on the CPU: resident set and tensors side by side) and step time against beam size, one line
    per method; hollow markers are extrapolated."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker as mticker

    # On CUDA the peak is the allocator's and equals the tensor peak: one memory panel says it all.
    panels = [("peak_mb", "peak memory, CUDA allocator (MiB)")] if config.get("device") == "cuda" else [
        ("peak_mb", "peak resident set, RSS (MiB)"), ("alloc_mb", "peak tensor memory (MiB)")]
    panels.append(("step_s", "step time (s, median)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    ok = [c for c in cells if "error" not in c]
    for col in dict.fromkeys(label(c["method"], c["chunk"]) for c in cells):
        mine = sorted((c for c in ok if label(c["method"], c["chunk"]) == col), key=lambda c: c["beam"])
        for ax, (key, _) in zip(axes, panels):
            points = [c for c in mine if key in c]  # reports from before a figure existed lack it
            line, = ax.plot([c["beam"] for c in points], [c[key] for c in points], label=col)
            for c in points:
                ax.plot(c["beam"], c[key], "o", color=line.get_color(),
                        markerfacecolor="none" if c.get("extrapolated") else line.get_color())
    beams = sorted({c["beam"] for c in cells})
    for ax, (key, ylabel) in zip(axes, panels):
        ax.set(xscale="log", xlabel="beam size K", ylabel=ylabel)
        ax.xaxis.set_minor_locator(mticker.NullLocator())  # minor labels would overprint the beam sizes
        ax.set_xticks(beams, labels=[str(k) for k in beams])
        _log_axis(ax, [c[key] for c in ok if key in c])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    sizes = describe_sizes({k: v for k, v in config.items() if k not in ("beam", "chunk")})
    fig.suptitle(f"twophase bench: {sizes}; beam varies (hollow = extrapolated; T = max_len)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
