"""What a checkpoint fixes for a command, as pure functions of (Config, Start): no file read, no directory made. The
expected values are written out here from the rules the flags declare (--resume: the checkpoint's configuration but
where the command runs, its fixed fields refused, its growing ones only larger; --init-from: the model's shape and
data flags over the recipe of the checkpoint's task; --resume-from: its own directory)."""
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from twophase.config import Config
from twophase.config.values import ConfigError
from twophase.train import startpoint
from twophase.train.resume import ResumeError
from twophase.train.startpoint import Start

SAVED = asdict(Config(task="g2p", hidden_size=24, embed_dim=12, lr=1e-3, rl_steps=10, mle_steps=5, seed=7,
                      save_dir="/runs/a"))
STATE = {"config": SAVED, "step": 8, "mle_end": 5, "model": {}}


def test_resume_takes_the_checkpoints_configuration_and_resume_from_its_directory():
    got = startpoint.defaults(Config(resume=True), Start("--resume", Path("/runs/a/checkpoint_last.pt"), STATE))
    assert got["hidden_size"] == 24 and got["lr"] == 1e-3 and got["rl_steps"] == 10 and got["seed"] == 7
    assert "save_dir" not in got  # --resume continues the run in the --save-dir the command names
    moved = startpoint.defaults(Config(resume_from="/elsewhere/x.pt"),
                                Start("--resume-from", Path("/elsewhere/x.pt"), STATE))
    assert moved["save_dir"] == "/elsewhere"


def test_init_from_takes_the_model_shape_over_the_recipe_of_the_checkpoints_task():
    got = startpoint.defaults(Config(init_from="/runs/a/checkpoint_best.pt"),
                              Start("--init-from", Path("/runs/a/checkpoint_best.pt"), STATE))
    assert got["task"] == "g2p" and got["hidden_size"] == 24 and got["embed_dim"] == 12
    assert "lr" not in got and "rl_steps" not in got and "seed" not in got  # a new run's own



def test_a_new_run_starts_from_its_tasks_recipe_then_the_preset():
    from twophase.tasks.countdown.task import Countdown
    assert startpoint.defaults(Config(), None) == Countdown.flag_defaults  # countdown: the default task
    assert startpoint.defaults(Config(task="g2p", preset="g2p-long"), None)["mle_steps"] == 16000


def test_a_fixed_flag_is_refused_a_growing_one_may_only_grow():
    start = Start("--resume", Path("/runs/a/checkpoint_last.pt"), STATE)
    resumed = Config(**{**SAVED, "resume": True})
    startpoint.check(resumed, start)  # the checkpoint's own configuration: nothing to refuse
    startpoint.check(replace(resumed, rl_steps=20), start)  # RL steps may grow
    with pytest.raises(ConfigError, match=r"--rl-steps 10, not 5: --rl-steps may only grow on resume"):
        startpoint.check(replace(resumed, rl_steps=5), start)
    with pytest.raises(ConfigError, match=r"--hidden-size 24, not 32: it would change what the run means"):
        startpoint.check(replace(resumed, hidden_size=32), start)
    assert startpoint.continued(resumed, start) is STATE and startpoint.initial(resumed, start) is None


def test_init_from_fixes_the_model_and_guards_its_own_directory():
    start = Start("--init-from", Path("/runs/a/checkpoint_best.pt"), STATE)
    new = Config(task="g2p", hidden_size=24, embed_dim=12, init_from="/runs/a/checkpoint_best.pt", lr=5.0,
                 save_dir="/runs/b")
    startpoint.check(new, start)  # another rate, another directory: a new run's own
    assert startpoint.initial(new, start) is STATE and startpoint.continued(new, start) is None
    with pytest.raises(ResumeError, match=r"--char-source: --init-from /runs/a/checkpoint_best.pt: its model was "
                                          r"built with --char-source off, not on"):
        startpoint.check(replace(new, char_source=True), start)
    with pytest.raises(ResumeError, match="whose run --overwrite would delete"):
        startpoint.check(replace(new, save_dir="/runs/a", overwrite=True), start)
