"""train.py --help: the sections this command uses (its task, model and objective, from its flags, --config file
and checkpoint), the others named; --help all every section, --help SECTION one, an unknown one refused in one
line. A flag --help leaves out of a command is one the configuration's checks refuse in that command."""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from twophase.config import FIELDS, KINDS, ORDER, SECTIONS, Config, _flag, section_fields
from twophase.tasks.countdown.task import Countdown
from twophase.tasks.hf import HFTSV
from twophase.tasks.karel.task import Karel
from twophase.config.shown import EVERY_RUN
from twophase.train import cli
from twophase.tasks import TaskError, check_flags as check_task_flags

FLAG = re.compile(r"^  (--[a-z0-9-]+)", re.M)  # a flag's own line in a group, as argparse indents it


def help_text(capsys, monkeypatch, *argv) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # argparse's and the closing paragraph's width
    with pytest.raises(SystemExit) as stop:
        cli.main(list(argv))
    assert stop.value.code == 0
    out = capsys.readouterr()
    assert out.err == ""
    return out.out


def groups(text: str) -> set[str]:
    return {name for name in SECTIONS if f"\n{name}:\n" in text}


def test_the_default_command_shows_its_sections_and_names_the_others(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--help")
    # Countdown, the LSTM, --objective beam; every run's own sections named with their flags, not printed in full
    assert groups(text) == set(SECTIONS) - {"karel", "lora", "policy"} - set(EVERY_RUN)
    every_run = text[text.index("Every run's own sections"):text.index("Not shown")]
    assert re.search(r"\n  run +its recipe and seed, directory, checkpoints and logs", every_run)
    assert {"--save-dir", "--resume", "--rescore-chunk", "--device"} <= set(re.findall(r"--[a-z0-9-]+", every_run))
    closing = text[text.index("Not shown"):]
    assert re.search(r"\n  karel +the Karel task's model and reward \(with --task karel\)", closing)
    assert re.search(r"\n  lora +LoRA adapters on a Hugging Face model \(with --hf-model\)", closing)
    assert re.search(r"\n  policy +the token-level policy objective \(with --objective policy\)", closing)
    assert "--help all" in " ".join(every_run.split()) and "--help SECTION" in every_run
    assert "--char-source" not in FLAG.findall(text)  # Countdown splits its own text
    assert re.search(r"--char-source, [^()]*--hf-model \(not read by --task countdown\)", " ".join(closing.split()))
    everything = help_text(capsys, monkeypatch, "--help", "all")
    assert len(text.splitlines()) < 0.75 * len(everything.splitlines())
    assert "--task countdown's own defaults" in " ".join(text.split())  # the recipe's defaults, as before


def test_the_task_picks_its_own_section(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--task", "karel", "--help")
    assert "karel" in groups(text) and "countdown" not in groups(text)
    assert "--karel-model" in FLAG.findall(text) and "--countdown-numbers" not in FLAG.findall(text)
    assert "LSTM hidden size of encoder and decoder (default: 128)" in " ".join(text.split())  # Karel's recipe
    assert re.search(r"\n  countdown +the Countdown task's generated problems \(with --task countdown\)", text)
    assert text == help_text(capsys, monkeypatch, "-h", "--task", "karel")  # -h, before the flags or after


def test_the_objective_picks_its_section_and_flags(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--objective", "policy", "--help")
    assert "policy" in groups(text)
    flags = FLAG.findall(text)
    assert {"--loss-type", "--kl-beta", "--sapo-temperature-pos"} <= set(flags)  # the loss type is the user's
    assert "--mrt-alpha" not in flags and "--teacher" not in flags  # other objectives'
    assert "--mrt-alpha (with --objective mrt)" in " ".join(text[text.index("Not shown"):].split())
    assert "--mrt-alpha" in FLAG.findall(help_text(capsys, monkeypatch, "--help"))  # --objective not moved


def test_a_hugging_face_model_shows_lora_not_the_lstm(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--hf-model", "folder", "--train", "t.tsv", "--valid", "v.tsv", "--help")
    assert {"model", "lora"} <= groups(text)
    flags = FLAG.findall(text)
    assert "--hf-model" in flags and "--lora-r" in flags
    assert not {"--hidden-size", "--embed-dim", "--char-source"} & set(flags)


def test_a_config_file_and_a_checkpoint_are_the_commands_too(capsys, monkeypatch, tmp_path):
    (tmp_path / "run.yaml").write_text("objective: policy\n")
    assert "policy" in groups(help_text(capsys, monkeypatch, "--config", str(tmp_path / "run.yaml"), "--help"))
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": {}, "config": dataclasses.asdict(Config(objective="policy", hidden_size=24))},
               run / "checkpoint_last.pt")
    text = help_text(capsys, monkeypatch, "--resume", "--save-dir", str(run), "--help")
    assert "policy" in groups(text)
    flat = " ".join(text.split())
    assert "LSTM hidden size of encoder and decoder (default: 24)" in flat and "the checkpoint --resume reads" in flat
    text = help_text(capsys, monkeypatch, "--resume", "--save-dir", str(tmp_path / "none"), "--help")
    assert "policy" not in groups(text) and "No checkpoint read" in text  # help still, with what it knows


def test_help_all_shows_every_section_and_flag(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--objective", "policy", "--help", "all")
    assert groups(text) == set(SECTIONS)
    assert [f for f in FLAG.findall(text) if f not in ("--help", "--config", "--print-config")] == \
        [_flag(name) for name in ORDER]
    assert "Not shown" not in text


def test_help_section_shows_that_one(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "--help", "policy")
    assert groups(text) == {"policy"}
    assert [f for f in FLAG.findall(text) if f != "--help"] == [_flag(n) for n in section_fields("policy")]


def test_an_unknown_section_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--task", "karel", "--help", "polcy"])
    assert stop.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert "no section 'polcy' (did you mean policy?)" in out.err
    assert all(name in out.err for name in SECTIONS)


def _other_value(name: str):
    """A valid value of the field other than its default (within its range)."""
    f, kind = FIELDS[name], KINDS[name][0]
    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != f.default)
    if kind == "bool":
        return not f.default
    if kind == "int":
        return (f.default or 0) + 1
    if kind == "float":
        return f.default / 2 if f.default else 0.5
    return "x"  # a path or a name: the checks that refuse an inert flag read no file


@pytest.mark.parametrize("argv, values, task", [
    ([], {}, Countdown),
    (["--objective", "policy"], dict(objective="policy"), Countdown),
    (["--task", "karel"], dict(task="karel"), Karel),
    (["--hf-model", "folder", "--train", "t.tsv", "--valid", "v.tsv"],
     dict(hf_model="folder", train="t.tsv", valid="v.tsv"), HFTSV),
])
def test_a_flag_left_out_is_one_the_command_refuses(capsys, monkeypatch, argv, values, task):
    """Against the configuration's own checks and the task's declaration of the flags it reads: each flag --help
    leaves out of this command (but those of every run's own sections, which it names), given, makes no Config,
    or is a data, model or task flag its task does not read (refused when the run starts)."""
    text = help_text(capsys, monkeypatch, *argv, "--help")
    named = set(re.findall(r"--[a-z0-9-]+", text[text.index("Every run's own sections"):text.index("Not shown")]))
    shown = set(FLAG.findall(text))
    left_out = [n for n in ORDER if _flag(n) not in shown and _flag(n) not in named]
    assert left_out
    if values.get("objective") == "policy":  # accepted beside the policy objective, as before the conditions
        left_out.remove("mrt_alpha")         # were declared (tests/config/test_config_sections.py)
    reader = SimpleNamespace(flags=task.flags, flag_defaults=task.flag_defaults, spec="it")
    for name in left_out:
        try:
            Config(**values, **{name: _other_value(name)})
        except ValueError as err:
            assert _flag(name) in str(err)
        else:
            with pytest.raises(TaskError, match=re.escape(_flag(name))):
                check_task_flags(reader, frozenset({name}))
