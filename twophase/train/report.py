"""What a run reports about itself: its scores' names, progress lines, peak memory and the closing table;
--eval-only's table; an RL step's reward figures (`reward_row`, `RewardLog`); and the metrics rows mirrored to
TensorBoard (`TensorBoardLog`)."""
from __future__ import annotations

import dataclasses
import datetime
import math
import sys
from pathlib import Path

import torch

from ..rewards.weighted import mean_std, statistics
from ..config import Config
from ..system import distributed, memory


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process since it began (--profile-memory's resets kept, `memory`): CUDA's allocated
    bytes where training runs on a GPU, else the peak RSS."""
    figures = memory.overall_mb(device)
    return figures.get("peak_allocated_mb", figures.get("peak_rss_mb", float("nan")))


PEAK_ROWS = (("peak_allocated_mb", "peak memory allocated (CUDA)"), ("peak_reserved_mb", "peak memory reserved (CUDA)"),
             ("peak_rss_mb", "peak memory (process RSS)"))


def compact(fmt: str, value: float, width: int = 15) -> str:
    """fmt.format(value), or the value in 4 significant digits (1e+300, 3.2e-07) where that would be wider than
    `width` or would show a nonzero value as zero: a reward of 1e300 is one cell, not 300 digits."""
    text = fmt.format(value)
    hidden = value != 0 and ".0f" not in fmt and "%" not in fmt and not any(ch in "123456789" for ch in text)
    return f"{value:.4g}" if len(text) > width or hidden else text


# The corpus scores of a bleu or chrf reward (`rewards.registry.CORPUS`): rows of the closing table after the reward,
# in sacrebleu's 0-100 scale.
CORPUS_ROWS = (("corpus_bleu", "corpus BLEU", "{:.2f}"), ("corpus_chrf", "corpus chrF", "{:.2f}"))


def fmt_scores(scores: dict, metrics=()) -> str:
    """The floats of a validation's scores, each task metric in its `Metric.fmt` (also at a further test beam,
    key@K), a corpus score in 2 decimals, the others in 4; a reward (or corpus score) that scored nothing (None)
    as `reward=-`, not a number."""
    fmts = {**{m.key: m.fmt for m in metrics}, **{key: fmt for key, _, fmt in CORPUS_ROWS}}
    return " ".join(f"{k}={compact(fmts.get(k.partition('@')[0], '{:.4f}'), v)}" if isinstance(v, float) else
                    f"{k}=-" for k, v in scores.items()
                    if (isinstance(v, float) or (k.partition("@")[0] in NONE_SHOWN and v is None)) and k != "n")


NONE_SHOWN = ("reward", "corpus_bleu", "corpus_chrf")  # scores printed as '-' where nothing was scored


OTHER_ROWS = [("reward_mean", "train reward (mean)", "{:.4f}"), ("steps", "training steps", "{:.0f}"),
              ("seconds", "training time (s)", "{:.0f}"), ("cpu_seconds", "training CPU time (s)", "{:.0f}"),
              ("steps_per_s", "steps/s", "{:.2f}"),
              ("skipped", "skipped steps", "{:.0f}")]
COLUMNS = (("mle", "end of MLE"), ("mle-continued", "MLE continued"), ("rl", "RL"))


def with_beams(metrics, beams: list[int]) -> tuple:
    """The task's metrics, then each again as scored at the further test beams (key@K, see --test-beam)."""
    return tuple(metrics) + tuple(dataclasses.replace(m, key=f"{m.key}@{k}", label=f"{m.label} @{k}")
                                  for k in beams[1:] for m in metrics)


def final_column(objective: str) -> str:
    """The title of the RL phase's column: named after what the phase did where "RL" would mislead."""
    return "distilled" if objective == "distill" else "RL"


def summary_table(summary: dict, metrics=(), final: str = "RL") -> str:
    """One column per model: the end of the MLE warm start, MLE continued for RL's time (--compare-mle) and the
    end of RL (titled `final`, `final_column`'s); validation rows, then test rows (the test split scores each
    model the run compared, else the final one only), then the phase's training figures. `metrics`: the task's
    (twophase.tasks.Metric)."""
    scored = [(m.key, m.label, m.fmt) for m in metrics] + [("reward", "reward", "{:.4f}"), *CORPUS_ROWS]
    cols = [(c, final if c == "rl" else title) for c, title in COLUMNS if c in summary]
    tests = summary.get("tests") or ({cols[-1][0]: summary["test"]} if "test" in summary and cols else {})
    sections = [("valid ", {c: summary[c] for c, _ in cols}, scored)]
    if tests:
        sections.append(("test ", tests, scored))
    sections.append(("", {c: summary[c] for c, _ in cols}, OTHER_ROWS))
    # The label column fits the longest label (Karel's "valid passes the 5 spec pairs"), so columns stay aligned.
    width = max([26] + [len(prefix + label) + 2 for prefix, _, rows in sections for _, label, _ in rows])
    lines = [" " * width + "".join(f"{title:>16}" for _, title in cols)]
    for prefix, table, rows in sections:
        for key, label, fmt in rows:
            cells = []
            for c, _ in cols:
                v = table.get(c, {}).get(key, float("nan"))
                cells.append(f"{'-' if v is None or v != v else compact(fmt, v):>16}")
            if any(cell.strip() != "-" for cell in cells):
                lines.append(f"{prefix + label:{width}}" + "".join(cells))
    # CUDA's allocated and reserved, or the CPU's resident set (Run.train's summary)
    for key, label in [row for row in PEAK_ROWS if row[0] in summary] or [("peak_memory_mb", "peak memory")]:
        lines.append(f"{label:{width}}{summary.get(key, float('nan')):>15.0f}M")
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


@dataclasses.dataclass
class Result:
    """What a run returns (`twophase.fit`; train.py prints it): its resolved configuration, its directory, the
    closing table's numbers (`summary`: one dict per column, "mle", "mle-continued", "rl", with "test" and
    "tests" where the run tested, and the peak memory; with eval_only the evaluation's scores per split) and the
    table's text, the trained model, the best validation and the files written."""

    config: Config = dataclasses.field(repr=False)
    """The Config the run ran with, as config.json records it."""
    run_dir: Path
    """<save-dir>, absolute."""
    summary: dict = dataclasses.field(repr=False)
    """The closing table's numbers: "mle", "mle-continued", "rl" (and "test", "tests"), each a dict of scores."""
    table: str = dataclasses.field(repr=False)
    """The closing table's text: print(result.table)."""
    model: torch.nn.Module | None = dataclasses.field(default=None, repr=False)
    """The trained model (RL's last parameters)."""
    best_metric: str | None = None
    """What picked checkpoint_best.pt."""
    best: float | None = None
    """checkpoint_best.pt's score."""
    best_step: int | None = None
    """checkpoint_best.pt's step."""
    best_checkpoint: Path | None = None
    """checkpoint_best.pt, or None where no validation improved."""
    last_checkpoint: Path | None = None
    """checkpoint_last.pt (None: no step taken)."""
    metrics: Path | None = None
    """metrics.jsonl (None: no step taken)."""
    final_model: Path | None = None
    """The export of the final model (--hf-model: <save-dir>/hf_final; --export: model_final.pt), or None."""
    picture: Path | None = None
    """<save-dir>/curves.png, or None."""


def evaluation_table(task, scores: dict) -> str:
    """--eval-only's table: one row per metric (the task's, then the reward), one column per split."""
    rows = [(m.key, m.label, m.fmt) for m in task.metrics] + [("reward", "reward", "{:.4f}"), *CORPUS_ROWS]
    splits = list(scores)
    lines = [f"{'':28}" + "".join(f"{s:>12}" for s in splits)]
    for key, label, fmt in rows + [("n", "examples", "{:.0f}")]:
        if any(key in scores[s] for s in splits):
            lines.append(f"{label:28}" + "".join(f"{_cell(fmt, scores[s].get(key, '')):>12}" for s in splits))
    return "\n".join(lines)


def _cell(fmt: str, value) -> str:
    """A score in its format, compact where it would not fit (`compact`); '-' for a reward that scored
    nothing (None), '' for a split without the key."""
    if value == "":
        return ""
    return "-" if value is None or value != value else compact(fmt, value, width=11)


# ------------------------------------------------------------------ an RL step's reward figures
# For its metrics row, reduced over processes: `reward_mean`, `reward_max` and
# `candidates`; `unscored` where some candidate got no reward (NaN: every TRL-style reward returned None), left
# out of the mean and max; and with several rewards (`twophase.rewards.weighted.WeightedSum`) `reward/<name>/mean` and
# `reward/<name>/std` of each, over the candidates it scored. A step whose reward scored no candidate at all
# trains nothing (no candidate has an advantage); `RewardLog` says so on stderr, once a run, rather than let a
# reward that never applies (a misspelt column) train silently on zero gradients.
def reward_row(rewards: torch.Tensor, parts: dict | None) -> dict:
    """rewards (N,) float64 of this process's candidates; `parts`: each reward's values (WeightedSum.last)."""
    scored = ~torch.isnan(rewards)
    values = torch.where(scored, rewards, torch.full_like(rewards, -math.inf))  # (N,)
    count, total, top = torch.stack([scored.to(values.dtype).sum(), torch.where(scored, rewards, 0.0).sum(),
                                     values.max() if len(values) else values.new_tensor(-math.inf)]).tolist()
    parts = parts or {}
    sums = distributed.reduce_sums({"reward": total, "scored": int(count), "candidates": len(rewards),
                                    **statistics(parts)})
    top = distributed.reduce_max(top)
    row = {"reward_mean": sums["reward"] / sums["scored"] if sums["scored"] else None,
           "reward_max": top if math.isfinite(top) else None, "candidates": int(sums["candidates"])}
    if sums["scored"] < sums["candidates"]:
        row["unscored"] = int(sums["candidates"] - sums["scored"])
    return {**row, **mean_std(sums, list(parts))}


class RewardLog:
    """`reward_row` for a run's RL steps, and its warning, given once, at the first step that scored nothing."""

    def __init__(self, reward):
        self.name = getattr(reward, "name", None) or getattr(reward, "__name__", "the reward")
        self.warned = False

    def row(self, rewards: torch.Tensor, parts: dict | None, step: int) -> dict:
        """`reward_row` of step `step` (1-based); a warning on stderr (main process) the first time none of
        the step's candidates, over every process, got a reward."""
        row = reward_row(rewards, parts)
        if row["reward_mean"] is None and row["candidates"] and not self.warned:
            self.warned = True
            if distributed.rank() == 0:
                print(f"warning: reward '{self.name}' scored none of the {row['candidates']} candidates of RL step "
                      f"{step} (None for every one): the step trains nothing, and a reward that never scores trains "
                      "nothing at all; does it read a column the data has (spelt as in the file)? (said once)",
                      file=sys.stderr, flush=True)
        return row


# ------------------------------------------------------------------ --tensorboard
# --tensorboard: the metrics.jsonl rows mirrored as TensorBoard scalars under <save-dir>/tensorboard.
#
# Tags: train/<phase>/<field> per step; valid/<metric> for MLE and RL validations (one curve across both phases),
# valid_mle_continued/<metric> for --compare-mle's branch (at the end-of-MLE step plus its own steps, so it sits
# beside RL); test/<model>/<metric>; schedule/lr for --lr-decay. torch.utils.tensorboard needs the `tensorboard`
# package (the `tb` extra); `writer_class` says so in one line where it is missing.
NOT_SCALARS = {"step", "phase", "after", "model", "time", "elapsed_s", "since_branch_s", "train_s", "continued", "n",
               "action"}  # a row's fields that are no curve


def writer_class():
    """torch's SummaryWriter; ImportError with one line where tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError("--tensorboard needs the tensorboard package (pip install 'twophase[tb]')") from None
    return SummaryWriter


class TensorBoardLog:
    """Mirrors metrics rows to a SummaryWriter-like `writer` (add_scalar, flush, close); `mle_end` places the
    continued-MLE branch (a callable, since the MLE phase may end early)."""

    def __init__(self, writer, mle_end):
        self.writer, self.mle_end = writer, mle_end

    def tags(self, row: dict) -> tuple[str, int]:
        phase, step = row.get("phase"), int(row.get("step", 0))
        if phase == "eval" and row.get("after") == "mle-continued":
            return "valid_mle_continued", self.mle_end() + int(row.get("continued", 0))
        if phase == "eval":
            return "valid", step
        if phase == "test":
            return f"test/{row.get('model', 'final')}", step
        if phase == "mle-continued":
            return "train/mle-continued", self.mle_end() + int(row.get("continued", 0))
        return f"{'train/' if phase in ('mle', 'rl') else ''}{phase}", step

    def write(self, row: dict) -> None:
        prefix, step = self.tags(row)
        for key, value in row.items():
            if key not in NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step, walltime=None)
        if row.get("phase") in ("eval", "test", "schedule"):
            self.writer.flush()  # the rare rows worth seeing at once; step rows flush on the writer's timer

    def close(self) -> None:
        self.writer.close()
