"""train.py's start-up with a task built: verifier-only tasks train RL only, shaping flags a task does not read
are refused, per-task defaults (--help, --save-dir), and a broken model named before any step."""
import json
from pathlib import Path

import pytest
import torch

from twophase import ModelError
from twophase.train import cli, recipe
from twophase.config import Config

from taskfiles import task_dir

VERIFIER = ["--task", "verifier_task:Verifier", "--hidden-size", "8", "--batch-size", "4", "--beam-size", "2",
            "--max-len", "5", "--eval-every", "3", "--log-every", "0"]


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_a_verifier_only_task_trains_rl_end_to_end(tmp_path, capsys):
    """No example has a reference: --mle-steps 0 trains RL on the source-reading reward, no comparison asked."""
    save = tmp_path / "run"
    assert cli.main([*VERIFIER, "--mle-steps", "0", "--rl-steps", "3", "--save-dir", str(save)]) == 0
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [1, 2, 3]
    assert {r["phase"] for r in rows} == {"rl", "eval"}  # no MLE, no continued MLE
    assert all(0 <= r["reward"] <= 1 for r in rows if r["phase"] == "eval")
    assert torch.load(save / "checkpoint_last.pt", weights_only=True)["step"] == 3


@pytest.mark.parametrize("flags, needle", [
    (["--mle-steps", "2"], "--mle-steps 2: task 'verifier_task:Verifier' has no references"),
    (["--mle-steps", "0", "--compare-mle"], "--compare-mle: task"),
    (["--mle-steps", "0", "--mle-weight", "0.5"], "--mle-weight 0.5"),
])
def test_asking_a_verifier_only_task_for_mle_is_one_line(tmp_path, capsys, flags, needle):
    assert cli.main([*VERIFIER, "--rl-steps", "1", "--save-dir", str(tmp_path / "r"), *flags]) == 2
    _one_line_error(capsys, needle)


@pytest.mark.parametrize("argv, flag, task", [
    (VERIFIER + ["--dropout", "0.1"], "--dropout", "verifier_task:Verifier"),
    (VERIFIER + ["--bidirectional", "--embed-dim", "4"], "--bidirectional, --embed-dim", "verifier_task:Verifier"),
    (["--task", "karel", "--char-source"], "--char-source", "karel"),
    (["--task", "karel", "--bidirectional"], "--bidirectional", "karel"),
    (["--task", "g2p", "--lowercase-source"], "--lowercase-source", "g2p"),
    (["--task", "g2p", "--karel-model", "paper"], "--karel-model", "g2p"),  # another task's own section
    (["--task", "karel", "--countdown-numbers", "4"], "--countdown-numbers", "karel"),
    (["--task", "g2p", "--countdown-hidden", "0.5"], "--countdown-hidden", "g2p"),
    (["--train", "t.tsv", "--valid", "v.tsv", "--train-size", "5"], "--train-size", "tsv"),
])
def test_a_shaping_flag_the_task_does_not_read_is_refused(tmp_path, capsys, argv, flag, task):
    """Refused before any data is read (Karel's would be generated) or any file opened."""
    assert cli.main([*argv, "--save-dir", str(tmp_path / "r")]) == 2
    _one_line_error(capsys, f"{flag}: task '{task}' does not read")


def test_help_shows_the_tasks_own_defaults(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--task", "karel", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "LSTM hidden size of encoder and decoder (default: 128)" in text  # Karel's recipe, not 256
    assert "(default: 16)" in text  # its beam
    with pytest.raises(SystemExit):
        cli.main(["--task", "karel", "--help", "run"])  # every run's own section, whole
    assert "runs/<task>" in " ".join(capsys.readouterr().out.split())


def test_save_dir_defaults_to_runs_of_the_task(tmp_path, monkeypatch, tmp_path_factory):
    data = task_dir(tmp_path_factory, 20, 4)
    monkeypatch.chdir(tmp_path)
    cfg = Config(train=str(data / "train.tsv"), valid=str(data / "valid.tsv"), hidden_size=8, embed_dim=4)
    assert recipe.setup(cfg).save_dir == Path("runs/tsv")  # a TSV run never writes into runs/g2p
    cfg = Config(task="verifier_task:Verifier", hidden_size=8, mle_steps=0)
    assert recipe.setup(cfg).save_dir == Path("runs/verifier")


def test_a_broken_model_is_named_at_start_up(tmp_path, capsys):
    argv = [*VERIFIER, "--mle-steps", "0", "--rl-steps", "1", "--save-dir", str(tmp_path / "r")]
    argv[1] = "verifier_task:NaNVerifier"
    assert cli.main(argv) == 2
    _one_line_error(capsys, "model check: finite: NaNModel")
    assert not (tmp_path / "r" / "checkpoint_last.pt").exists()


def test_nan_log_probabilities_mid_run_name_the_model_and_the_step(tmp_path):
    """A model that turns NaN after start-up: the step that met it, never a source silently dropped."""
    cfg = Config(task="verifier_task:Verifier", hidden_size=8, batch_size=4, beam_size=2, max_len=5, mle_steps=0,
                 rl_steps=3, eval_every=10, log_every=0, save_dir=str(tmp_path))
    trainer = recipe.setup(cfg)
    model, real, calls = trainer.trainer.model, trainer.trainer.model.log_probs, []

    def log_probs(state):
        calls.append(1)
        out = real(state)
        return out if len(calls) < 8 else out.index_fill(0, torch.tensor([0]), float("nan"))
    model.log_probs = log_probs
    with pytest.raises(ModelError, match=r"^step \d \[rl\]: Seq2Seq returned NaN log-probabilities"):
        trainer.train()


def test_a_task_without_references_turns_the_control_off_beside_the_config(capsys):
    """Data without references cannot continue MLE: a recipe's control (a task's flag_defaults, not a flag the
    user gave) is off for the run (the recipe records it in the run's own Config), and the Config it was given still
    says what the recipe asked."""
    from types import SimpleNamespace
    from twophase.train import recipe
    cfg = Config(mle_steps=0, compare_mle=True)
    task = SimpleNamespace(train=[SimpleNamespace(references=[])], spec="verifier")
    assert recipe.mle_possible(cfg, task, frozenset()) is False
    assert cfg.compare_mle is True and cfg == Config(mle_steps=0, compare_mle=True)
    assert "--compare-mle cannot run" in capsys.readouterr().out
    with_refs = SimpleNamespace(train=[SimpleNamespace(references=["a"])], spec="tsv")
    assert recipe.mle_possible(cfg, with_refs, frozenset()) is True
    assert recipe.mle_possible(Config(compare_mle=False), with_refs, frozenset()) is False
