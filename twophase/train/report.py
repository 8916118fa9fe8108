"""What a run reports about itself: its scores' names, progress lines, peak memory and the closing table."""
from __future__ import annotations

import datetime

import torch

LOWER_IS_BETTER = ("wer", "per")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA's allocator where training runs on a GPU, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # POSIX only; Linux reports kilobytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_metric(name: str, builtin_data: bool) -> str:
    """--best-metric auto: the built-in G2P task's own measure, word accuracy; on TSV data, whose task we cannot
    know (exact match is near zero in translation, say), the reward the run optimises."""
    if name != "auto":
        return name
    return "word_acc" if builtin_data else "reward"


def fmt_scores(scores: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in scores.items() if isinstance(v, float))


def score_labels(builtin_data: bool) -> dict:
    """Names of the scores: G2P's words and phonemes on the built-in data, sequences and tokens on any other."""
    if builtin_data:
        return {"word_acc": "word accuracy", "wer": "word error rate", "per": "phoneme error rate"}
    return {"word_acc": "sequence accuracy", "wer": "sequence error rate", "per": "token error rate"}


ROWS = [("word_acc", "{:.2%}"), ("wer", "{:.2%}"), ("per", "{:.2%}"), ("reward", "{:.4f}"),
        ("reward_mean", "{:.4f}"), ("steps_per_s", "{:.2f}"), ("skipped", "{:.0f}")]
OTHER_LABELS = {"reward": "reward", "reward_mean": "train reward (mean)", "steps_per_s": "steps/s",
                "skipped": "skipped steps"}


def summary_table(summary: dict, builtin_data: bool = True) -> str:
    """Validation at the end of the warm start and at the end of RL, and the test split (final model) beside."""
    labels = {**score_labels(builtin_data), **OTHER_LABELS}
    cols = [(c, f"valid, end {c.upper()}") for c in ("mle", "rl") if c in summary]
    cols += [("test", "test, final")] if "test" in summary else []
    lines = [f"{'':22}" + "".join(f"{title:>16}" for _, title in cols)]
    for key, fmt in ROWS:
        cells = []
        for c, _ in cols:
            v = summary[c].get(key, float("nan"))
            cells.append(f"{'-' if v != v else fmt.format(v):>16}")
        lines.append(f"{labels[key]:22}" + "".join(cells))
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
