"""`python train.py` / `twophase-train`: the command line resolved into a Config (its layers: defaults, the task's
recipe, --preset, --config, the flags; or a checkpoint's), the run built from it (`build`) and run, its closing
table printed.

Bad input (flags, files, plug-ins) ends with one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

import torch

from ..system import distributed, fsdp
from . import report, resume, rundir
from ..config import file as configfile
from .build import PROG, UsageError, build
from .start import StartupError, evaluate, flags_given, recipe_defaults, start_defaults
from ..protocol import ModelError
from .. import plot, rewards
from ..compiling import compile_report
from ..config import PRESETS, Config, OneLineParser, _flag, add_config_flags, config_from_args
from .. import tasks
from ..tasks.data import DataError
from .evaluation import test_beams
from .checkpoint import SaveError
from .report import Result, summary_table, with_beams
from .runstate import Interrupted
from .run import Run


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description="MLE warm start, then two-phase sequence-level RL.")
    add_config_flags(parser)
    files = parser.add_argument_group("configuration file", "Defaults from a file, and the resolved configuration "
                                      "shown (docs/python.md).")
    files.add_argument("--config", metavar="FILE", help="a .yaml or .json file of these flags' values (their "
                        "names, e.g. rescore_chunk: 128), the defaults of this command: the flags given still win; "
                        "a run's own <save-dir>/config.json reproduces that run (docs/python.md)")
    files.add_argument("--print-config", action="store_true", help="print the resolved configuration as YAML "
                        "that --config reads, and exit without training or writing anything")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, start, given = resolve(argv)
    except (ValueError, tasks.TaskError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if pre_parse(argv).print_config:  # the configuration only: nothing trained, nothing written
        print(configfile.dumps(cfg), end="")
        return 0
    try:
        return _train(cfg, start, given)
    finally:
        distributed.finish()


def build_from_flags(argv: list[str]) -> Run:
    """The run train.py would build from these flags (the recipe's defaults, --init-from's model flags under
    them), not run: for benchmarks. A bad flag combination is a UsageError, as train.py's one line."""
    try:
        cfg, start = parse(argv)
    except (ValueError, tasks.TaskError) as err:
        raise UsageError(str(err)) from None
    return build(cfg, start)


def parse(argv: list[str] | None = None) -> tuple[Config, dict | None]:
    """The command line's Config, over the defaults of start_defaults, and the checkpoint it starts from."""
    cfg, start, _ = resolve(argv)
    return cfg, start


def resolve(argv: list[str] | None = None, settings: dict | None = None) -> tuple[Config, dict | None, frozenset]:
    """The command line's Config, the checkpoint it starts from, and the fields given (on the command line, or by
    --config's file where it changes a default). Layers, lowest first: Config's defaults, the task's recipe,
    --preset, the --config file (or `settings`: twophase.fit's, checked as a file's), the flags; --resume and
    --init-from replace the first three by the checkpoint's (start_defaults)."""
    pre = pre_parse(argv)
    layer = configfile.read(pre.config) if pre.config else {}
    layer.update(settings or {})
    parser = build_parser()

    def refuse(message: str):  # train.py: argparse's one line and exit 2; twophase.fit: raised
        if settings is None:
            parser.error(message)
        raise UsageError(message)

    # the recipe of the task the command line names, else the file
    named = argparse.Namespace(**{k: getattr(pre, k) if getattr(pre, k) is not None else layer.get(k)
                                  for k in ("task", "train", "preset")})
    recipe = recipe_defaults(named)  # before --help, which then shows them
    if recipe:  # the recipe's values become the defaults, so the flags given on the command line still win
        unknown = sorted(set(recipe) - {f.name for f in fields(Config)})
        if unknown:
            refuse(f"--task {named.task}: its flag_defaults name no flag: {', '.join(unknown)}")
    if recipe or layer:
        parser.set_defaults(**{**recipe, **layer})
    if recipe:  # --help then says whose defaults it shows
        parser.description += (f" The defaults shown are --task {tasks.default_name(named)}'s own defaults"
                               + (f" and --preset {named.preset}'s" if named.preset in PRESETS else "")
                               + f" where they set them ({', '.join(_flag(k) for k in recipe)}).")
    args = parser.parse_args(argv)
    more, start = start_defaults(args)  # --resume: the checkpoint's configuration; --init-from: its model's
    if start is not None and more:  # these become the defaults too, so the file's and the flags given still win
        unknown = sorted(set(more) - {f.name for f in fields(Config)})
        if unknown:
            refuse(f"the checkpoint's configuration names no flag: {', '.join(unknown)}")
        parser = build_parser()  # without the recipe of the task the command line named (--init-from: its own)
        parser.set_defaults(**{**more, **layer})
        args = parser.parse_args(argv)
    given = flags_given(build_parser(), argv) | configfile.changed(layer)
    return config_from_args(args), start, given & {f.name for f in fields(Config)}  # not --config itself


class PreParser(argparse.ArgumentParser):
    """pre_parse's: what it cannot read (`--pr`, which --preset and --print-config both begin with) is one line
    (ValueError), as the full parser's errors."""

    def error(self, message: str):
        raise ValueError(message)


def pre_parse(argv: list[str] | None) -> argparse.Namespace:
    """--task, --train, --preset, --config and --print-config alone (anything else, --help included, is left to
    the full parser)."""
    pre = PreParser(add_help=False)
    for flag in ("--task", "--train", "--preset", "--config"):
        pre.add_argument(flag)
    pre.add_argument("--print-config", action="store_true")
    return pre.parse_known_args(argv)[0]


def _train(cfg: Config, start: dict | None = None, given: frozenset | None = None) -> int:
    try:
        run(cfg, start, given)
    except (UsageError, DataError, rewards.RewardError, tasks.TaskError, SaveError, StartupError,
            ModelError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        if distributed.rank() == 0:  # the one that saved
            print(f"{PROG}: {stop}", file=sys.stderr)
        return stop.code
    return 0


def run(cfg: Config, start: dict | None = None, given: frozenset | None = None, *, model=None, task=None,
        reward=None) -> Result:
    """What train.py runs once its flags are resolved, printing what it prints; also `twophase.fit`'s. Bad input
    raises (UsageError, DataError, ...: one line each), a signal Interrupted after the save. `model`, `task`,
    `reward`: build's (a user's own)."""
    training = build(cfg, start, given, model=model, task=task, reward=reward)
    if cfg.eval_only:
        scores = evaluate(training)
        table = report.evaluation_table(training.task, scores)
        if training.is_main:
            step = (start or {}).get("step", training.step)
            print(f"{resume.resume_path(cfg) or cfg.init_from} (step {step}):\n" + table)
        return Result(cfg, training.save_dir.absolute(), scores, table)
    if training.is_main:
        test = f" / {len(training.test)} test" if training.test is not None else ""
        threads = torch.get_num_threads()
        print(f"task {training.task.describe()}: {len(training.train)} train / {len(training.valid)} valid{test} "
              f"sources; reward {training.reward.name}; "
              f"{sum(p.numel() for p in training.model.parameters()):,} parameters{trainable(training.model)} on "
              f"{training.device}"
              + (f", {threads} CPU thread{'s' * (threads > 1)}" if training.device.type == "cpu" else "")
              + (f" (x {distributed.world()} processes)" if distributed.world() > 1 else ""), flush=True)
    try:
        summary = training.run()
        exported = save_final(training)
    finally:
        if training.metrics.mirror is not None:
            training.metrics.mirror.close()
    best, folder = training.checkpoints, training.save_dir.absolute()  # the Result's paths: from anywhere
    result = Result(cfg, folder, summary, summary_table(summary, with_beams(training.task.metrics,
                                                                            test_beams(training.cfg))),
                    model=training.model, best_metric=training.best_key, best=best.best, best_step=training.best_step,
                    best_checkpoint=if_written(folder / best.best_path.name) if best.best is not None else None,
                    last_checkpoint=if_written(folder / best.last_path.name),
                    metrics=if_written(folder / "metrics.jsonl"), final_model=exported)
    if not training.is_main:
        return result
    print(result.table)
    for line in training.task.closing_lines():  # Karel: its baselines, beside the table
        print(line)
    compiling = compile_report(training.model)  # --compile: what it cost, paid once at the start
    if compiling is not None:
        print(compiling)
    if best.best is not None:
        print(f"best {training.best_key}: {best.best:.4f} at step {training.best_step}: {best.best_path}")
    print(closing_paths(training, exported))
    result.picture = draw_picture(training)
    if result.picture is not None:
        print(f"picture: {result.picture}")
    return result


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
    plain = fsdp.plain_copy(training.model, training.task.build_model) if fsdp.is_sharded(training.model) else None
    if not training.is_main:
        return None
    try:
        model = plain or resume.export_model(training)
        return training.task.save_final(model, training.save_dir) or resume.save_export(training, model)
    except ValueError as err:  # --export best: a checkpoint_best.pt that does not fit
        raise UsageError(str(err)) from None
    except OSError as err:
        raise UsageError(f"cannot write the final model into {training.save_dir}: {err.strerror or err} "
                         f"({training.checkpoints.last_path} holds it)") from None


def draw_picture(training: Run):
    """--picture: <save-dir>/curves.png from the run's metrics.jsonl (twophase.plot), or None: turned off, no
    matplotlib, or nothing to draw. A picture that cannot be drawn costs the run nothing but a warning line."""
    if not training.cfg.picture or os.environ.get("TWOPHASE_PICTURE", "on").lower() in ("off", "0", "no"):
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
