"""The picture of a run (twophase.plot): RL against MLE continued from the branch point, in colours of their own,
drawn by train.py at the end of a run; read from the figure's artists, not from the PNG."""
import json

import pytest

from twophase import plot
from twophase.train import cli, rundir

from taskfiles import write_task

matplotlib = pytest.importorskip("matplotlib")  # the `plot` extra
TINY = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size", "3",
        "--rescore-chunk", "5", "--max-len", "8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A small finished run with RL, its MLE-continued control and a test split, and what train.py printed."""
    d = tmp_path_factory.mktemp("picture")
    for name, n, seed in (("train", 200, 0), ("valid", 12, 1), ("test", 12, 2)):
        write_task(d / f"{name}.tsv", "reverse", n, seed=seed)
    mp = pytest.MonkeyPatch()
    mp.setenv("TWOPHASE_PICTURE", "on")  # the suite turns it off (conftest)
    import io
    import contextlib
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["--train", str(d / "train.tsv"), "--valid", str(d / "valid.tsv"), "--test",
                         str(d / "test.tsv"), "--mle-steps", "6", "--rl-steps", "6", "--eval-every", "2",
                         "--compare-mle", "--save-dir", str(d / "run"), *TINY])
    mp.undo()
    assert code == 0
    return d / "run", out.getvalue()


def _lines(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def test_train_py_draws_the_picture_and_names_it_last(run):
    save, printed = run
    assert printed.strip().splitlines()[-1] == f"picture: {save / 'curves.png'}"
    assert (save / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert save / "curves.png" in rundir.artifacts(save)  # --overwrite removes it with the old run


def test_the_branch_view_shows_each_arm_in_its_own_colour_from_the_branch(run):
    save, _ = run
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    fig, metrics = plot.figure([save / "metrics.jsonl"], ["run"])
    assert metrics[:2] == ["word_acc", "per"] and len(fig.axes) == 3 * len(metrics)  # TSV data: no G2P wer
    branch_row = fig.axes[:len(metrics)]
    for ax in branch_row:
        lines = _lines(ax)
        rl, cont = lines["run RL"], lines["run MLE continued"]
        assert rl.get_color() != cont.get_color() != lines["run end of MLE"].get_color() != rl.get_color()
        assert rl.get_xdata()[0] == cont.get_xdata()[0] == 0 and ax.get_xlim()[0] == 0  # from the branch point
        # the RL phase spans the whole axis: its last validation at its training seconds, not 5% of a long run
        rl_evals = [r for r in rows if r["phase"] == "eval" and r["after"] == "rl"]
        assert rl.get_xdata()[-1] == pytest.approx(rl_evals[-1]["train_s"])
        assert rl.get_xdata()[-1] >= 0.5 * ax.get_xlim()[1] or cont.get_xdata()[-1] >= 0.5 * ax.get_xlim()[1]
        assert ax.get_legend() is not None or ax is not branch_row[0]
        assert "branch" in ax.get_xlabel()
    reference = _lines(branch_row[0])["run end of MLE"]  # a flat line at the end-of-MLE validation
    end = max((r for r in rows if r["phase"] == "eval" and r["after"] == "mle"), key=lambda r: r["step"])
    assert set(reference.get_ydata()) == {end["word_acc"]}
    tests = {r["model"]: r for r in rows if r["phase"] == "test"}
    text = " ".join(t.get_text() for t in branch_row[0].texts)
    assert set(tests) == {"mle", "mle-continued", "rl"}
    for name, model in (("MLE", "mle"), ("MLE continued", "mle-continued"), ("RL", "rl")):
        assert f"{name} {tests[model]['word_acc']:.4g}" in text  # the closing table's test figures beside it
    whole = fig.axes[len(metrics)]  # the whole run against wall time: the same colour for each arm
    assert _lines(whole)["run RL"].get_color() == rl.get_color()
    assert _lines(whole)["run MLE continued"].get_color() == cont.get_color()
    matplotlib.pyplot.close(fig)


def test_several_runs_get_a_hue_family_each_with_distinct_arms(run, tmp_path):
    save, _ = run
    fig, metrics = plot.figure([save / "metrics.jsonl"] * 2, ["seed1", "seed2"])
    lines = _lines(fig.axes[0])
    colors = {label: lines[label].get_color() for label in lines}
    assert len(set(map(tuple, colors.values()))) == len(colors) == 6  # 2 runs x (end of MLE, continued, RL)
    oranges = [colors[f"seed1 {arm}"] for arm in ("end of MLE", "MLE continued", "RL")]
    blues = [colors[f"seed2 {arm}"] for arm in ("end of MLE", "MLE continued", "RL")]
    # one family per run: within a run the arms differ in shade (lightness), across runs in hue
    assert all(c[0] > c[2] for c in oranges[1:]) and all(c[2] > c[0] for c in blues[1:])
    matplotlib.pyplot.close(fig)


def test_older_rows_without_training_seconds_fall_back_to_wall_time():
    rows = [{"step": 4, "phase": "eval", "after": "mle", "word_acc": 0.3, "elapsed_s": 20},
            {"step": 6, "phase": "eval", "after": "rl", "word_acc": 0.35, "elapsed_s": 50},
            {"step": 6, "phase": "eval", "after": "mle-continued", "continued": 2, "since_branch_s": 25,
             "word_acc": 0.33, "elapsed_s": 80}]
    arms = plot.branch_curves(rows)
    assert arms["clock"] == "wall"
    assert [r["since"] for r in arms["rl"]] == [0, 30] and [r["since"] for r in arms["mle-continued"]] == [0, 25]
    rows = [dict(r, train_s=s) for r, s in zip(rows, (9, 4, 3.5))]
    arms = plot.branch_curves(rows)
    assert arms["clock"] == "training" and [r["since"] for r in arms["rl"]] == [0, 4]
    restored = rows + [{"step": 4, "phase": "schedule", "action": "restore_best", "from_step": 2},
                       {"step": 2, "phase": "eval", "after": "mle", "word_acc": 0.4, "elapsed_s": 10}]
    assert plot.branch_curves(restored)["mle"]["word_acc"] == 0.4  # --rl-from-best: the arms start there
    assert plot.branch_curves(rows[:1]) == {}  # no RL yet: no branch view


def test_no_picture_flag_and_environment(run, monkeypatch):
    save, _ = run

    class Stub:
        save_dir = save

        class trainer:
            class cfg:
                picture = False
    assert cli.draw_picture(Stub) is None
    Stub.trainer.cfg.picture = True
    monkeypatch.setenv("TWOPHASE_PICTURE", "off")
    assert cli.draw_picture(Stub) is None
    monkeypatch.setenv("TWOPHASE_PICTURE", "on")
    assert cli.draw_picture(Stub) == save / "curves.png"
