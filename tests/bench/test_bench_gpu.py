"""`python -m benchmarks.gpu`: its CPU dry run (--device cpu --quick), under CUDA's deterministic rules
(tests/guards.py), runs or skips every section with a reason and writes one report of the documented structure; a
failing or hanging section is recorded and the rest go on; the wheel list covers what the GPU machine lacks of
setup.cfg's requirements."""
import configparser
import json
import re
import time
from pathlib import Path

import pytest

from benchmarks.gpu import largestbeam, runner, wheels

import forks

ROOT = Path(__file__).resolve().parents[2]


def test_quick_dry_run_runs_every_section_or_skips_it_with_a_reason(tmp_path):
    out = tmp_path / "report.json"
    # under what CUDA refuses with deterministic algorithms on, and the suite's RNN guards (tests/guards.py):
    # section (a)'s deterministic setting and every other section run as they would on a GPU; a fresh interpreter
    # forked from one that imported torch (tests/forks.py)
    proc = forks.run(argv=[ROOT / "tests" / "guards.py", "-m", "benchmarks.gpu", "--device", "cpu", "--quick",
                           "--inline", "--out", out], cwd=tmp_path, timeout=900,
                     env={"TWOPHASE_CACHE_DIR": str(tmp_path / "cache"), "OUT": None})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"report written: {out}" in proc.stdout
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"] and report["complete"]
    sections = report["sections"]
    assert list(sections) == list(runner.SECTIONS)
    for letter, outcome in sections.items():
        assert outcome["status"] in ("ok", "skipped"), (letter, outcome)
        assert outcome["seconds"] >= 0
        assert outcome["status"] == "ok" or outcome["reason"]
        assert f"({letter}) " in proc.stdout  # the summary has a line per section
    assert sections["f"]["status"] == "skipped" and "2 CUDA devices" in sections["f"]["reason"]

    a = sections["a"]["result"]
    models = {r["model"] for r in a["rows"]}
    assert models == {"lstm", "karel", "karel-paper", "gpt2", "t5"}
    assert {r["setting"] for r in a["rows"]} == {"default", "deterministic"}
    assert {"tree/collect", "tree/direct", "rows/collect", "rows/direct"} <= {r["mode"] for r in a["rows"]}
    assert a["failed_cases"] == 0 and a["max_rel_error"] < 1e-5
    assert a["deterministic_repeats_bitwise_equal"] is True

    b = sections["b"]["result"]
    assert [m["method"] for m in b["methods"]] == ["two-phase", "one-phase"] and not b["errors"]
    two, one = b["methods"]
    assert two["host_syncs"]["phase_two_chunks"] >= 1 and two["host_syncs"]["phase_one_per_decoder_step"] > 0
    assert one["step_s"] > 0 and "rss_peak_above_start_mib" in one
    assert "needs a CUDA device" in two["host_syncs"]["cuda"]["skipped"]  # CUDA's own count: CUDA only

    c = sections["c"]["result"]
    assert c["simulated"] and c["budget_chunk"] < c["rows"] == c["asked_chunk"]
    tried = c["chunk_sizes_tried"]
    assert tried[0] == c["rows"] and tried[-1] <= c["budget_chunk"] and c["out_of_memory_errors"] == len(tried) - 1
    assert all(x // 2 == y for x, y in zip(tried, tried[1:]))  # halved each time
    assert c["rel_error_vs_budget_chunks"] < 1e-5

    d = sections["d"]["result"]
    assert d["bf16"]["loss_finite"] and d["bf16"]["gradients_finite"]
    assert d["float32"]["score_max_abs_diff_nats"] < 1e-4
    assert "needs a CUDA device" in d["fp16"]["skipped"]
    assert d["float32"]["chunked_vs_whole_rel_diff"] < 1e-5 and d["bf16"]["chunked_vs_whole_rel_diff"] < 3e-2
    dtypes = d["bf16"]["recurrent_dtypes"]
    assert dtypes["twophase"]["layers"]["LSTM"]  # the hook saw the encoder's LSTM
    if dtypes["rnns_in_float32"]:  # no bf16 LSTM kernel here (oneDNN without AVX-512): twophase runs it in float32
        assert dtypes["twophase"]["layers"]["LSTM"] == ["float32"]

    e = sections["e"]["result"]
    assert {(r["model"], r["search"]) for r in e["results"]} == {(m, s) for m in ("t5", "causal")
                                                                 for s in ("sample", "beam")}
    assert all("step_ms" in r["twophase"] and "step_ms" in r["generate"] for r in e["results"])

    g = sections["h"]["result"]
    assert g["preset"] == "karel-paper" and g["mle"]["steps_per_s"] > 0 and g["rl"]["steps_per_s"] > 0
    assert g["paper_schedule_hours"] > 0

    h = sections["g"]["result"]  # the real steps at toy sizes: one-phase's graph outgrows the simulated card
    assert h["card"]["simulated"] and set(h["methods"]) == {"one-phase", "two-phase"} and h["at_k"] == largestbeam.QUICK_AT_K
    one, two = h["methods"]["one-phase"], h["methods"]["two-phase"]
    assert one["stopped"] == "bisected" and one["first_failing_k"] <= h["k_max"]
    assert two["largest_k"] == h["k_max"] and two["stopped"] == "k_max"  # two-phase's graph: a chunk's, any K
    assert one["at_k"]["fits"] and two["at_k"]["graph_peak_bytes"] < one["at_k"]["graph_peak_bytes"]


def _sections(monkeypatch, functions: dict):
    monkeypatch.setattr(runner, "section_function", lambda letter: functions[letter])


def test_a_failing_skipped_or_hanging_section_is_recorded_and_the_rest_go_on(monkeypatch):
    def broken(options):
        raise ValueError("no such kernel\nsecond line")

    def skipped(options):
        raise runner.Skip("needs a GPU")

    def hangs(options):
        time.sleep(30)

    _sections(monkeypatch, {"a": broken, "b": skipped, "c": hangs, "d": lambda options: {"fine": 1}})
    start = time.perf_counter()
    out = runner.run_all("abcd", {"device": "cpu"}, inline=True, limits=dict(a=5, b=5, c=0.3, d=5),
                         log=lambda *a, **k: None)
    assert time.perf_counter() - start < 10
    assert out["a"]["status"] == "error" and out["a"]["error"] == "ValueError: no such kernel"
    assert out["b"] == {"status": "skipped", "reason": "needs a GPU", "seconds": out["b"]["seconds"]}
    assert out["c"]["status"] == "timeout" and "limit" in out["c"]["error"]
    assert out["d"]["status"] == "ok" and out["d"]["result"] == {"fine": 1}


def test_an_isolated_section_reports_from_its_own_process_and_is_killed_at_its_limit():
    outcome = runner.run_isolated("f", {"device": "cpu", "quick": True, "limit_s": 120})
    assert outcome["status"] == "skipped" and "2 CUDA devices" in outcome["reason"]
    start = time.perf_counter()
    outcome = runner.run_isolated("f", {"device": "cpu", "quick": True, "limit_s": 0.05})  # still importing
    assert outcome["status"] == "timeout" and time.perf_counter() - start < 30


@pytest.mark.parametrize("argv, flag", [(["--sections", "a,z"], "--sections"), (["--device", "tpu:x"], "--device"),
                                        (["--karel-seconds", "0"], "--karel-seconds"), (["--budget", "-5"], "--budget")])
def test_bad_flags_are_refused_in_one_line(argv, flag, capsys):
    from benchmarks.gpu.__main__ import main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and flag in capsys.readouterr().err.splitlines()[-1]


def test_the_wheels_cover_every_requirement_the_gpu_machine_lacks():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    required = [re.split(r"[<>=!~ ;\[]", line.strip(), maxsplit=1)[0].lower()
                for line in cfg["options"]["install_requires"].splitlines() if line.strip()
                and not line.strip().startswith("#")]
    fetched = {re.split(r"[<>=!~ ]", r, maxsplit=1)[0].lower(): r for r in wheels.REQUIREMENTS}
    assert required and all(name in fetched or name in wheels.INSTALLED for name in required), required
    pins = [line.strip() for line in cfg["options"]["install_requires"].splitlines() if "==" in line]
    assert all(pin in wheels.REQUIREMENTS for pin in pins)  # the same pinned release
    command = wheels.command(Path("w"))
    assert command[command.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in command


def test_a_cudnn_refusal_of_eval_mode_rnn_backward_is_measured_again_without_cudnn():
    import torch
    from benchmarks.gpu.common import CUDNN_EVAL_BACKWARD, cudnn_retry
    calls = []

    def case(x):
        calls.append(torch.backends.cudnn.enabled)
        if len(calls) == 1:
            raise RuntimeError(CUDNN_EVAL_BACKWARD)
        return x + 1

    was = torch.backends.cudnn.enabled
    assert cudnn_retry(case, 1) == (2, f"RuntimeError: {CUDNN_EVAL_BACKWARD}")
    assert calls == [was, False] and torch.backends.cudnn.enabled == was
    with pytest.raises(RuntimeError, match="other"):
        cudnn_retry(lambda: (_ for _ in ()).throw(RuntimeError("other")))
