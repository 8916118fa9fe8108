"""The memory figures a run reports: on CUDA the allocator's peak allocated AND reserved bytes, on the CPU the
process's resident set, each labelled; and a peak for the whole run that --profile-memory's per-section resets do
not lower. CUDA's allocator is faked (its peak functions monkeypatched) on the CPU."""
import pytest
import torch

from twophase.system import memory
from twophase.system.profiling import StepProfiler
from twophase.train import report

MB = 2**20


class FakeAllocator:
    """High-water marks that reset to the current use, as torch.cuda.reset_peak_memory_stats does."""

    def __init__(self, monkeypatch):
        self.now = {"allocated": 0, "reserved": 0}
        self.peak = dict(self.now)
        for name, fn in {"max_memory_allocated": lambda d=None: self.peak["allocated"],
                         "max_memory_reserved": lambda d=None: self.peak["reserved"],
                         "memory_allocated": lambda d=None: self.now["allocated"],
                         "reset_peak_memory_stats": lambda d=None: self.peak.update(self.now),
                         "synchronize": lambda d=None: None}.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(memory, "_overall", {})

    def use(self, allocated_mb, reserved_mb):
        self.now = {"allocated": allocated_mb * MB, "reserved": reserved_mb * MB}
        self.peak = {k: max(self.peak[k], v) for k, v in self.now.items()}


def test_profiling_resets_do_not_lower_the_runs_peak(monkeypatch):
    gpu, device = FakeAllocator(monkeypatch), torch.device("cuda", 0)
    gpu.use(900, 1200)  # a step's peak before profiling
    gpu.use(100, 1000)
    profiler = StepProfiler(device)
    with profiler.section("phase 1: search"):
        gpu.use(300, 1000)
        gpu.use(100, 1000)
    assert profiler.rows[0]["peak_allocated_mb"] == 300 and profiler.rows[0]["peak_reserved_mb"] == 1000
    assert report.peak_memory_mb(device) == 900
    assert memory.overall_mb(device) == {"peak_allocated_mb": 900, "peak_reserved_mb": 1200}
    assert "peak resv MB" in profiler.table()


def test_the_closing_table_labels_cudas_allocated_and_reserved_and_the_cpus_rss():
    cuda = report.summary_table({"rl": {}, "peak_memory_mb": 900.0, "peak_allocated_mb": 900.0,
                                 "peak_reserved_mb": 1200.0})
    assert [line.split()[-1] for line in cuda.splitlines() if line.startswith("peak memory")] == ["900M", "1200M"]
    assert "peak memory allocated (CUDA)" in cuda and "peak memory reserved (CUDA)" in cuda
    cpu = report.summary_table({"rl": {}, "peak_memory_mb": 500.0, "peak_rss_mb": 500.0})
    assert [line for line in cpu.splitlines() if line.startswith("peak memory")] == [
        f"{'peak memory (process RSS)':26}{500:>15.0f}M"]


def test_the_cpu_peak_is_the_resident_sets_through_resets(monkeypatch):
    monkeypatch.setattr(memory, "_overall", {})
    readings = iter([800 * MB, 50 * MB, 60 * MB])
    monkeypatch.setattr(memory, "rss_peak_bytes", lambda: next(readings))
    monkeypatch.setattr(memory, "reset_rss_peak", lambda: None)
    memory.reset(torch.device("cpu"))  # folds 800
    assert memory.overall_mb(torch.device("cpu")) == {"peak_rss_mb": 800}  # 50 now, 800 kept
    assert memory.overall(torch.device("cpu")) == {"rss": 800 * MB}


def test_a_search_row_s_state_is_the_lstm_s_h_and_c():
    """row_state_bytes against the architecture: the built-in LSTM's decoder state per row is its h and c
    (2 x hidden float32), whatever the source's length (the encoding the rows share is not theirs)."""
    from twophase.models.seq2seq import Seq2Seq
    from twophase.system.memory import row_state_bytes

    torch.manual_seed(0)
    model = Seq2Seq(30, 40, 8, 24, 0.0, False)
    for length in (3, 50):
        source = (torch.randint(3, 30, (2, length)), torch.tensor([length, length]))
        state, step, vocab = row_state_bytes(model, source)
        assert (state, vocab) == (2 * 24 * 4, 40)
        assert step >= 2 * 24 * 4 + 40 * 4  # a step makes at least the new h, c and the row's log-probabilities
