"""What a run reports about itself: its scores' names, progress lines, peak memory and the closing table."""
from __future__ import annotations

import datetime

import torch

def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA's allocator where training runs on a GPU, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # POSIX only; Linux reports kilobytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fmt_scores(scores: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in scores.items() if isinstance(v, float) and k != "n")


OTHER_ROWS = [("reward", "reward", "{:.4f}"), ("reward_mean", "train reward (mean)", "{:.4f}"),
              ("steps_per_s", "steps/s", "{:.2f}"), ("skipped", "skipped steps", "{:.0f}")]


def summary_table(summary: dict, metrics=()) -> str:
    """Validation at the end of the warm start and at the end of RL, and the test split (final model) beside;
    `metrics`: the task's (twophase.tasks.Metric), their labels and formats."""
    rows = [(m.key, m.label, m.fmt) for m in metrics] + OTHER_ROWS
    cols = [(c, f"valid, end {c.upper()}") for c in ("mle", "rl") if c in summary]
    cols += [("test", "test, final")] if "test" in summary else []
    lines = [f"{'':22}" + "".join(f"{title:>16}" for _, title in cols)]
    for key, label, fmt in rows:
        cells = []
        for c, _ in cols:
            v = summary[c].get(key, float("nan"))
            cells.append(f"{'-' if v != v else fmt.format(v):>16}")
        lines.append(f"{label:22}" + "".join(cells))
    lines.append(f"{'peak memory':22}{summary.get('peak_memory_mb', float('nan')):>15.0f}M")
    return "\n".join(lines)


class ProgressLines:
    """--log-every: where no progress bar is drawn (stdout is a file or a pipe), one line every N steps, so a log
    shows the run moving between validations."""

    def __init__(self, every: int, total: int, step: int, elapsed: float):
        self.every, self.total = every, total
        self.last_step, self.last_elapsed = step, elapsed

    def line(self, step: int, phase: str, row: dict, elapsed: float) -> str | None:
        if not self.every or step % self.every:
            return None
        rate = (step - self.last_step) / max(elapsed - self.last_elapsed, 1e-9)
        self.last_step, self.last_elapsed = step, elapsed
        values = " ".join(f"{k}={row[k]:.4g}" for k in ("loss", "reward_mean", "lr") if isinstance(row.get(k), float))
        clock = datetime.timedelta(seconds=round(elapsed))
        return f"step {step}/{self.total} [{phase}] {values} {rate:.2f} steps/s, elapsed {clock}"
