"""The closing table and the progress lines print any float in a cell's width: 4 significant digits with an
exponent where fixed point would be wider or would show a nonzero value as zero; ordinary values unchanged."""
from twophase.train import report
from twophase.train.report import fmt_scores, summary_table


def test_huge_and_tiny_rewards_fit_their_cells():
    summary = {"mle": {"reward": 1e300, "steps": 4, "seconds": 0.3},
               "rl": {"reward": -3.2e-7, "reward_mean": 1.5e20, "steps": 2, "seconds": 12.0, "steps_per_s": 0.5},
               "peak_memory_mb": 300.0}
    lines = summary_table(summary).splitlines()
    assert max(len(line) for line in lines) <= 26 + 2 * 16
    rows = {line[:26].strip(): line[26:].split() for line in lines[1:]}
    assert rows["valid reward"] == ["1e+300", "-3.2e-07"]
    assert rows["train reward (mean)"] == ["-", "1.5e+20"]
    assert rows["training steps"] == ["4", "2"] and rows["training time (s)"] == ["0", "12"]  # as before
    assert rows["steps/s"] == ["-", "0.50"]


def test_ordinary_values_keep_their_format():
    assert report.compact("{:.4f}", 0.25) == "0.2500" and report.compact("{:.4f}", 0.0) == "0.0000"
    assert report.compact("{:.2%}", 0.5) == "50.00%" and report.compact("{:.0f}", 1234567.0) == "1234567"
    assert report.compact("{:.4f}", -12345.678) == "-12345.6780"
    assert report.compact("{:.4f}", 1e12) == "1e+12"  # 1000000000000.0000: wider than a cell


def test_progress_lines_too():
    assert fmt_scores({"reward": 1e300, "word_acc": 0.5, "n": 3.0}) == "reward=1e+300 word_acc=0.5000"


def test_eval_only_table_prints_compact_numbers_and_unscored_rewards():
    from twophase.tasks.base import Metric
    from twophase.train.report import evaluation_table

    class Task:
        metrics = [Metric("acc", "accuracy")]
    table = evaluation_table(Task, {"valid": {"acc": 0.5, "reward": 1e300, "n": 4},
                                    "test": {"acc": 0.25, "reward": None, "n": 2}})
    lines = table.splitlines()
    assert lines[2].split() == ["reward", "1e+300", "-"]  # one cell, not 300 digits; nothing scored: '-'
    assert lines[1].split() == ["accuracy", "50.00%", "25.00%"] and max(map(len, lines)) < 60
