"""`python train.py` / `twophase-train`: the command line resolved into a Config (its layers: defaults, the task's
recipe, --preset, --config, the flags; or a checkpoint's: `startpoint`), the run set up from it in run order
(`recipe.setup`) and run, its closing table printed.

Bad input (flags, files, plug-ins) ends with one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch

from ..system import distributed, fsdp
from . import report, resume, rundir
from ..config import file as configfile
from . import startpoint
from .recipe import PROG, default_save_dir, setup
from .startpoint import Start
from ..errors import OneLineError, UsageError
from .. import plot
from ..config import PRESETS, Config, OneLineParser, _flag, add_config_flags, config_from_args  # noqa: F401
from ..config import layers, section_fields
from ..config import shown as helpshown
from ..config.layers import Layer, merged
from ..compiling import compile_report
from .. import tasks
from ..tasks.base import ExportMismatch
from .evaluation import test_beams, validate
from .report import Result, final_column, summary_table, with_beams
from .runstate import Interrupted
from .run import Run


def build_parser(shown: dict | None = None, add_help: bool = True,
                 kept: dict[str, tuple[str, ...]] | None = None, files: bool = True) -> OneLineParser:
    """train.py's parser; `shown`: defaults other than Config's for --help to show (a task's recipe, a preset's,
    a file's); `kept`: only these sections and their fields (--help's for one command, config.shown), with a
    short usage line in place of every flag's; `files`: with --config and --print-config."""
    parser = OneLineParser(prog=PROG, description="MLE warm start, then two-phase sequence-level RL.",
                           add_help=False, usage=None if kept is None else "%(prog)s [FLAG ...] [-h [SECTION]]")
    if add_help:
        parser.add_argument("-h", "--help", nargs="?", const=True, default=False, metavar="SECTION",
                            type=_help_topic, help="show the sections this command uses (its task, model and "
                            "objective) and exit; --help all: every section; --help SECTION: that one")
    add_config_flags(parser, kept)
    if not files:
        return _with_defaults(parser, shown)
    group = parser.add_argument_group("configuration file", "Defaults from a file, and the resolved configuration "
                                      "shown (docs/python.md).")
    group.add_argument("--config", metavar="FILE", help="a .yaml or .json file of these flags' values (their "
                        "names, e.g. rescore_chunk: 128), the defaults of this command: the flags given still win; "
                        "a run's own <save-dir>/config.json reproduces that run (docs/python.md)")
    group.add_argument("--print-config", action="store_true", help="print the resolved configuration as YAML "
                        "that --config reads, each value's origin beside it, and exit without training or writing "
                        "anything")
    return _with_defaults(parser, shown)


def _with_defaults(parser: OneLineParser, shown: dict | None) -> OneLineParser:
    if shown:
        parser.set_defaults(**shown)
    return parser


def _help_topic(text: str) -> str:
    try:
        return helpshown.topic(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    try:
        resolved = resolution(argv)
    except OneLineError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if resolved.print_config:  # the configuration only: nothing trained, nothing written
        print(configfile.dumps(resolved.cfg, resolved.origins), end="")
        return 0
    try:
        return _train(resolved.cfg, resolved.start, resolved.given)
    finally:
        distributed.finish()


def build_from_flags(argv: list[str]) -> Run:
    """The run train.py would build from these flags (the recipe's defaults, --init-from's model flags under
    them), not run: for benchmarks. A bad flag combination is a UsageError, as train.py's one line."""
    try:
        cfg, start = parse(argv)
    except OneLineError as err:
        raise UsageError(str(err)) from None
    return setup(cfg, start)


def parse(argv: list[str] | None = None) -> tuple[Config, Start | None]:
    """The command line's Config, over the defaults of its start point, and the checkpoint it starts from."""
    cfg, start, _ = resolve(argv)
    return cfg, start


@dataclass(frozen=True)
class Resolution:
    """A command resolved: its Config, the checkpoint it starts from, the fields the user gave (the start-up checks'),
    where each value not Config's default came from, and whether it only prints the configuration."""

    cfg: Config
    start: Start | None
    given: frozenset
    origins: dict
    print_config: bool = False


def resolve(argv: list[str] | None = None, settings: dict | None = None,
            recipe: dict | None = None) -> tuple[Config, Start | None, frozenset]:
    """The command line's Config, the checkpoint it starts from, and the fields given (`resolution`)."""
    resolved = resolution(argv, settings, recipe)
    return resolved.cfg, resolved.start, resolved.given


def resolution(argv: list[str] | None = None, settings: dict | None = None,
               recipe: dict | None = None) -> Resolution:
    """The layers of this command resolved once into a Config (config.layers): Config's defaults, the task's
    recipe (`recipe`: a task object's own, given to twophase.fit), --preset, the --config file, then `settings`
    (twophase.fit's Config, checked as a file's) and the flags typed; --resume and --init-from replace the recipe
    and the preset by the checkpoint's (`startpoint.defaults`). The fields given: the flags typed, and the file's and
    the settings' values that change a default (the start-up checks')."""
    typed = command_line(argv)
    config, print_config, wants_help = typed.pop("config", None), typed.pop("print_config", False), \
        typed.pop("help", False)
    file = configfile.read(config) if config else {}
    from_python, settings = settings is not None, dict(settings or {})  # twophase.fit's: raised, never an exit

    user = [Layer(f"--config {config}", file), Layer("fit's Config", settings), Layer("command line", typed)]
    view = argparse.Namespace(**{**{f.name: f.default for f in fields(Config)},
                                 **merged(user)[0]})  # what the command asks, unchecked
    try:
        below = recipe_layers(view, recipe)
    except UsageError as err:
        if from_python:
            raise
        build_parser().error(str(err))  # train.py: argparse's one line and exit 2
    if wants_help:
        print_help(wants_help, view, below, user, recipe)
        raise SystemExit(0)
    below, start = start_layers(view, below, recipe)
    try:
        cfg, origins = layers.resolve(below + user)
    except ValueError as err:
        if start is not None:  # a flag that differs from the checkpoint's is what went wrong, not the combination
            values = {**view.__dict__, **merged(below + user)[0]}
            startpoint.check(argparse.Namespace(**values), start)
        raise UsageError(str(err)) from None
    given = frozenset(typed) | configfile.changed(file) | configfile.changed(settings)
    return Resolution(cfg, start, given, origins, print_config)


def print_help(topic, view, below: list[Layer], user: list[Layer], recipe: dict | None) -> None:
    """--help (`topic` True): the sections this command uses, with the flags that apply in them
    (config.shown: read from the sections' and fields' conditions over the command's values: its task, model,
    objective), then the others named; `all`: every section; a section's name: that one. The defaults shown are
    the layers' below the flags typed: the task's recipe, --preset's and the file's, or with --resume (and
    --resume-from, --init-from) the checkpoint's."""
    whose = ""
    if view.resume or view.resume_from or view.init_from:
        try:
            below, _ = start_layers(view, below, recipe)
        except OneLineError as err:  # no checkpoint to read: the recipe's defaults, and why
            whose = f" No checkpoint read ({err}): the defaults shown are the recipe's."
        else:
            whose = f" The defaults shown are those of the checkpoint {startpoint.flag_of(view)} reads."
    if not whose and below[0].values:
        whose = (f" The defaults shown are --task {tasks.default_name(view)}'s own defaults"
                 + (f" and --preset {view.preset}'s" if below[1].values else "")
                 + f" where they set them ({', '.join(_flag(k) for k in merged(below)[0])}).")
    command = argparse.Namespace(**{**vars(view), **merged(below + user)[0]})
    command.task = tasks.default_name(command)
    reads = task_reads(command)
    if topic is True:
        kept = helpshown.shown(command, reads)
    elif topic == helpshown.ALL:
        kept = None
    else:
        kept = {topic: section_fields(topic)}
    parser = build_parser(merged(below + user[:2])[0], kept=kept, files=topic in (True, helpshown.ALL))
    parser.description = f"{parser.description}{whose}"
    parser.print_help()
    if topic is True:
        print("\n" + helpshown.closing(command, shutil.get_terminal_size().columns - 2, reads))  # argparse's width


def task_reads(command) -> frozenset | None:
    """The data and model flags the command's task reads, as `tasks.check_flags` counts them (its `flags` and
    its recipe's), where its class says so before it is built; None otherwise (a function that makes a task, a
    task not found)."""
    try:
        factory = tasks.factory_of(command, command.task)
    except tasks.TaskError:
        return None
    if not isinstance(factory, type):
        return None
    recipe: dict = getattr(factory, "flag_defaults", None) or {}
    return frozenset(getattr(factory, "flags", ())) | frozenset(recipe)


def start_layers(view, below: list[Layer], recipe: dict | None) -> tuple[list[Layer], Start | None]:
    """The layers under the user's and the checkpoint the command starts from: --resume and --resume-from the
    checkpoint's configuration (--resume: and the directory it continues in), --init-from its model's flags over
    the recipe's (`startpoint.defaults`); a new run's `below` (the recipe, --preset) and None."""
    starting = _with_save_dir(view, below)
    start = startpoint.read(starting)
    if start is None:
        return below, None
    layers_ = [Layer(f"{start.flag}'s checkpoint", startpoint.defaults(starting, start, recipe))]
    if view.resume and not view.resume_from:  # where no flag names it, the directory found: the run's own
        layers_.append(Layer("--resume's run directory", {"save_dir": starting.save_dir}))
    return layers_, start


def _with_save_dir(view, below: list[Layer]):
    """The command's values with the --save-dir --resume continues in: the one given, else its task's recipe's,
    else the task's runs/<task> (`recipe.default_save_dir`); a UsageError asks for it where the task cannot be found."""
    save_dir = view.save_dir or merged(below)[0].get("save_dir")
    if view.resume and not view.resume_from and save_dir is None:
        name = tasks.default_name(view)
        try:
            factory = tasks.get(name)
        except tasks.TaskError as err:
            raise UsageError(str(err)) from None
        save_dir = default_save_dir(SimpleNamespace(name=getattr(factory, "name", tasks.Task.name), spec=name))
    return argparse.Namespace(**{**vars(view), "save_dir": save_dir})


def recipe_layers(view, recipe: dict | None = None) -> list[Layer]:
    """The task's recipe (`recipe`, else that of the task the command names) and --preset's, as layers."""
    name = tasks.default_name(view)
    own = startpoint.task_recipe(view) if recipe is None else dict(recipe)
    unknown = sorted(set(own) - {f.name for f in fields(Config)})
    if unknown:
        raise UsageError(f"--task {name}: its flag_defaults name no flag: {', '.join(unknown)}")
    preset = PRESETS.get(view.preset, {})  # an unknown one is refused with the Config's choices
    return [Layer(f"--task {name}'s recipe", own), Layer(f"--preset {view.preset}", dict(preset))]


def command_line(argv: list[str] | None) -> dict:
    """What the command line types, {dest: value}, each flag's value checked as it is parsed (type, range,
    choices): one parse, no defaults; --help only noted."""
    parser = build_parser()  # --help prints the defaults of the layers, resolved first
    for action in parser._actions:  # a flag not typed leaves no value (not set_defaults: it would store one)
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


def _train(cfg: Config, start: Start | None = None, given: frozenset | None = None) -> int:
    try:
        run(cfg, start, given)
    except OneLineError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        if distributed.rank() == 0:  # the one that saved
            print(f"{PROG}: {stop}", file=sys.stderr)
        return stop.code
    return 0


def run(cfg: Config, start: Start | None = None, given: frozenset | None = None, *, model=None, task=None,
        reward=None) -> Result:
    """What train.py runs once its flags are resolved, printing what it prints; also `twophase.fit`'s. Bad input
    raises a OneLineError (UsageError, DataError, ...: one line), a signal Interrupted after the save. `model`, `task`,
    `reward`: `recipe.setup`'s (a user's own). The save dir's lock, taken before the run's first write, is released
    whichever way this returns."""
    lock = rundir.RunLock()
    try:
        return _run_locked(cfg, start, given, lock, model=model, task=task, reward=reward)
    finally:
        lock.release()


def _run_locked(cfg: Config, start: Start | None, given: frozenset | None, lock: rundir.RunLock, *, model, task,
                reward) -> Result:
    training = setup(cfg, start, given, model=model, task=task, reward=reward, lock=lock)
    if cfg.eval_only:
        scores = evaluate(training)
        table = report.evaluation_table(training.trainer.task, scores)
        if training.is_main:
            step = start.state.get("step", training.state.step) if start is not None else training.state.step
            print(f"{resume.resume_path(training.trainer.cfg) or cfg.init_from} (step {step}):\n" + table)
        return Result(training.trainer.cfg, training.save_dir.absolute(), scores, table)
    t = training.trainer
    if training.is_main:
        test = f" / {len(t.task.test)} test" if t.task.test else ""
        threads = torch.get_num_threads()
        print(f"task {t.task.describe()}: {len(t.task.train)} train / {len(t.task.valid)} valid{test} sources; "
              f"reward {t.reward.name}; "
              f"{sum(p.numel() for p in t.model.parameters()):,} parameters{trainable(t.model)} on "
              f"{t.device}"
              + (f", {threads} CPU thread{'s' * (threads > 1)}" if t.device.type == "cpu" else "")
              + (f" (x {distributed.world()} processes)" if distributed.world() > 1 else ""), flush=True)
    try:
        summary = training.train()
        exported = save_final(training)
    finally:
        training.cleanup()
    best, folder = training.checkpoints, training.save_dir.absolute()  # the Result's paths: from anywhere
    result = Result(t.cfg, folder, summary, summary_table(summary, with_beams(t.task.metrics, test_beams(t.cfg)),
                                                            final_column(t.cfg.objective)),
                    model=t.model, best_metric=training.best_key, best=best.best, best_step=training.state.best_step,
                    best_checkpoint=if_written(folder / best.best_path.name) if best.best is not None else None,
                    last_checkpoint=if_written(folder / best.last_path.name),
                    metrics=if_written(folder / "metrics.jsonl"), final_model=exported)
    if not training.is_main:
        return result
    print(result.table)
    for line in t.task.closing_lines():  # Karel: its baselines, beside the table
        print(line)
    compiling = compile_report(t.model)  # --compile: what it cost, paid once at the start
    if compiling is not None:
        print(compiling)
    if best.best is not None:
        print(f"best {training.best_key}: {best.best:.4f} at step {training.state.best_step}: {best.best_path}")
    print(closing_paths(training, exported))
    result.picture = draw_picture(training)
    if result.picture is not None:
        print(f"picture: {result.picture}")
    return result


def evaluate(training: Run) -> dict:
    """--eval-only: the checkpoint's model on the validation data (--valid-size's share) and the test data."""
    t = training.trainer
    scores = {"valid": training.validate()}
    if t.task.test:
        scores["test"] = validate(t.model, t.task, t.task.test, t.reward, t.cfg.eval_beam, t.cfg.max_len, t.device)
    return scores


def closing_paths(training: Run, exported) -> str:
    """The last line: the files the run wrote (a run of no steps writes no checkpoint and no log)."""
    metrics, last = training.save_dir / "metrics.jsonl", training.checkpoints.last_path
    written = ([f"metrics: {metrics}"] if metrics.exists() else []) + \
        ([f"checkpoint: {last}"] if last.exists() else []) + ([f"final model: {exported}"] if exported else [])
    return "; ".join(written) or "no training step taken (--mle-steps 0 --rl-steps 0): no checkpoint written"


def if_written(path):
    """`path` where the run wrote it, else None (a run of no steps writes no checkpoint and no log)."""
    return path if path.exists() else None


def trainable(model) -> str:
    """' (N trainable)' where some parameters are frozen (--lora-r), else ''."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return "" if n == sum(p.numel() for p in model.parameters()) else f" ({n:,} trainable)"


def save_final(training: Run):
    """The task's own export of the final model (--hf-model: save_pretrained into <save-dir>/hf_final), once,
    by the main process; None where the task has none."""
    t = training.trainer
    plain = fsdp.plain_copy(t.model, t.task.build_model) if fsdp.is_sharded(t.model) else None
    if not training.is_main:
        return None
    best = t.cfg.export == "best" and training.checkpoints.best_path.exists()
    try:
        model = plain or resume.export_model(t.model, t.cfg.export, training.checkpoints.best_path)
        return t.task.save_final(model, training.save_dir) or resume.save_export(
            model, t.cfg, t.task, training.save_dir, training.state.best_step if best else training.state.step,
            training.saver.base_model, training.own_model)
    except ExportMismatch as err:  # read back, the export is another model: the checkpoint holds this one
        source = training.checkpoints.best_path if best else training.checkpoints.last_path
        raise UsageError(f"{err}; {source} holds the trained model") from None
    except ValueError as err:  # --export best: a checkpoint_best.pt that does not fit
        raise UsageError(str(err)) from None
    except OSError as err:
        raise UsageError(f"cannot write the final model into {training.save_dir}: {err.strerror or err} "
                         f"({training.checkpoints.last_path} holds it)") from None


def draw_picture(training: Run):
    """--picture: <save-dir>/curves.png from the run's metrics.jsonl (twophase.plot), or None: turned off, no
    matplotlib, or nothing to draw. A picture that cannot be drawn costs the run nothing but a warning line."""
    if not training.trainer.cfg.picture or os.environ.get("TWOPHASE_PICTURE", "on").lower() in ("off", "0", "no"):
        return None
    out = training.save_dir / rundir.PICTURE
    try:
        plot.plot([training.save_dir / "metrics.jsonl"], out, [training.save_dir.name])
    except plot.NoMatplotlib:
        return None
    except plot.PlotError as err:
        print(f"{PROG}: warning: no picture: {err}", file=sys.stderr)
        return None
    except OSError as err:
        print(f"{PROG}: warning: no picture: cannot write {out}: {err.strerror or err}", file=sys.stderr)
        return None
    return out
