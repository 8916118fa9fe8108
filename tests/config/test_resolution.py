"""The layers resolved once, as data: a value the user set (on the command line, in a --config file, passed to
twophase.Config) wins over the task's recipe and --preset even where it equals Config's default; every field of
every built-in recipe and preset is checked so, through all three (resolution only: nothing is trained);
--print-config says where each value came from."""
import dataclasses

import pytest

import twophase
from twophase.config import FIELDS, PRESETS, Config
from twophase.config import file as configfile
from twophase.config.layers import Layer, resolve
from twophase.tasks.karel.task import Karel
from twophase.tasks.text import G2P, TSV
from twophase.train import cli, fit

# (task, preset, the layer whose every field is set to Config's default)
RECIPES = [("g2p", None, G2P.flag_defaults), ("tsv", None, getattr(TSV, "flag_defaults", None) or {}),
           ("karel", None, Karel.flag_defaults), ("g2p", "g2p-long", PRESETS["g2p-long"]),
           ("karel", "karel-paper", PRESETS["karel-paper"])]
CASES = [(task, preset, name) for task, preset, layer in RECIPES for name in layer]


def _flags(name: str, value) -> list[str]:
    """The command line that sets `name` to `value` (None cannot be typed: no flag)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    return [flag, str(value)]


def _named(task: str, preset: str | None) -> dict:
    return dict(task=task, **({"preset": preset} if preset else {}))


def test_a_recipe_field_is_recipes_where_the_user_sets_nothing():
    assert fit.resolved(Config(task="g2p"))[0].lr_decay == 0.5  # so the tests below can fail
    assert cli.resolve(["--task", "karel"])[0].hidden_size == 128
    assert cli.resolve(["--preset", "g2p-long"])[0].dropout == 0.3


@pytest.mark.parametrize("task, preset, name", CASES)
def test_a_recipe_or_preset_field_set_to_configs_default_is_the_users(task, preset, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = FIELDS[name].default
    layer = dict(RECIPES[[r[:2] for r in RECIPES].index((task, preset))][2])
    # twophase.fit(Config(...)): passed to the constructor, equal to the default, still the user's
    cfg = fit.resolved(Config(**_named(task, preset), **{name: default}))[0]
    assert getattr(cfg, name) == default, (name, getattr(cfg, name), layer[name])
    # a --config file
    lines = [f"{k}: {v}" for k, v in _named(task, preset).items()]
    (tmp_path / "run.yaml").write_text("\n".join(lines + [f"{name}: {configfile.json.dumps(default)}"]) + "\n")
    assert getattr(cli.resolve(["--config", "run.yaml"])[0], name) == default
    assert getattr(fit.resolved("run.yaml")[0], name) == default
    # the command line
    if default is not None:
        argv = [part for k, v in _named(task, preset).items() for part in _flags(k, v)] + _flags(name, default)
        assert getattr(cli.resolve(argv)[0], name) == default, argv


def test_fit_and_a_file_run_lr_decay_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = fit.resolved(twophase.Config(task="g2p", lr_decay=1.0, mle_steps=4000))[0]
    assert (cfg.lr_decay, cfg.mle_steps) == (1.0, 4000)
    (tmp_path / "run.yaml").write_text("task: g2p\nlr_decay: 1.0\n")
    cfg = cli.resolve(["--config", "run.yaml"])[0]
    assert (cfg.lr_decay, cfg.mle_steps) == (1.0, 10000)  # the recipe's where the file sets nothing


def test_the_layers_rank_and_say_where_each_value_came_from():
    cfg, origins = resolve([Layer("recipe", dict(lr_decay=0.5, mle_steps=10)), Layer("preset", dict(mle_steps=20)),
                            Layer("file", dict(lr_decay=1.0)), Layer("command line", dict(seed=3))])
    assert (cfg.lr_decay, cfg.mle_steps, cfg.seed) == (1.0, 20, 3)
    assert origins == dict(lr_decay="file", mle_steps="preset", seed="command line")
    # a layer alone need not be a valid Config: --train in one, --valid in another
    cfg, _ = resolve([Layer("file", dict(train="t.tsv")), Layer("command line", dict(valid="v.tsv"))])
    assert (cfg.train, cfg.valid) == ("t.tsv", "v.tsv")
    with pytest.raises(ValueError, match="^file: names no flag: hiden_size$"):
        resolve([Layer("file", dict(hiden_size=3))])


def test_print_config_shows_each_values_origin(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("rl_lr: 0.001\n")
    assert cli.main(["--task", "g2p", "--config", "run.yaml", "--seed", "3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "  lr_decay: 0.5  # --task g2p's recipe\n" in out
    assert "  rl_lr: 0.001  # --config run.yaml\n" in out and "  seed: 3  # command line\n" in out
    assert "  beam_size: 8\n" in out  # Config's default: no comment
    (tmp_path / "printed.yaml").write_text(out)
    assert cli.resolve(["--config", "printed.yaml"])[0] == cli.resolve(["--task", "g2p", "--config", "run.yaml",
                                                                         "--seed", "3"])[0]


def test_the_command_line_is_parsed_once(monkeypatch):
    calls = []
    parse = cli.OneLineParser.parse_args

    def counted(self, *args, **kwargs):
        calls.append(1)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(cli.OneLineParser, "parse_args", counted)
    cli.resolve(["--task", "karel", "--preset", "karel-paper", "--seed", "2"])
    assert len(calls) == 1


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_an_empty_file_is_refused_in_one_line(text, tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text(text)
    assert cli.main(["--config", str(tmp_path / "empty.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train.py: error: {tmp_path / 'empty.yaml'}: sets nothing") and err.count("\n") == 1


def test_dropout_is_checked_where_it_is_set(tmp_path, capsys):
    for value in ("2", "1"):
        with pytest.raises(SystemExit) as stop:
            cli.main(["--dropout", value])
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"train.py: error: argument --dropout: must be in [0, 1), got {value}\n"
    (tmp_path / "drop.yaml").write_text("seed: 1\ndropout: 1.5\n")
    assert cli.main(["--config", str(tmp_path / "drop.yaml")]) == 2
    assert capsys.readouterr().err == f"train.py: error: {tmp_path / 'drop.yaml'}:2: dropout: must be in [0, 1), " \
                                      "got 1.5\n"
    with pytest.raises(ValueError, match=r"^Config.dropout: must be in \[0, 1\), got 2$"):
        twophase.fit(twophase.Config(dropout=2.0))
    assert cli.resolve(["--dropout", "0.5"])[0].dropout == 0.5


def test_cispos_clip_bound_and_sequence_level_sampling_warn():
    cispo = Config(objective="policy", sampler="sample", loss_type="cispo")
    [line] = cispo.warnings()
    assert "--clip-epsilon-high" in line and "TRL recommends --clip-epsilon-high 5" in line
    assert dataclasses.replace(cispo, clip_epsilon_high=5.0).warnings() == []
    assert Config(objective="policy", sampler="sample", loss_type="dapo").warnings() == []
    for loss in ("dapo", "cispo", "bnpo", "dr_grpo"):
        cfg = Config(objective="policy", sampler="sample", loss_type=loss, clip_epsilon_high=5.0,
                     importance_sampling_level="sequence")
        [line] = cfg.warnings()
        assert line.startswith(f"--importance-sampling-level sequence with --loss-type {loss}:") and "grpo" in line
    assert Config(objective="policy", sampler="sample", loss_type="grpo",
                  importance_sampling_level="sequence").warnings() == []
