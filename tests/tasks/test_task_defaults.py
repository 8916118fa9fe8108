"""A task's own recipe (`Task.flag_defaults`): below --preset, below the flags given on the command line."""
import pytest

from twophase import tasks
from twophase.tasks.base import Task
from twophase.train import cli


@pytest.fixture
def seen(monkeypatch):
    """The Config main() would train with (the run itself is replaced)."""
    configs = []
    monkeypatch.setattr(cli, "_train", lambda cfg, start=None, given=None: configs.append(cfg) or 0)
    return configs


def test_karel_runs_its_recipe_and_given_flags_win(seen):
    assert cli.main(["--task", "karel"]) == 0
    assert cli.main(["--task", "karel", "--hidden-size", "64", "--rl-steps", "7"]) == 0
    recipe, given = seen
    assert (recipe.hidden_size, recipe.beam_size, recipe.rl_steps, recipe.save_dir) == (128, 16, 2000, "runs/karel")
    assert (given.hidden_size, given.rl_steps, given.beam_size) == (64, 7, 16)


def test_g2p_converges_its_warm_start_and_tsv_keeps_the_flags_defaults(seen, tmp_path):
    assert cli.main(["--task", "g2p"]) == 0  # the built-in G2P: validation-driven MLE of at most 10,000 steps
    assert cli.main(["--train", "t.tsv", "--valid", "v.tsv"]) == 0
    g2p, tsv = seen
    assert (g2p.lr_decay, g2p.mle_steps, g2p.hidden_size, g2p.save_dir) == (0.5, 10000, 256, None)  # runs/<task>
    assert (tsv.lr_decay, tsv.mle_steps, tsv.beam_size) == (1.0, 4000, 8)


def test_the_mle_control_runs_for_the_demo_recipes_alone(seen, tmp_path):
    """--compare-mle: on for the shipped demos (their closing table's third column), off for a user's own data
    unless asked for, and --no-compare-mle still turns a demo's off."""
    for argv in (["--task", "g2p"], ["--task", "karel"], ["--train", "t.tsv", "--valid", "v.tsv"],
                 ["--train", "t.tsv", "--valid", "v.tsv", "--compare-mle"], ["--task", "g2p", "--no-compare-mle"]):
        assert cli.main(argv) == 0
    assert [cfg.compare_mle for cfg in seen] == [True, True, False, True, False]


def test_preset_overrides_the_task_recipe(seen, monkeypatch):
    class Recipe(Task):
        flag_defaults = dict(rl_steps=3, dropout=0.1)

    monkeypatch.setattr(tasks, "get", lambda name: Recipe)
    assert cli.main(["--preset", "g2p-long"]) == 0
    assert (seen[0].rl_steps, seen[0].dropout) == (500, 0.3)  # the preset's, over the task's


def test_a_recipe_naming_no_flag_is_one_line(monkeypatch, capsys):
    class Typo(Task):
        flag_defaults = dict(hiden_size=8)

    monkeypatch.setattr(tasks, "get", lambda name: Typo)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--task", "typo"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "flag_defaults name no flag: hiden_size" in err and err.count("\n") == 1


def test_an_unknown_task_is_still_reported_by_the_run(capsys):
    assert cli.main(["--task", "nosuchtask"]) == 2
    assert "unknown task 'nosuchtask'" in capsys.readouterr().err
