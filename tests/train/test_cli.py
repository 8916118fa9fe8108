"""train.py end to end (one run in a fresh interpreter), decoding, and clean refusal of bad input."""
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from twophase.train import cli, decode, recipe
from twophase.config import Config

import forks
from taskfiles import write_task

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8",
        "--beam-size", "3", "--rescore-chunk", "5", "--max-len", "8", "--eval-every", "10"]


@pytest.fixture
def task(tmp_path):
    write_task(tmp_path / "train.tsv", "reverse", 200, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 20, seed=1)
    return tmp_path


def test_train_py_end_to_end_then_decode(task, capsys):
    save = task / "run"
    proc = forks.run(  # python train.py ..., in a fresh interpreter forked from one that imported torch
        argv=[ROOT / "train.py", "--train", task / "train.tsv", "--valid", task / "valid.tsv", "--mle-steps", "20",
              "--rl-steps", "6", "--compare-mle", "--save-dir", save, *TINY, "--log-every", "5"], timeout=120,
        cwd=task)
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if "end of MLE" in line)
    assert header.split() == ["end", "of", "MLE", "MLE", "continued", "RL"] and "peak memory" in proc.stdout
    assert "valid token error rate" in proc.stdout and "phoneme" not in proc.stdout  # TSV data: not G2P's words
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ") and "steps/s" in line]
    assert [line.split()[1] for line in progress] == ["5/26", "10/26", "15/26", "20/26", "25/26"]  # no tty: lines
    assert "[rl] loss=" in progress[-1] and "reward_mean=" in progress[-1] and "lr=0.0002" in progress[-1]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] in ("mle", "rl")] == list(range(1, 27))
    assert {r["phase"] for r in rows} == {"mle", "rl", "eval", "mle-continued"}  # no --test: no test row
    assert all(r["lr"] == (2e-3 if r["phase"] == "mle" else 2e-4) for r in rows if r["phase"] != "eval")
    continued = [r for r in rows if r["phase"] == "mle-continued"]  # --compare-mle (the default): after RL,
    assert [r["step"] for r in continued] == list(range(21, 21 + len(continued))) and continued  # from step 20
    assert all(r["time"].endswith("Z") and r["elapsed_s"] >= 0 for r in rows)
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)
    assert all("reward_mean" in r for r in rows if r["phase"] == "rl")
    # phase two decodes each distinct (source, prefix) once: never more nodes than candidate token positions
    # (RL steps whose coefficients are all 0 decode nothing and carry no counts)
    assert all(0 < r["prefix_nodes"] <= r["prefix_positions"] for r in rows if "prefix_nodes" in r)
    assert all("prefix_nodes" in r for r in rows if r["phase"] == "mle")
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [(r["step"], r["after"]) for r in evals][:3] == [(10, "mle"), (20, "mle"), (26, "rl")]
    assert evals[-1]["after"] == "mle-continued" and evals[-1]["continued"] == len(continued)
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["step"] == 26 and state["phase"] == "rl" and "model" in state

    (task / "in.txt").write_text("a b c\n\ng\n")
    out = task / "out.txt"
    assert decode.main(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", str(task / "in.txt"),
                        "--output", str(out), "--beam-size", "2"]) == 0
    lines = out.read_text().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one line out per line in
    assert capsys.readouterr().err == ""  # every source token was seen in training

    (task / "in.txt").write_text("a b z\nA b\n\nZ z\n")  # the TSV was not lower-cased: A is as unknown as z
    assert decode.main(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", str(task / "in.txt"),
                        "--output", str(out)]) == 0
    assert capsys.readouterr().err == "twophase-decode: 4 unknown source tokens (in 3 lines), e.g. 'z', 'A', 'Z'\n"
    _fails_with_one_line(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", str(task / "in.txt"),
                          "--output", str(task / "missing" / "out.txt")], capsys, "missing", entry=decode.main)


def test_g2p_task_runs_on_cmudict(tmp_path, capsys):
    # greedy and short outputs: the test split (3,143 words) is decoded in full at the end
    assert cli.main(["--task", "g2p", "--mle-steps", "2", "--rl-steps", "1", "--valid-size", "16",
                     "--hidden-size", "16", "--embed-dim", "8", "--batch-size", "2", "--beam-size", "2", "--eval-beam", "1",
                     "--max-len", "6", "--save-dir", str(tmp_path), "--no-compare-mle"]) == 0
    out = capsys.readouterr().out
    assert "119810 train / 3099 valid / 3143 test" in out and "test phoneme error rate" in out
    assert "MLE continued" not in out  # --no-compare-mle: the final model alone is tested
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["n"], r["model"]) for r in rows if r["phase"] == "test"] == [(3, 3143, "rl")]
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["task"]["spec"] == "g2p" and state["config"]["task"] == "g2p" and state["config"]["reward"] == "edit"
    assert state["task"]["state"]["char_source"] is True  # decode splits words into letters
    assert state["task"]["state"]["fold_case"] is True and state["config"]["best_metric"] == "word_acc"
    model, task, cfg = decode.load_model(str(tmp_path / "checkpoint_last.pt"), torch.device("cpu"))
    [hyp], _ = decode.decode_lines(model, task, ["hello"], 2, 6, 8, torch.device("cpu"))
    assert hyp and all(t in task.tgt_vocab.stoi for t in hyp.split())
    (tmp_path / "in.txt").write_text("hello\nHello\nHELLO\n")
    assert decode.main(["--checkpoint", str(tmp_path / "checkpoint_last.pt"), "--input", str(tmp_path / "in.txt"),
                        "--output", str(tmp_path / "out.txt"), "--beam-size", "2"]) == 0
    assert len(set((tmp_path / "out.txt").read_text().splitlines())) == 1  # case-folded as in training
    assert capsys.readouterr().err == ""  # and so no unknown letters


def _fails_with_one_line(argv, capsys, match, entry=cli.main):
    try:
        code = entry(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert match in err, err


@pytest.mark.parametrize("argv,match", [
    (["--rescore-chunk", "0"], "--rescore-chunk"),
    (["--beam-size", "0"], "--beam-size"),
    (["--max-len", "-1"], "--max-len"),
    (["--rescore-chunk", "many"], "--rescore-chunk"),
    (["--sampler", "greedy"], "--sampler"),
    (["--reward", "no-such-reward"], "unknown reward 'no-such-reward'"),
    (["--reward", "no_such_module:fn"], "no_such_module"),
    (["--train", "missing.tsv", "--valid", "missing.tsv"], "missing.tsv: no such file"),
    (["--train", "x.tsv"], "--train and --valid go together"),
    (["--mle-weight", "1.5"], "--mle-weight"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
    (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs a CUDA device"),
    (["--amp", "fp32"], "--amp"),
    (["--objective", "reinforce", "--sampler", "sample", "--temperature", "0.7"],
     "--objective reinforce with --temperature 0.7 is biased"),
    (["--temperature", "0.7"], "--temperature applies to --sampler sample only"),
    (["--beam-size", "1"], "--beam-size 1 with --objective beam trains nothing"),
    (["--beam-size", "1", "--objective", "mrt", "--sampler", "sample"], "--beam-size 1 with --objective mrt"),
    (["--beam-size", "1", "--objective", "reinforce", "--sampler", "sample"],
     "--beam-size 1 with --objective reinforce --baseline mean trains nothing"),
    (["--beam-size", "1", "--objective", "reinforce", "--baseline", "mean"], "--baseline mean trains nothing"),
    (["--beam-size", "1", "--objective", "reinforce", "--baseline", "loo"], "--baseline loo needs --beam-size"),
    (["--objective", "mrt", "--mrt-alpha", "0"], "--mrt-alpha 0 with --objective mrt trains nothing"),
    (["--mrt-alpha", "0.2"], "--mrt-alpha applies to --objective mrt only, not --objective beam"),
    (["--baseline", "mean"], "--baseline applies to --objective reinforce only, not --objective beam"),
    (["--baseline", "none", "--objective", "mrt"], "--baseline applies to --objective reinforce only"),
    (["--memory-budget", "2GiB"], "--memory-budget applies to --rescore-chunk auto only, not --rescore-chunk 128"),
    (["--memory-budget", "2GiB", "--rl-steps", "0"], "--memory-budget applies to --rescore-chunk auto only"),
    (["--include-reference", "--objective", "mrt"], "--include-reference applies to --objective beam or distill only"),
    (["--karel-reward-pairs", "shown"], "--karel-reward-pairs applies to --task karel only"),
    (["--compile", "fast"], "--compile"),
    (["--compile", "on", "--fsdp"], "--compile on does not combine with --fsdp"),
])
def test_bad_flags_exit_2_with_one_line(argv, match, capsys, tmp_path):
    _fails_with_one_line(argv + ["--save-dir", str(tmp_path / "run")], capsys, match)


@pytest.mark.parametrize("flags", [
    dict(rl_steps=0, beam_size=1, baseline="mean", temperature=0.5),  # MLE only: the RL flags are never read
    dict(rl_steps=0, objective="reinforce", sampler="sample", temperature=0.5),
    dict(beam_size=1, objective="reinforce", baseline="none"),
    dict(beam_size=1, objective="reinforce", baseline="greedy"),
    dict(objective="reinforce", sampler="sample", baseline="loo", beam_size=2),
    dict(objective="mrt", sampler="sample", temperature=0.5),
    dict(objective="mrt", mrt_alpha=0.2),
    dict(rescore_chunk="auto", memory_budget="2GiB"),
])
def test_configurations_that_train_are_accepted(flags):
    Config(**flags).validate()


def test_reinforce_baseline_defaults_to_mean():
    assert Config(objective="reinforce").reinforce_baseline == "mean"
    assert Config(objective="reinforce", baseline="loo").reinforce_baseline == "loo"


def test_reinforce_with_beam_search_warns_once(task, tmp_path, capsys):
    """Biased but it trains: one warning line naming the unbiased choices, then the run goes on."""
    argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--mle-steps", "1",
            "--rl-steps", "1", "--objective", "reinforce", "--save-dir", str(tmp_path / "run"), *TINY]
    assert cli.main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["train.py: warning: --objective reinforce with --sampler beam is biased (beam candidates "
                        "are not samples of the model); unbiased: --sampler sample, or --objective beam"]
    assert Config(objective="reinforce", sampler="sample").warnings() == []
    assert Config(objective="reinforce", rl_steps=0).warnings() == []
    assert Config(objective="beam").warnings() == []


def test_bad_tsv_line_is_named(tmp_path, capsys):
    (tmp_path / "t.tsv").write_text("a b\tb a\nno tab here\n")
    _fails_with_one_line(["--train", str(tmp_path / "t.tsv"), "--valid", str(tmp_path / "t.tsv"),
                          "--save-dir", str(tmp_path / "run")], capsys, f"{tmp_path / 't.tsv'}:2:")


def test_decode_refuses_bad_input(tmp_path, capsys):
    _fails_with_one_line(["--checkpoint", str(tmp_path / "none.pt")], capsys, "none.pt: no such file",
                         entry=decode.main)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    _fails_with_one_line(["--checkpoint", str(tmp_path / "bad.pt")], capsys, "bad.pt", entry=decode.main)


def test_threads_default_to_one_for_small_models(monkeypatch):
    from twophase.config import Config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert recipe.cpu_threads(Config(hidden_size=256)) == 1
    assert recipe.cpu_threads(Config(hidden_size=512)) is None  # torch's default: one per core
    assert recipe.cpu_threads(Config(hidden_size=256, threads=3)) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert recipe.cpu_threads(Config(hidden_size=256)) is None  # the user's (or torchrun's) choice stands


def test_every_flag_has_help():
    for action in cli.build_parser()._actions:
        assert action.help, action.dest


def test_resume_without_save_dir_continues_in_the_tasks_own(tmp_path, monkeypatch, capsys):
    """--resume alone: the run in the directory a run of the same flags writes (the recipe's runs/countdown, a
    built-in task's runs/<task>), as one line where it holds no checkpoint; not a traceback."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--resume"]) == 2
    assert capsys.readouterr().err == "train.py: error: --resume: runs/countdown/checkpoint_last.pt: no such file\n"
    assert cli.main(["--task", "g2p", "--resume"]) == 2
    assert "--resume: runs/g2p/checkpoint_last.pt: no such file" in capsys.readouterr().err
    (tmp_path / "runs" / "countdown").mkdir(parents=True)
    recorded = Config(task="countdown", hidden_size=24, max_len=12, grammar="on")
    torch.save({"model": {}, "config": asdict(recorded)}, tmp_path / "runs" / "countdown" / "checkpoint_last.pt")
    cfg, start = cli.parse(["--resume"])
    assert start is not None and cfg.hidden_size == 24  # the checkpoint's configuration
    assert cfg.save_dir == "runs/countdown"  # the run continues where its checkpoint is
