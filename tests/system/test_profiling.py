"""--profile-memory sections and the --rescore-chunk auto planner."""
import mmap
import os

import pytest
import torch

from twophase import Seq2Seq, beam_search
from twophase.phase2.rescoring import rescore_backward
from twophase.config import parse_chunk, parse_size
from twophase.system.memory import graph_bytes, rss_bytes
from twophase.system.profiling import ChunkPlanner, StepProfiler
from twophase.phase2.rescoring import rescore_backward

from conftest import toy_batch


def _model(V=40):
    torch.manual_seed(0)
    return Seq2Seq(9, V, embed_dim=8, hidden_size=16).eval()


def test_profiler_reports_every_phase_two_section():
    model = _model()
    src, lens = toy_batch()
    s = beam_search(model, (src, lens), beam_size=6, max_len=6)
    prof = StepProfiler(torch.device("cpu"))
    with prof.section("phase 1: search"):
        beam_search(model, (src, lens), beam_size=6, max_len=6)
    stats = {}
    rescore_backward(model, (src, lens), s, torch.ones(len(s)), chunk_size=5, profiler=prof, stats=stats)
    names = [r["section"] for r in prof.rows]
    chunks = [n for n in names if n.startswith("phase 2: chunk")]
    assert names[:2] == ["phase 1: search", "phase 2: encoder forward"] and names[-1] == "phase 2: encoder backward"
    assert len(chunks) == stats["chunks"] and all(n.endswith(" nodes") for n in chunks)  # a prefix tree's
    assert sum(int(n.split()[-2]) for n in chunks) == stats["nodes"] < stats["positions"]
    rows = StepProfiler(torch.device("cpu"))
    rescore_backward(model, (src, lens), s, torch.ones(len(s)), chunk_size=5, profiler=rows, prefix_sharing=False)
    assert sum(r["section"].startswith("phase 2: chunk of") for r in rows.rows) == -(-len(s) // 5)
    by_name = {r["section"]: r for r in prof.rows}
    assert by_name["phase 1: search"]["graph_mb"] == 0  # inference mode keeps no graph
    assert all(by_name[c]["graph_mb"] > 0 for c in chunks)
    table = prof.table()
    assert "largest autograd graph: phase 2: chunk" in table and "RSS peak MB" in table
    for r in prof.rows:  # CPU rows name the resident set for what it is, and its peak bounds it
        assert set(r) == {"section", "seconds", "rss_mb", "rss_peak_mb", "graph_mb"}
        assert r["rss_peak_mb"] >= r["rss_mb"] > 0


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="per-section RSS peaks need Linux")
def test_cpu_section_peak_sees_a_transient_allocation():
    prof = StepProfiler(torch.device("cpu"))
    size = 32 * 2**20
    with prof.section("quiet"):
        pass
    with prof.section("transient"):
        block = mmap.mmap(-1, size)  # fresh pages (malloc might reuse resident ones), returned on close
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        inside = rss_bytes() / 2**20
        block.close()
    quiet, transient = prof.rows
    assert transient["rss_peak_mb"] >= inside - 1 >= transient["rss_mb"] + 24
    assert quiet["rss_peak_mb"] - quiet["rss_mb"] < 8  # the high-water mark was reset: not the process's peak


@pytest.mark.parametrize("budget", [50_000, 400_000, 4_000_000])
def test_planned_chunk_fits_the_budget(budget):
    model = _model()
    src, lens = toy_batch(lengths=(5, 5, 5))
    s = beam_search(model, (src, lens), beam_size=16, max_len=8)
    c = ChunkPlanner(budget).chunk_size(model, (src, lens), s)
    assert 1 <= c <= len(s)
    used = graph_bytes(model, (src, lens), s, torch.ones(len(s)), chunk_size=c)
    assert used <= budget or c == 1
    if c < len(s):  # and it is not needlessly small: twice the rows would not fit (rows without shared prefixes:
        # the planner prices the worst case, and a tree chunk of as many rows may decode far fewer nodes)
        assert graph_bytes(model, (src, lens), s, torch.ones(len(s)), chunk_size=min(2 * c + 1, len(s)),
                           prefix_sharing=False) > 0.9 * budget


def test_planner_probes_again_for_longer_sources():
    model = _model()
    planner = ChunkPlanner(10**6)
    short, short_len = toy_batch(lengths=(2, 2))
    planner.chunk_size(model, (short, short_len), beam_search(model, (short, short_len), beam_size=4, max_len=5))
    first = planner.per_row_step
    assert planner.probed_source_size == 3  # elements per source: 2 tokens and a length
    long_, long_len = toy_batch(lengths=(9, 9))
    planner.chunk_size(model, (long_, long_len), beam_search(model, (long_, long_len), beam_size=4, max_len=5))
    assert planner.probed_source_size == 10 and planner.per_row_step > first  # attention reads S per row-step


def test_flag_parsers():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MB") == 512 * 10**6 and parse_size("1000") == 1000
    assert parse_chunk("auto") == "auto" and parse_chunk("64") == 64
    for bad in ("2 parsecs", "-1GB", "0", ""):
        with pytest.raises(Exception, match="expected a size"):
            parse_size(bad)


def test_train_with_profile_and_auto_chunk(tmp_path, capsys):
    import json

    from taskfiles import write_task
    from twophase.train import cli

    write_task(tmp_path / "train.tsv", "copy", 100)
    write_task(tmp_path / "valid.tsv", "copy", 8, seed=1)
    argv = ["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "valid.tsv"), "--hidden-size", "16",
            "--embed-dim", "8", "--mle-steps", "1", "--rl-steps", "2", "--batch-size", "4", "--beam-size", "4",
            "--max-len", "8", "--save-dir", str(tmp_path / "run"), "--profile-memory", "--rescore-chunk", "auto",
            "--memory-budget", "60KB"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "memory profile of step 1 (mle)" in out and "memory profile of step 2 (rl)" in out
    assert "phase 1: search" in out and "optimizer step" in out
    profile = [json.loads(x) for x in (tmp_path / "run" / "memory_profile.jsonl").read_text().splitlines()]
    assert [p["step"] for p in profile] == [1, 2, 3]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert all(1 <= r["chunk"] < r["candidates"] for r in rl)  # 60KB forces several chunks


def test_budget_includes_the_gradient_copy_of_retried_chunks(monkeypatch):
    """Where phase two retries out-of-memory chunks (CUDA), each chunk's gradient is collected before it is
    added: a copy of the trainable parameters' gradients alive with the chunk's graph, taken off the budget."""
    from twophase.phase2 import rescoring

    model = _model()
    src, lens = toy_batch(lengths=(5, 5, 5))
    s = beam_search(model, (src, lens), beam_size=16, max_len=8)
    copy = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    planner = ChunkPlanner(copy + 200_000)
    plain = planner.chunk_size(model, (src, lens), s)  # the CPU: chunks go straight into .grad, no copy
    monkeypatch.setattr(rescoring, "retries_out_of_memory", lambda device: True, raising=False)  # as on CUDA
    retried = planner.chunk_size(model, (src, lens), s)
    row_step = planner.per_row_step * s.tokens.shape[1]
    assert plain == min(len(s), int((copy + 200_000) // row_step))
    assert retried == max(1, min(len(s), int(200_000 // row_step))) < plain
