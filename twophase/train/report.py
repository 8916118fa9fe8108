"""What a run reports about itself: peak memory and the closing summary table."""
from __future__ import annotations

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA's allocator where training runs on a GPU, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # POSIX only; Linux reports kilobytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fmt_scores(scores: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in scores.items() if isinstance(v, float))


ROWS = [("word accuracy", "word_acc", "{:.2%}"), ("word error rate", "wer", "{:.2%}"),
        ("phoneme error rate", "per", "{:.2%}"), ("valid reward", "reward", "{:.4f}"),
        ("train reward (mean)", "reward_mean", "{:.4f}"), ("steps/s", "steps_per_s", "{:.2f}"),
        ("skipped steps", "skipped", "{:.0f}")]


def summary_table(summary: dict) -> str:
    """Validation at the end of the warm start and at the end of RL, side by side."""
    cols = [p for p in ("mle", "rl") if p in summary]
    lines = [f"{'':22}" + "".join(f"{'end of ' + c.upper():>16}" for c in cols)]
    for label, key, fmt in ROWS:
        cells = []
        for c in cols:
            v = summary[c].get(key, float("nan"))
            cells.append(f"{'-' if v != v else fmt.format(v):>16}")
        lines.append(f"{label:22}" + "".join(cells))
    lines.append(f"{'peak memory':22}{summary.get('peak_memory_mb', float('nan')):>15.0f}M")
    return "\n".join(lines)
