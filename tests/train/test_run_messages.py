"""What train.py says where a flag cannot mean anything or a run differs from what was asked: non-finite numbers,
--temperature with --objective policy, flags a resumed run must not keep or blame, --init-from --eval-only scoring
as its run did, batch sizes the data cannot fill, and a run of no steps naming no checkpoint."""
import json
import math

import pytest

from twophase.train import cli
from twophase.train.checkpoint import load, save_atomic
from twophase.config import Config

from taskfiles import task_dir

TINY = ["--hidden-size", "8", "--embed-dim", "4", "--batch-size", "3", "--mle-batch-size", "4", "--beam-size", "2",
        "--rescore-chunk", "5", "--max-len", "7", "--eval-beam", "1", "--no-compare-mle"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 6, 3)


def _argv(task, save, *flags):
    return ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(save), *TINY,
            *flags]


@pytest.fixture(scope="module")
def run(task, tmp_path_factory):
    """A finished run with a reward other than the task's default: 2 MLE steps, 1 RL step."""
    save = tmp_path_factory.mktemp("run") / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "2", "--rl-steps", "1", "--reward", "exact")) == 0
    return save


def _one_line(capsys, needle):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and needle in err, err


@pytest.mark.parametrize("flag, text", [("--kl-beta", "nan"), ("--top-p", "nan"), ("--lr", "inf"),
                                        ("--clip-norm", "nan"), ("--temperature", "inf"), ("--rl-lr", "Infinity")])
def test_non_finite_numbers_are_refused_in_one_line(flag, text, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parse([flag, text, "--save-dir", str(tmp_path)])
    assert stop.value.code == 2
    _one_line(capsys, f"argument {flag}: expected a finite number, got {text}")


@pytest.mark.parametrize("name", ["kl_beta", "top_p", "rl_lr", "lora_alpha"])
def test_a_config_built_in_python_refuses_non_finite_numbers_too(name):
    with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be a finite number, got nan"):
        Config(**{name: math.nan}).validate()


def test_temperature_with_the_policy_objective_is_refused(task, tmp_path, capsys):
    argv = _argv(task, tmp_path, "--objective", "policy", "--sampler", "sample", "--temperature", "0.7",
                 "--mle-steps", "0", "--rl-steps", "1")
    assert cli.main(argv) == 2
    _one_line(capsys, "--objective policy with --temperature 0.7: phase two's ratios and KL use the model's own")
    Config(objective="policy", sampler="sample", temperature=0.7, rl_steps=0).validate()  # RL never runs


def test_compile_given_on_resume_is_that_command_s_own(run, tmp_path):
    state = load(run / "checkpoint_last.pt")
    state["config"]["compile"] = "on"  # as a checkpoint written by `--resume --compile on` holds it
    save = tmp_path / "run"
    save.mkdir()
    save_atomic(state, save / "checkpoint_last.pt")
    cfg, _ = cli.parse(["--save-dir", str(save), "--resume"])
    assert cfg.compile == "off"
    cfg, _ = cli.parse(["--save-dir", str(save), "--resume", "--fsdp"])
    cfg.validate()  # no "--compile on does not combine with --fsdp"


def test_resume_with_hf_model_on_an_lstm_run_names_the_model_flag(run, tmp_path, capsys):
    assert cli.main(["--save-dir", str(run), "--resume", "--hf-model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "was trained with --hf-model (not set), not" in err and "--embed-dim" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert cli.main(["--init-from", str(run / "checkpoint_last.pt"), "--hf-model", str(tmp_path),
                     "--save-dir", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert "its model was built with --hf-model (not set)" in err and "--embed-dim" not in err, err


def test_init_from_eval_only_scores_as_resume_eval_only(run, capsys):
    cfg, _ = cli.parse(["--init-from", str(run / "checkpoint_last.pt"), "--eval-only"])
    assert (cfg.reward, cfg.mle_steps, cfg.rl_steps) == ("exact", 2, 1)
    capsys.readouterr()
    assert cli.main(["--save-dir", str(run), "--resume", "--eval-only"]) == 0
    resumed = capsys.readouterr().out.splitlines()
    assert cli.main(["--init-from", str(run / "checkpoint_last.pt"), "--eval-only"]) == 0
    started = capsys.readouterr().out.splitlines()
    assert started[1:] == resumed[1:] and any(line.startswith("reward") for line in started)


def test_batch_sizes_the_data_cannot_fill_are_named(task, tmp_path, capsys):
    assert cli.main(_argv(task, tmp_path / "a", "--mle-steps", "1", "--rl-steps", "1", "--batch-size", "8",
                          "--mle-batch-size", "7")) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "train.py: warning: --batch-size 8: the training data has 6 sources, so each RL step takes all 6",
        "train.py: warning: --mle-batch-size 7: the training data has 6 (source, reference) pairs, so each MLE "
        "step takes all 6"]
    assert cli.main(_argv(task, tmp_path / "b", "--mle-steps", "1", "--rl-steps", "0", "--batch-size", "8")) == 0
    assert "warning" not in capsys.readouterr().err  # no RL step: --batch-size is never used


def test_a_run_of_no_steps_names_no_checkpoint(task, tmp_path, capsys):
    assert cli.main(_argv(task, tmp_path / "run", "--mle-steps", "0", "--rl-steps", "0")) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "checkpoint_last.pt").exists()
    assert "checkpoint_last.pt" not in last and "metrics.jsonl" not in last
    assert last == "no training step taken (--mle-steps 0 --rl-steps 0): no checkpoint written"


def test_loss_type_gspo_points_to_the_sequence_level_ratio(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parse(["--loss-type", "gspo", "--save-dir", str(tmp_path)])
    assert stop.value.code == 2
    _one_line(capsys, "--loss-type: GSPO is a loss type's ratio per sequence: --importance-sampling-level sequence")


def test_init_from_a_hugging_face_run_into_lstm_sizes_names_the_model(task, tmp_path, capsys):
    pytest.importorskip("transformers")
    import hf_tiny

    folder = hf_tiny.save(tmp_path / "t5", "t5", seed=1)
    save = tmp_path / "t5run"
    assert cli.main(["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--hf-model", folder,
                     "--save-dir", str(save), "--batch-size", "3", "--mle-batch-size", "6", "--beam-size", "2",
                     "--max-len", "8", "--mle-steps", "1", "--rl-steps", "0", "--no-compare-mle"]) == 0
    capsys.readouterr()
    assert cli.main(_argv(task, tmp_path / "lstm", "--init-from", str(save / "checkpoint_last.pt"))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds a Hugging Face model (--hf-model {folder}), which --" in err, err
    assert "built with" not in err


def test_profile_memory_prints_a_step_of_many_chunks_in_a_few_lines():
    import torch
    from twophase.system.profiling import StepProfiler

    prof = StepProfiler(torch.device("cpu"))
    chunk = {"rss_mb": 10.0, "rss_peak_mb": 12.0}
    prof.rows = [{"section": "phase 1: search", "seconds": 0.5, "rss_mb": 9.0, "rss_peak_mb": 9.5, "graph_mb": 0.0}]
    prof.rows += [{"section": f"phase 2: chunk of 4 rows", "seconds": 0.01, **chunk, "graph_mb": 1.0 + (k == 7)}
                  for k in range(128)]
    prof.rows += [{"section": "optimizer step", "seconds": 0.1, "rss_mb": 9.0, "rss_peak_mb": 9.0, "graph_mb": 0.0}]
    lines = prof.table().splitlines()
    assert len(lines) < 10, "\n".join(lines)
    [merged] = [line for line in lines if line.startswith("phase 2: 128 chunks, 512 rows")]
    assert merged.split()[6:] == ["1280.0", "10.0", "12.0", "2.00"]  # ms summed; memory and graph the largest
    assert "largest autograd graph: phase 2: chunk of 4 rows (2.00 MB)" in lines


def test_a_ref_checkpoint_of_another_size_is_one_line_at_start_up(run, task, tmp_path, capsys):
    save = tmp_path / "wider"
    argv = _argv(task, save, "--mle-steps", "1", "--rl-steps", "1", "--objective", "policy", "--sampler", "sample",
                 "--kl-beta", "0.1", "--ref-checkpoint", str(run / "checkpoint_last.pt"))
    argv[argv.index("--hidden-size") + 1] = "12"
    assert cli.main(argv) == 2
    _one_line(capsys, f"--hidden-size: --ref-checkpoint {run / 'checkpoint_last.pt'}: its model was built with "
                      "--hidden-size 8, not 12")
    assert not (save / "metrics.jsonl").exists()  # refused before the MLE phase, not at the first RL step


def test_compile_reports_what_compiling_cost_in_the_closing_lines(task, tmp_path, capsys):
    assert cli.main(_argv(task, tmp_path / "c", "--mle-steps", "1", "--rl-steps", "0", "--compile", "eager")) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("compiled: ")]
    graphs, seconds = int(line.split()[1]), float(line.split(" in ")[1].split()[0])
    assert graphs >= 1 and seconds >= 0 and line.endswith("s (backend eager)"), line
    assert cli.main(_argv(task, tmp_path / "e", "--mle-steps", "1", "--rl-steps", "0")) == 0
    assert "compiled: " not in capsys.readouterr().out


def test_progress_lines_show_each_metric_in_its_fmt():
    from twophase.tasks import Metric
    from twophase.train.report import fmt_scores

    metrics = [Metric("len", "mean length", fmt="{:.2f}"), Metric("acc", "accuracy")]
    assert fmt_scores({"len": 2.375, "acc": 0.5, "reward": 0.25, "len@4": 2.0, "n": 3.0}, metrics) == \
        "len=2.38 acc=50.00% reward=0.2500 len@4=2.00"


def test_init_from_without_mle_steps_tests_no_end_of_mle_model(run, task, tmp_path, capsys):
    """--init-from --mle-steps 0: no MLE ran, so neither a `test (mle)` line nor a test row of model "mle" (the
    starting point is not a model the run made); the continued control and RL are tested."""
    save = tmp_path / "rl"
    assert cli.main(_argv(task, save, "--init-from", str(run / "checkpoint_last.pt"), "--mle-steps", "0",
                          "--rl-steps", "1", "--compare-mle", "--test", str(task / "valid.tsv"))) == 0
    out = capsys.readouterr().out
    assert "test (mle)" not in out and "test (rl)" in out and "test (mle-continued)" in out, out
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["model"] for r in rows if r.get("phase") == "test") == ["mle-continued", "rl"]


@pytest.mark.parametrize("flags, needle", [
    (["--max-len", "100000000"], "--max-len 100000000: "),
    (["--beam-size", "100000000"], "--beam-size 100000000, --max-len 7: phase one's search would hold about"),
    (["--eval-beam", "100000000"], "--eval-beam 100000000, --max-len 7: validation's beam search would hold"),
])
def test_sizes_the_machine_cannot_hold_are_refused_before_any_step(task, tmp_path, capsys, flags, needle):
    """A search (or chunk, or MLE step) sized past the memory available: one line naming the flags, their values
    and the bytes, exit 2, before any step (no checkpoint, no log; not the MLE steps lost at the first
    validation)."""
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "1", "--rl-steps", "1", *flags)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and needle in err, err
    assert "available on cpu; lower" in err, err
    assert not list(save.glob("checkpoint_*.pt")) and not (save / "metrics.jsonl").exists()


def test_the_memory_check_is_against_what_the_machine_has(task, tmp_path, capsys, monkeypatch):
    """The tiny run fits (every other test runs it); with 1 kB available its validation search (3 sources x 1 row
    of an 8-wide LSTM's state, its step, its 7 tokens and scores) does not."""
    from twophase.system import memory
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    assert cli.main(_argv(task, tmp_path / "run", "--mle-steps", "1", "--rl-steps", "0")) == 2
    _one_line(capsys, "more than the 1 KB available on cpu")


def test_threads_beyond_the_machine_s_cores_are_refused(task, tmp_path, capsys):
    import os
    cores = os.cpu_count()
    assert cli.main(_argv(task, tmp_path / "run", "--threads", str(cores + 1), "--mle-steps", "1",
                          "--rl-steps", "0")) == 2
    _one_line(capsys, f"--threads {cores + 1}: this machine has {cores} CPU cores (os.cpu_count()); give at most "
                      f"{cores}, or 0 (auto)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("text", ["99999999999999999999", "-1"])
def test_a_seed_no_generator_takes_is_refused_in_one_line(text, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parse(["--seed", text])
    assert stop.value.code == 2
    _one_line(capsys, f"argument --seed: must be in [0, 9223372036854775807], got {text}")
    with pytest.raises(ValueError, match=r"Config.seed: must be in \[0, 9223372036854775807\]"):
        Config(seed=int(text))


class _Code:
    """An object whose unpickling would call print: what a hostile weights file carries."""

    def __reduce__(self):
        return (print, ("unpickled code ran",))


def _pickled_folder(folder, kind: str, classifier: bool = False):
    """A save_pretrained folder whose weights are a pytorch_model.bin carrying pickled code, not safetensors."""
    import hf_tiny
    import torch

    if classifier:
        import transformers as T
        config = T.GPT2Config(vocab_size=hf_tiny.VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=64,
                              bos_token_id=hf_tiny.EOS, eos_token_id=hf_tiny.EOS, num_labels=1)
        T.GPT2ForSequenceClassification(config).save_pretrained(folder)
        hf_tiny.tokenizer().save_pretrained(folder)
    else:
        hf_tiny.save(folder, kind)
    (folder / "model.safetensors").unlink()
    torch.save({"weight": _Code()}, folder / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="module")
def pickled(tmp_path_factory):
    """A T5 folder and a reward model's whose weights carry pickled code, a plain T5 folder (a student) and a
    checkpoint carrying pickled code; made outside any test's captured stderr (transformers' log handler keeps
    the stream it first sees)."""
    pytest.importorskip("transformers")
    import hf_tiny
    import torch

    d = tmp_path_factory.mktemp("pickled")
    _pickled_folder(d / "t5", "t5")
    _pickled_folder(d / "reward", "gpt2", classifier=True)
    hf_tiny.save(d / "student", "t5")
    torch.save({"config": {}, "model": {}, "code": _Code()}, d / "teacher.pt")
    return d


def test_files_carrying_pickled_code_get_the_project_s_line_not_torch_s_advice(task, pickled, capsys):
    """--hf-model, --teacher (a folder, a checkpoint) and --reward hf: with a file that carries pickled code: one
    line of the project's (as --resume's), nothing executed, and never torch's advice to load it with
    weights_only=False. A text file as --teacher is named as what it is."""
    tmp_path = pickled
    t5, reward = tmp_path / "t5", tmp_path / "reward"
    capsys.readouterr()
    words = "refused: its weights file carries pickled Python objects (only tensors and plain data are loaded, never"
    distill = ["--objective", "distill", "--mle-steps", "0", "--rl-steps", "1"]
    for flags, needle in [
            (["--hf-model", str(t5), "--max-len", "12"], f"--hf-model {t5}: cannot load the model ({words}"),
            ([*distill, "--hf-model", str(tmp_path / "student"), "--teacher", str(t5), "--max-len", "12"],
             f"--teacher {t5}: cannot load the model ({words}"),
            ([*distill, "--teacher", str(tmp_path / "teacher.pt")],
             f"--teacher {tmp_path / 'teacher.pt'}: refused: the checkpoint contains pickled Python objects"),
            ([*distill, "--teacher", str(task / "train.tsv")],
             f"--teacher {task / 'train.tsv'}: not a twophase checkpoint (not a file torch.save wrote)"),
            (["--reward", f"hf:{reward}"], f"--reward hf:{reward}: cannot load the model or its tokenizer ({words}")]:
        argv = ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir",
                str(tmp_path / "run"), "--batch-size", "3", "--beam-size", "2", "--no-compare-mle", *flags]
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        err = captured.err
        assert len(err.strip().splitlines()) == 1 and needle in err, err
        assert "weights_only" not in err and "unpickled code ran" not in captured.out + err
