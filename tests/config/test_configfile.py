"""`train.py --config FILE` and `--print-config`: the file's place among the defaults, its one-line errors, and a
run's own config.json reproducing that run bit for bit (same process, same kernels, same shapes)."""
import json
import re
from pathlib import Path

import pytest
import torch

from twophase import tasks
from twophase.tasks.base import Task
from twophase.train import cli
from twophase.config import file as configfile

from taskfiles import small_task_here

TINY = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8",
        "--beam-size", "3", "--rescore-chunk", "5", "--max-len", "8", "--eval-every", "4", "--no-picture"]


@pytest.fixture
def task(tmp_path, monkeypatch):
    return small_task_here(tmp_path, monkeypatch)


@pytest.fixture
def seen(monkeypatch):
    """The (Config, given) main() would train with (the run itself is replaced)."""
    runs = []
    monkeypatch.setattr(cli, "_train", lambda cfg, start=None, given=None: runs.append((cfg, given)) or 0)
    return runs


def test_layers_defaults_recipe_preset_file_command_line(seen, monkeypatch, tmp_path):
    class Recipe(Task):
        flag_defaults = dict(rl_steps=3, dropout=0.1, beam_size=4, hidden_size=12)

    monkeypatch.setattr(tasks, "get", lambda name: Recipe)
    path = tmp_path / "run.yaml"
    path.write_text("dropout: 0.2\neval-every: 7\nmle_batch_size: 5\nbatch_size: 32\n")
    assert cli.main(["--preset", "g2p-long", "--config", str(path), "--mle-batch-size", "6"]) == 0
    cfg, given = seen[0]
    assert cfg.beam_size == 4 and cfg.hidden_size == 12  # the task's recipe, over Config's defaults
    assert cfg.rl_steps == 500  # --preset, over the recipe
    assert cfg.dropout == 0.2 and cfg.eval_every == 7  # the file, over the preset
    assert cfg.mle_batch_size == 6  # the command line, over the file
    assert cfg.lr == 2e-3  # nothing sets it: Config's default
    # given: the flags, and the file's values that change a default (batch_size: 32 is the default)
    assert {"dropout", "eval_every", "mle_batch_size", "preset"} <= given and not {"batch_size", "rl_steps"} & given

    path.write_text("preset: g2p-long\n")  # the file may name the preset (and task) whose recipe applies
    assert cli.main(["--config", str(path)]) == 0
    assert seen[1][0].rl_steps == 500 and seen[1][0].preset == "g2p-long"


def test_yaml_reads_on_off_as_strings_and_1e_4_as_a_number(seen, tmp_path):
    path = tmp_path / "run.yml"
    path.write_text("# a comment\ngrammar: on\ncompile: off\nlr: 1e-4\nrl-lr: 2.5E-5\nbidirectional: true\n"
                    "rescore_chunk: auto\nmemory_budget: 2GiB\ntemperature: 1\n")
    assert cli.main(["--config", str(path)]) == 0
    cfg = seen[0][0]
    assert (cfg.grammar, cfg.compile, cfg.lr, cfg.rl_lr, cfg.bidirectional) == ("on", "off", 1e-4, 2.5e-5, True)
    assert (cfg.rescore_chunk, cfg.memory_budget) == ("auto", "2GiB")
    assert cfg.temperature == 1.0 and isinstance(cfg.temperature, float)


@pytest.mark.parametrize("name, text, match", [
    ("a.yaml", "hidden_size: 16\nlrr: 3\n", "a.yaml:2: lrr: unknown key (did you mean lr?)"),
    ("a.yaml", "hidden_size: 1.5\n", "a.yaml:1: hidden_size: expected an integer, got 1.5"),
    ("a.yaml", "bidirectional: yes\n", "a.yaml:1: bidirectional: expected true or false, got \"yes\""),
    ("a.yaml", "sampler: greedy\n", "a.yaml:1: sampler: expected one of beam, sample, sbs, got \"greedy\""),
    ("a.yaml", "beam_size: 0\n", "a.yaml:1: beam_size: must be >= 1, got 0"),
    ("a.yaml", "rescore_chunk: lots\n", "a.yaml:1: rescore_chunk: expected a number of rows or 'auto'"),
    ("a.yaml", "lr: .nan\n", "a.yaml:1: lr: expected a finite number"),
    ("a.yaml", "seed: 1\n\noverwrite: true\n", "a.yaml:3: overwrite: what a command does with a run is said on "
                                               "its command line (--overwrite)"),
    ("a.yaml", "lr: 0.1\nmax-len: 9\nmax_len: 9\n", "a.yaml:3: max_len: given twice (as max-len too)"),
    ("a.yaml", "lr: 0.1\nlr: 0.2\n", "a.yaml:2: lr: given twice"),
    ("a.yaml", "lr: [1\n", "a.yaml:2: not valid YAML"),
    ("a.yaml", "- lr\n", "a.yaml: expected a mapping of Config fields"),
    ("a.json", '{\n "lr": "fast"\n}', "a.json:2: lr: expected a number, got \"fast\""),
    ("a.json", '{"lr": 1,}', "a.json:1: not valid JSON"),
    ("a.toml", "lr = 1\n", "--config a.toml: a configuration file ends in .yaml, .yml or .json"),
])
def test_a_bad_file_is_one_line_naming_it_exit_2(name, text, match, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    assert cli.main(["--config", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and match in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name, text", [
    ("s.yaml", "seed: 3\nsearch:\n  beam_size: 6\n  max-len: 9\nmle:\n  lr: 0.004\nmodel: {hidden_size: 12}\n"),
    ("s.json", '{"seed": 3, "search": {"beam_size": 6, "max-len": 9}, "mle": {"lr": 0.004},\n'
               ' "model": {"hidden_size": 12}}'),
])
def test_a_file_may_hold_fields_in_their_sections(name, text, seen, tmp_path):
    """`search: {beam_size: 6}` is `beam_size: 6`: the same Config and the same given fields as the flat file."""
    (tmp_path / name).write_text(text)
    flat = tmp_path / "flat.yaml"
    flat.write_text("seed: 3\nbeam_size: 6\nmax_len: 9\nlr: 0.004\nhidden_size: 12\n")
    assert cli.main(["--config", str(tmp_path / name)]) == 0 and cli.main(["--config", str(flat)]) == 0
    (sectioned, given), (plain, plain_given) = seen
    assert sectioned == plain and given == plain_given
    assert (sectioned.beam_size, sectioned.max_len, sectioned.lr, sectioned.hidden_size) == (6, 9, 0.004, 12)


@pytest.mark.parametrize("name, text, match", [
    ("a.yaml", "seed: 1\nsearch:\n  beam_size: 4\n  lr: 0.1\n",
     "a.yaml:4: search.lr: lr is in the mle section, not search (python train.py --help mle)"),
    ("a.yaml", "search:\n  beem_size: 4\n", "a.yaml:2: search.beem_size: unknown key (did you mean beam_size?)"),
    ("a.yaml", "search: 4\n", "a.yaml:1: search: a section holds its fields as key: value, got 4"),
    ("a.yaml", "search:\n  beam_size: 0\n", "a.yaml:2: search.beam_size: must be >= 1, got 0"),
    ("a.yaml", "beam_size: 4\nsearch:\n  beam_size: 5\n",
     "a.yaml:3: search.beam_size: given twice (as beam_size too)"),
    ("a.yaml", "search:\n  beam_size: 4\n  beam_size: 5\n", "a.yaml:3: search.beam_size: given twice"),
    ("a.yaml", "run:\n  overwrite: true\n", "a.yaml:2: run.overwrite: what a command does with a run is said"),
    ("a.json", '{"search":\n {"lr": 0.1}}', "a.json:2: search.lr: lr is in the mle section, not search"),
    ("a.yaml", "seed: 1\nbogus.seed: 3\n", "a.yaml:2: bogus.seed: unknown key"),  # a dotted key is no section
    ("a.yaml", "search.lr: 0.1\n", "a.yaml:1: search.lr: unknown key"),
    ("a.json", '{"seed": 1,\n "search.beam_size": 4}', "a.json:2: search.beam_size: unknown key"),
])
def test_a_bad_section_is_one_line_naming_the_file_and_line(name, text, match, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    assert cli.main(["--config", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and match in err and err.count("\n") == 1, err


def test_print_config_writes_the_sections_of_help(task, capsys):
    """--print-config's YAML is in --help's sections, each field under its own section and every field once."""
    from twophase.config import SECTION_OF, SECTIONS

    assert cli.main(["--train", "train.tsv", "--valid", "valid.tsv", *TINY, "--print-config"]) == 0
    section, placed = None, {}
    for line in capsys.readouterr().out.splitlines()[1:]:
        if not line.startswith(" "):
            section = line.split(":")[0]
            assert section in SECTIONS, line
        else:
            placed[line.strip().split(":")[0]] = section
    assert placed == {k: v for k, v in SECTION_OF.items() if k not in configfile.COMMAND_ONLY}


def test_a_missing_file_and_missing_pyyaml(tmp_path, monkeypatch, capsys):
    assert cli.main(["--config", str(tmp_path / "none.yaml")]) == 2
    assert f"--config {tmp_path / 'none.yaml'}: no such file" in capsys.readouterr().err
    (tmp_path / "a.yaml").write_text("lr: 0.1\n")
    monkeypatch.setattr(configfile, "_yaml_loader", lambda: None)  # as without PyYAML installed
    assert cli.main(["--config", str(tmp_path / "a.yaml")]) == 2
    assert "reading YAML needs PyYAML: pip install pyyaml" in capsys.readouterr().err


def test_print_config_prints_what_config_reads_back_and_writes_nothing(task, capsys):
    flags = ["--train", "train.tsv", "--valid", "valid.tsv", "--objective", "mrt", "--mrt-alpha", "0.25",
             "--save-dir", "somewhere", *TINY, "--rescore-chunk", "auto", "--memory-budget", "1GiB"]
    assert cli.main([*flags, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert not (task / "somewhere").exists() and not (task / "runs").exists()  # nothing trained or created
    (task / "printed.yaml").write_text(printed)
    assert cli.resolve(["--config", "printed.yaml"])[0] == cli.resolve(flags)[0]
    assert "resume:" not in printed and "save_dir: \"somewhere\"" in printed  # the command's own: not a file's


def _losses(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["phase"], r["step"], r["loss"]) for r in rows if r["phase"] in ("mle", "rl")]


def test_a_runs_config_json_reproduces_it_bit_exactly(task, capsys):
    first = ["--train", "train.tsv", "--valid", "valid.tsv", "--mle-steps", "6", "--rl-steps", "3", "--seed", "3",
             "--objective", "mrt", "--mrt-alpha", "0.3", "--no-compare-mle", "--save-dir", "a", "--overwrite", *TINY]
    assert cli.main(first) == 0
    assert cli.main(["--config", "a/config.json", "--save-dir", "b"]) == 0
    assert _losses(task / "a") == _losses(task / "b") and len(_losses(task / "a")) == 9
    one, two = (torch.load(task / d / "checkpoint_last.pt", weights_only=True)["model"] for d in "ab")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    record = json.loads((task / "b" / "config.json").read_text())["config"]
    assert record == {**json.loads((task / "a" / "config.json").read_text())["config"], "save_dir": "b",
                      "overwrite": False}

    # What the record says of the command that wrote it is not taken: no --save-dir a, no --overwrite
    cfg = cli.resolve(["--config", "a/config.json"])[0]
    assert (cfg.save_dir, cfg.overwrite, cfg.resume, cfg.mrt_alpha) == (None, False, False, 0.3)
    capsys.readouterr()
    assert cli.main(["--config", "a/config.json", "--save-dir", "a"]) == 2  # never into the run it came from
    assert "--save-dir a already holds a run" in capsys.readouterr().err

    # --resume with --config: the checkpoint's configuration, the file's values over it, under the resume rules
    (task / "more.yaml").write_text("rl_steps: 4\n")
    assert cli.resolve(["--resume", "--save-dir", "a", "--config", "more.yaml"])[0].rl_steps == 4
    # --init-from: its checkpoint's model flags over Config's defaults, the file over them
    init = cli.resolve(["--init-from", "a/checkpoint_last.pt", "--config", "more.yaml", "--save-dir", "c"])[0]
    assert (init.hidden_size, init.rl_steps, init.train) == (16, 4, "train.tsv")
    (task / "other.yaml").write_text("seed: 9\n")
    assert cli.main(["--resume", "--save-dir", "a", "--config", "other.yaml"]) == 2
    assert "was trained with --seed 3, not 9" in capsys.readouterr().err


def test_the_docs_example_file_reads(tmp_path):
    page = (Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text()
    text = re.search(r"^```yaml\n(.*?)^```", page, flags=re.S | re.M).group(1)
    (tmp_path / "run.yaml").write_text(text)
    assert configfile.read(tmp_path / "run.yaml") == dict(
        train="data/train.tsv", valid="data/valid.tsv", hidden_size=128, objective="mrt", mrt_alpha=0.3,
        grammar="on", rl_lr=1e-4)


def test_an_ambiguous_flag_is_one_line(capsys):
    # --t could be --task, --train, ...: the command line is parsed once, by the one parser of every flag
    with pytest.raises(SystemExit) as info:
        cli.main(["--t", "x"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("train.py: error: ambiguous option: --t could match --task, --train, --test"), err
