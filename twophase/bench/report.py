"""Benchmark report: the Markdown tables and the PNG plot of `python -m twophase.bench`."""
from __future__ import annotations

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


def plot(cells: list[dict], config: dict, path: Path) -> bool:
    """Peak memory and step time against beam size, one line per method; hollow markers are extrapolated."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install twophase[bench]): no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 (NullLocator below)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for col in dict.fromkeys(label(c["method"], c["chunk"]) for c in cells):
        ok = sorted((c for c in cells if label(c["method"], c["chunk"]) == col and "error" not in c),
                    key=lambda c: c["beam"])
        for ax, key in zip(axes, ("peak_mb", "step_s")):
            line, = ax.plot([c["beam"] for c in ok], [c[key] for c in ok], label=col)
            for c in ok:
                ax.plot(c["beam"], c[key], "o", color=line.get_color(),
                        markerfacecolor="none" if c.get("extrapolated") else line.get_color())
    for ax, key, ylabel in zip(axes, ("peak_mb", "step_s"), ("peak memory (MiB)", "step time (s, median)")):
        positive = all(c[key] > 0 for c in cells if "error" not in c)  # toy grids can measure 0 MiB
        ax.set(xscale="log", yscale="log" if positive else "linear", xlabel="beam size K", ylabel=ylabel)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # minor labels would overprint the beam sizes
        beams = sorted({c["beam"] for c in cells})
        ax.set_xticks(beams, labels=[str(k) for k in beams])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    sizes = describe_sizes({k: v for k, v in config.items() if k not in ("beam", "chunk")})
    fig.suptitle(f"twophase bench: {sizes}; beam varies (hollow = extrapolated; T = max_len)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
