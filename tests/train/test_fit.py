"""`twophase.fit`: train.py as a Python call, checked against train.py itself (the same flags, the reward named
by `module:callable`): the same losses, parameters and closing table; reward functions in both signatures, a
user's task and model (resumed), and bad input raised as train.py's one line, never an exit."""
import dataclasses
import json

import pytest
import torch

import twophase
from twophase.tasks.text import TSV
from twophase.config import Config
from twophase.train import cli, fit, recipe

from taskfiles import small_task_here

SIZES = dict(hidden_size=16, embed_dim=8, batch_size=4, mle_batch_size=8, beam_size=3, rescore_chunk=5, max_len=8,
             eval_every=4, picture=False, compare_mle=False, mle_steps=4, rl_steps=2)
FLAGS = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size",
         "3", "--rescore-chunk", "5", "--max-len", "8", "--eval-every", "4", "--no-picture", "--no-compare-mle",
         "--mle-steps", "4", "--rl-steps", "2"]
CALLS = []


def overlap(hypotheses, references):
    """Tokens of the hypothesis in its first reference, over the reference's length."""
    CALLS.append(len(hypotheses))
    return [len(set(h.split()) & set(r[0].split())) / max(len(r[0].split()), 1) for h, r in zip(hypotheses, references)]


def starts_like_source(hypotheses, references, *, sources):
    """Source-aware: 1 where the hypothesis starts with the source's last token (the task reverses)."""
    return [float(bool(h.split()) and h.split()[0] == s.split()[-1]) for h, s in zip(hypotheses, sources)]


def trl_length(prompts, completions, **kwargs):
    """TRL's signature: shorter completions score higher."""
    return [-len(c.split()) / 8 for c in completions]


@pytest.fixture
def data(tmp_path, monkeypatch):
    return small_task_here(tmp_path, monkeypatch)


def config(**more):
    return twophase.Config(train="train.tsv", valid="valid.tsv", **{**SIZES, **more})


def _run(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    model = torch.load(folder / "checkpoint_last.pt", weights_only=True)["model"]
    return [(r["phase"], r["step"], r["loss"]) for r in rows if r["phase"] in ("mle", "rl")], model


def _same(a, b):
    (losses_a, model_a), (losses_b, model_b) = a, b
    return losses_a == losses_b and model_a.keys() == model_b.keys() and all(
        torch.equal(model_a[k], model_b[k]) for k in model_a)


def test_fit_with_a_python_reward_is_train_py(data, capsys):
    CALLS.clear()
    result = twophase.fit(config(save_dir="py"), reward=overlap)
    printed = capsys.readouterr().out
    assert CALLS and result.run_dir == data / "py" and result.table in printed
    assert result.config.reward == "test_fit:overlap" and "reward test_fit:overlap" in printed
    assert result.summary["rl"]["steps"] == 2 and result.summary["mle"]["steps"] == 4
    assert result.last_checkpoint == data / "py" / "checkpoint_last.pt" and result.best_metric == "reward"
    assert isinstance(result.model, torch.nn.Module)
    # train.py with the same flags and the function by name: the same run, the same closing table's numbers
    assert cli.main(["--train", "train.tsv", "--valid", "valid.tsv", *FLAGS, "--reward", "test_fit:overlap",
                     "--save-dir", "cli"]) == 0
    assert _same(_run(data / "py"), _run(data / "cli"))
    table = capsys.readouterr().out
    steady = [line for line in result.table.splitlines() if "time" not in line and "steps/s" not in line
              and "memory" not in line]
    assert all(line in table for line in steady)


@pytest.mark.parametrize("reward", [starts_like_source, trl_length, [overlap, trl_length]])
def test_fit_takes_either_reward_signature_and_a_list(data, reward, capsys):
    weights = "1,0.5" if isinstance(reward, list) else None
    result = twophase.fit(config(save_dir="r", rl_steps=1, reward_weights=weights), reward=reward)
    rows = [json.loads(line) for line in (data / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [5] and result.summary["rl"]["steps"] == 1
    if isinstance(reward, list):
        assert result.config.reward == "test_fit:overlap,test_fit:trl_length"
        assert {"reward/overlap/mean", "reward/trl_length/mean"} <= rows[-2].keys() | rows[-1].keys() | {
            k for r in rows for k in r}


def test_fit_with_a_users_task_and_model_resumes_it(data, capsys):
    straight = twophase.fit(config(save_dir="straight", rl_steps=3))

    def parts():
        task = TSV(config())
        task.load_data()
        torch.manual_seed(1)  # --seed's draw of the task's own model: the same start as train.py's
        return task, task.build_model()

    task, model = parts()
    first = twophase.fit(config(save_dir="mine", rl_steps=1), task=task, model=model)
    assert first.model is model and first.config.task == "twophase.tasks.text:TSV"
    task, model = parts()  # a fresh program: the same task and architecture, the checkpoint's parameters
    twophase.fit(config(save_dir="mine", rl_steps=3, resume=True), task=task, model=model)
    assert _same(_run(data / "straight"), _run(data / "mine"))
    assert straight.summary["rl"]["steps"] == 3
    task, model = parts()
    scores = twophase.fit(config(save_dir="mine", resume=True, eval_only=True), task=task, model=model)
    assert scores.summary["valid"]["n"] == 8 and "examples" in scores.table


def one_value(hyps, refs):
    return [0.0]


def test_bad_input_raises_train_pys_one_line(data):
    with pytest.raises(ValueError, match="^--train and --valid go together$"):
        twophase.fit(twophase.Config(train="train.tsv", save_dir="x"))
    with pytest.raises(ValueError, match="^Config.hidden_size: expected an integer, got \"16\"$"):
        twophase.fit(config(hidden_size="16"))
    with pytest.raises(ValueError, match="^--eval-only evaluates a checkpoint: add --resume"):
        twophase.fit(config(save_dir="x", eval_only=True))
    with pytest.raises(ValueError, match="name two rewards: give one"):
        twophase.fit(config(reward="edit"), reward=overlap)
    wrong = r"^reward 'test_fit:one_value' returned 1 values for 3 hypotheses"  # named by module:qualname
    with pytest.raises(twophase.rewards.RewardError, match=wrong):
        twophase.fit(config(save_dir="y"), reward=one_value)
    assert not (data / "x").exists()


def test_fit_reads_a_config_file_as_train_py_does(data, capsys):
    (data / "run.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in {**SIZES, "rl_steps": 1}.items())
                                   + "train: train.tsv\nvalid: valid.tsv\nsave_dir: f\n")
    result = twophase.fit(data / "run.yaml")
    assert cli.main(["--config", "run.yaml", "--save-dir", "g"]) == 0
    assert result.run_dir == data / "f" and _same(_run(data / "f"), _run(data / "g"))


def test_a_task_instance_brings_its_recipe(data, monkeypatch):
    class Shorter(TSV):
        flag_defaults = dict(rl_steps=1, beam_size=2)

    class Typo(TSV):
        flag_defaults = dict(rl_stepz=1)

    sizes = {k: v for k, v in SIZES.items() if k not in ("rl_steps", "beam_size")}
    cfg = twophase.Config(train="train.tsv", valid="valid.tsv", save_dir="s", **sizes)
    result = twophase.fit(cfg, task=Shorter(cfg))
    assert (result.config.rl_steps, result.config.beam_size) == (1, 2) and result.summary["rl"]["steps"] == 1
    assert result.config.task.endswith("test_a_task_instance_brings_its_recipe.<locals>.Shorter")
    with pytest.raises(ValueError, match="its flag_defaults name no flag: rl_stepz$"):
        twophase.fit(cfg, task=Typo(cfg))


def test_the_config_given_is_unchanged_by_build_and_fit(data):
    """build derives the task's name, the save dir, the reward and the best metric into the run's own Config;
    the one it was given, and the one given to fit, stay as they were, field by field."""
    given = config(save_dir="run", mle_steps=2, rl_steps=1)
    before = dataclasses.asdict(given)
    cfg, start, flags = fit.resolved(given)
    resolved = dataclasses.asdict(cfg)
    training = recipe.setup(cfg, start, flags)
    assert (training.trainer.cfg.task, training.trainer.cfg.reward, training.trainer.cfg.best_metric) == ("tsv", "edit", "reward")
    assert (cfg.task, cfg.reward, cfg.best_metric) == (None, None, "auto")
    assert dataclasses.asdict(cfg) == resolved and cfg == Config(**resolved)
    result = twophase.fit(given)
    assert dataclasses.asdict(given) == before and given == Config(**before)
    assert (result.config.task, result.config.reward, result.config.save_dir) == ("tsv", "edit", "run")
    for f in dataclasses.fields(Config):
        assert getattr(given, f.name) == before[f.name], f.name
