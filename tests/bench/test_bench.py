"""benchmarks on a toy grid: the worker's fields, the report files, and one-phase = two-phase gradients."""
import json

import pytest
import torch

from benchmarks import __main__ as grid, cell


pytestmark = pytest.mark.usefixtures("one_thread")


def _cell(method, **kw):
    sizes = grid.GRIDS["tiny"][0]
    two = method.startswith("two-phase")
    return dict(sizes, beam=3, method=method, chunk=4 if two else None, device="cpu",
                dtype="float32", warmup=1, steps=2, seed=0, grad_check=not two, **kw)


@pytest.mark.parametrize("method", ["two-phase", "two-phase-noshare", "one-phase", "seed-style"])
def test_worker_reports_every_field(method):
    out = grid.run_cell(_cell(method))
    for key in ("peak_mb", "alloc_mb", "graph_mb", "step_s"):
        assert isinstance(out[key], float) and out[key] >= 0
    # A first step allocates at least the gradients and Adam's two moments: three copies of the parameters.
    model = cell.build(_cell(method))[0]
    assert out["alloc_mb"] * 2**20 >= 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(out["step_times"]) == 2 and out["rows"] == 6
    assert out["target_len"] == out["max_len"]  # EOS banned: full length by construction
    if method.startswith("two-phase"):
        assert "grad_rel_diff" not in out
        # per step 6 rows of 4 positions; without sharing every position is decoded
        assert out["positions"] == 2 * 6 * 4 and 0 < out["nodes"] <= out["positions"]
        assert (out["nodes"] == out["positions"]) == (method == "two-phase-noshare")
    else:
        assert out["graph_mb"] > 0
        assert out["grad_rel_diff"] <= 1e-4  # the same gradient as two-phase, up to fp32 rounding


def test_extrapolated_cells_scale_linearly_in_rows():
    cell = _cell("one-phase", batch=4)
    out = grid.measure_capped(cell, cap=grid.estimate_bytes(cell) / 3, inline=True, timeout=60)
    assert out["extrapolated"] and out["rows"] == 12
    assert out["measured_at"][0] * out["measured_at"][1] < 12
    assert grid.fmt_cell(out).count("*") == 4


def test_tiny_run_writes_the_report(tmp_path, capsys):
    assert grid.main(["--tiny", "--inline", "--beams", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {(c["method"], c["chunk"]) for c in report["grid"]} == {("two-phase", 4), ("two-phase-noshare", 4),
                                                                    ("one-phase", None), ("seed-style", None)}
    assert all(c["grad_rel_diff"] <= 1e-4 for c in report["grid"] if not c["method"].startswith("two-phase"))
    md = (tmp_path / "bench.md").read_text()
    assert "T = max_len" in md and "| K | N |" in md and md in capsys.readouterr().out
    assert (tmp_path / "bench.png").exists() == _has_matplotlib()


def test_methods_choose_the_grid_columns(tmp_path, capsys):
    argv = ["--tiny", "--inline", "--beams", "2", "--no-speed", "--out", str(tmp_path), "--methods", "two-phase"]
    assert grid.main(argv) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [(c["method"], c["chunk"]) for c in report["grid"]] == [("two-phase", 4)]
    with pytest.raises(SystemExit) as exit_info:
        grid.parse_args(["--methods", "two-phase,naive"])
    assert exit_info.value.code == 2 and "--methods" in capsys.readouterr().err


def test_speed_only_reports_sharing_side_by_side(tmp_path, capsys):
    """The speed target alone (at toy sizes): two-phase with and without prefix sharing, and the ratios."""
    sizes = ["batch=2", "beam=3", "src_len=5", "max_len=4", "hidden=16", "embed=8", "vocab=30", "src_vocab=20",
             "chunk=4"]
    assert grid.main(["--tiny", "--inline", "--speed-only", "--out", str(tmp_path), "--config", *sizes]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["grid"] == [] and [c["method"] for c in report["speed"]["cells"]] == list(grid.METHODS)
    assert set(report["speed"]["time_ratios"]) == {"two-phase/seed-style", "two-phase/one-phase",
                                                   "two-phase-noshare/seed-style", "two-phase-noshare/one-phase",
                                                   "two-phase/two-phase-noshare"}
    md = (tmp_path / "bench.md").read_text()
    assert "two-phase-noshare c=4" in md and "nodes/positions" in md and "Beam sizes" not in md
    with pytest.raises(SystemExit):
        grid.parse_args(["--speed-only", "--no-speed"])


def _has_matplotlib():  # the `bench` extra, not a test requirement
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_plot_labels_log_axes_with_plain_numbers():
    from benchmarks import report

    assert report._ticks(30, 400) == [50, 100, 200]  # 1-2-5 in the range
    assert report._ticks(40, 60) == [40, 50, 60]  # a narrow range: every digit
    assert [report._plain(v) for v in (40, 0.2, 12000)] == ["40", "0.2", "12,000"]
    if not _has_matplotlib():
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [0.15, 45])
    report._log_axis(ax, [0.15, 45])
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    assert labels and all(label.replace(".", "").replace(",", "").isdigit() for label in labels), labels


def test_bare_loop_finds_beam_searchs_candidates():
    """The bare loop is the same arithmetic as beam_search (EOS banned): the same K best rows with the same
    scores, in float64; so --vs-loop compares equal work."""
    from benchmarks.bareloop import bare_beam_search
    from twophase.phase1.search import beam_search
    c = dict(grid.GRIDS["tiny"][0], batch=3, src_len=6, max_len=5, beam=4, method="two-phase", device="cpu",
             dtype="float64", seed=0)
    model, _, src, lengths = cell.build(c)
    lengths[1] = 3  # a padded source: the mask matters
    tokens, scores = bare_beam_search(model, src, lengths, 4, 5)
    found = beam_search(model, (src, lengths), 4, 5)
    assert torch.equal(found.tokens, tokens)
    assert torch.allclose(found.scores, scores.reshape(-1), rtol=0, atol=1e-12)


def test_vs_loop_runs_on_the_toy_sizes(capsys):
    assert grid.main(["--tiny", "--vs-loop", "1"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["rounds"] == 1 and row["beam"] == grid.GRIDS["tiny"][1][0]
    assert row["cpu_ratio"] == pytest.approx(row["search_cpu_s"] / row["loop_cpu_s"])


def test_forum_benchmark_runs_every_variant_and_agrees_with_naive(capsys):
    """benchmarks.forum at a toy size: every variant measured for both models and kinds, the targets' lines, and
    two-phase's gradient equal to naive's in float64 (a small size of the same models)."""
    from benchmarks import forum

    assert forum.main(["--tiny", "--chunks", "4", "--accumulate", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {(r["model"], r["kind"], r["variant"]) for r in rows} == {
        (m, k, v) for m in ("blocks", "obvious") for k in ("sample", "beam")
        for v in ("naive", "accumulate", "two-phase", "auto")}
    assert all(r["cpu_s"] > 0 and r["peak_mb"] > 0 for r in rows)
    agreement = dict(line.rsplit(": ", 1) for line in out.splitlines() if line.startswith("gradients"))
    assert len(agreement) == 4 and all(float(v) < 1e-12 for v in agreement.values()), agreement
