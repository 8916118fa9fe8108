"""--tensorboard: the metrics.jsonl rows mirrored as TensorBoard scalars under <save-dir>/tensorboard.

Tags: train/<phase>/<field> per step; valid/<metric> for MLE and RL validations (one curve across both phases),
valid_mle_continued/<metric> for --compare-mle's branch (at the end-of-MLE step plus its own steps, so it sits
beside RL); test/<model>/<metric>; schedule/lr for --lr-decay. torch.utils.tensorboard needs the `tensorboard`
package (the `tb` extra); `writer_class` says so in one line where it is missing.
"""
from __future__ import annotations

SKIP = {"step", "phase", "after", "model", "time", "elapsed_s", "since_branch_s", "train_s", "continued", "n", "action"}


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
            if key not in SKIP and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step, walltime=None)
        if row.get("phase") in ("eval", "test", "schedule"):
            self.writer.flush()  # the rare rows worth seeing at once; step rows flush on the writer's timer

    def close(self) -> None:
        self.writer.close()
