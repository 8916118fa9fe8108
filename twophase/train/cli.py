"""`python train.py` / `twophase-train`: parse flags, build data, model and reward, run the trainer.

Bad input (flags, files, plug-ins) ends with one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

import torch

from . import amp, basemodel, configfile, devices, distributed, fsdp, grammar, numerics, rundir, runs, startup, \
    userparts
from .start import (batch_warnings, evaluate, init_state, recipe_defaults, refuse_against_checkpoint,
                    resume_state, start_defaults, start_run_dir)
from ..protocol import ModelError
from .. import plot, rewards, rewardsum
from ..compiling import compiled
from .config import PRESETS, Config, OneLineParser, add_config_flags, config_from_args  # noqa: F401 (PRESETS)
from .. import tasks
from ..tasks.data import DataError
from .evaluation import score, test_beams
from .checkpoint import SaveError
from .report import Result, summary_table, with_beams
from .interrupt import Interrupted
from .run import Run
from . import tensorboard


PROG = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(("train.py", "twophase-train")) \
    else "train.py"  # messages name the command the user typed


class UsageError(ValueError):
    """A problem with what the user gave us; printed as one line, exit status 2 (twophase.fit: raised)."""


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description="MLE warm start, then two-phase sequence-level RL.")
    add_config_flags(parser)
    parser.add_argument("--config", metavar="FILE", help="a .yaml or .json file of these flags' values (their "
                        "names, e.g. rescore_chunk: 128), the defaults of this command: the flags given still win; "
                        "a run's own <save-dir>/config.json reproduces that run (docs/python.md)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration as YAML "
                        "that --config reads, and exit without training or writing anything")
    return parser


def pick_device(name: str) -> torch.device:
    """--device's device, refused in one line (a UsageError) where this machine or torchrun process lacks it."""
    try:
        return devices.for_rank(devices.pick(name))
    except devices.DeviceError as err:
        raise UsageError(str(err)) from None


def check_reward(reward, task) -> None:
    """Call the reward once before anything slow, on answers whose scores exist whatever the reward means: the
    references of the first two training sources against themselves, and an empty hypothesis. A plug-in that
    raises or returns NaN then stops the run in seconds, not at the first validation after the warm start."""
    examples = [ex for ex in task.train[:2] if ex.references]
    if not examples:  # a task without references (execution rewards, say): an empty hypothesis only
        examples = task.train[:1]
    hyps = [ex.references[0] if ex.references else "" for ex in examples] + [""]
    ids = [task.target_ids(ex)[0] if ex.references else [] for ex in examples] + [[]]  # without eos
    try:
        score(reward, hyps, examples + examples[:1], ids)
    except rewards.RewardError as err:
        raise rewards.RewardError(f"{err} (start-up check: {len(examples)} training references scored against "
                                  "themselves and an empty hypothesis)") from None


def load_task_data(task, state: dict | None) -> None:
    """The task's data, its ids restored from the checkpoint on --resume (whatever the data would build today)."""
    if state is not None and "task" in state:
        task.load_state_dict(state["task"]["state"])
    task.load_data()
    if distributed.rank() == 0:
        for note in task.notes:
            print(note)
    if not task.train or not task.valid:
        raise UsageError(f"task '{task.spec}' has no {'training' if not task.train else 'validation'} examples")


def resolve_best_metric(cfg: Config, task) -> str:
    """--best-metric: auto means the task's main metric (its reward where it names none); anything else must be
    one of the task's metrics or reward."""
    if cfg.best_metric == "auto":
        return task.main_metric or "reward"
    known = [m.key for m in task.metrics] + ["reward"]
    if cfg.best_metric not in known:
        raise UsageError(f"--best-metric {cfg.best_metric}: task '{task.spec}' reports {', '.join(known)}")
    return cfg.best_metric


def cpu_threads(cfg: Config, width: int | None = None) -> int | None:
    """--threads, or for 0 (auto) the count to set (None: leave torch's default). A small model's matmuls are
    too small to share out, and torch's threads wait for one another at every op: with another process busy on
    the machine, 2 threads ran hidden-16 and hidden-256 MLE steps 16-20x slower than 1 (2 shared cores).
    `width`: the model's hidden size where the task's model is not the LSTM of --hidden-size (--hf-model)."""
    if cfg.threads:
        return cfg.threads
    if "OMP_NUM_THREADS" in os.environ or (width or cfg.hidden_size) >= 512:
        return None  # the user's (or torchrun's) choice; large matmuls do gain from every core
    return 1


def build(cfg: Config, start: dict | None = None, given: frozenset | None = None, *, model=None, task=None,
          reward=None) -> Run:
    """The trainer of this command; `start`: the checkpoint main() read already (--resume, --init-from);
    `given`: the flags set on the command line (default: those differing from Config's). `model`, `task`,
    `reward`: a user's own, given to `twophase.fit` (userparts), in place of the task's model, the task
    --task names and the reward --reward names."""
    given = startup.changed_fields(cfg) if given is None else given
    try:
        cfg.validate()
        runs.check_flags(cfg)
    except ValueError as err:
        try:  # a flag that differs from the checkpoint's is what went wrong, rather than the combination
            refuse_against_checkpoint(cfg, start)
        except ValueError as fixed:
            raise UsageError(str(fixed)) from None
        raise UsageError(str(err)) from None
    if cfg.eval_only and cfg.init_from and not (cfg.resume or cfg.resume_from):  # no new directory: its own
        cfg.save_dir = os.path.dirname(os.path.abspath(cfg.init_from))
    device = pick_device(cfg.device)  # under torchrun: cuda:LOCAL_RANK
    try:
        numerics.configure(cfg.deterministic, cfg.tf32)  # before any model runs: cuBLAS reads its workspace once
        amp.check_device(cfg.amp, device)
        fsdp.check(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from None
    distributed.init(device)  # a no-op without torchrun
    if cfg.hf_model is not None:  # saved as an absolute path: --resume and decoding find it from anywhere
        cfg.hf_model = os.path.abspath(cfg.hf_model)
    if distributed.rank() == 0:  # once, not once per process
        for warning in cfg.warnings():
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    cfg.task = tasks.default_name(cfg)  # saved as resolved, as the reward and the best metric
    task = tasks.build(cfg) if task is None else userparts.adopt_task(task, cfg.task)  # cheap: no data yet
    startup.check_task_flags(task, given)
    cfg.save_dir = cfg.save_dir or default_save_dir(task)
    cfg.reward = cfg.reward or task.default_reward
    reward = rewardsum.from_flags(cfg.reward, cfg.reward_weights) if reward is None else \
        userparts.reward_of(reward, cfg.reward, cfg.reward_weights)  # before loading data: a typo fails in a second
    cfg.best_metric = resolve_best_metric(cfg, task)
    if cfg.tensorboard:
        try:
            tensorboard.writer_class()
        except ImportError as err:
            raise UsageError(str(err)) from None
    stale, state, init = claim_and_read(cfg, start)
    load_task_data(task, state if state is not None else init)
    startup.check_references(cfg, task, given)
    if distributed.world() > min(cfg.batch_size, cfg.mle_batch_size, len(task.train)):
        raise UsageError(f"--batch-size {cfg.batch_size} and --mle-batch-size {cfg.mle_batch_size} count the "
                         f"sources of a whole step; {distributed.world()} processes need at least one each")
    startup.check_reward_references(cfg, reward, task, given)
    check_reward(reward, task)
    if distributed.rank() == 0:
        pairs = sum(len(ex.references) for ex in task.train)
        for warning in batch_warnings(cfg, len(task.train), pairs, given):
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    torch.manual_seed(cfg.seed)
    threads = cpu_threads(cfg, getattr(task, "model_width", None))
    if threads:
        torch.set_num_threads(threads)
    model = (task.build_model() if model is None else model).to(device)
    base = basemodel.record(model, cfg.hf_model)  # the frozen part's base, if any
    try:  # a --lora-r checkpoint's adapters need the base they were trained on
        if state is not None:
            where = f"{'--resume-from' if cfg.resume_from else '--resume'}: {runs.resume_path(cfg)}"
            basemodel.check(state.get("base_model"), base, where, cfg.hf_model)
        if init is not None:  # --init-from: its weights (a --lora-r run's: its adapters); step 0, a fresh optimizer
            basemodel.check(init.get("base_model"), base, f"--init-from {cfg.init_from}", cfg.hf_model)
            runs.load_init(model, init, cfg.init_from)
    except ValueError as err:
        raise UsageError(str(err)) from None
    startup.check_model_on_a_batch(task, model, device)  # a broken model named now, not trained silently
    distributed.broadcast_parameters(model)  # the seed already agrees; this makes sure
    if cfg.fsdp:  # before the optimizer: it is built on the shards
        fsdp.shard_model(model)
    model = compile_step(model, cfg.compile)
    try:  # --grammar on: the task's grammar around the model, for every search, score and gradient
        model = grammar.constrain(model, task, cfg.grammar, cfg.max_len)
        grammar.check_references(model, task, device)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if distributed.rank() > 0:  # its own dropout masks; rank 0 goes on as a single process would
        torch.manual_seed(cfg.seed + 1000 * distributed.rank())
    if distributed.rank() == 0:
        rundir.remove(stale)  # --overwrite's old run; the residue of writes a killed process left
    trainer = Run.assemble(cfg, task, model, reward, device)
    trainer.base_model = base  # recorded in every checkpoint (runstate)
    if state is not None:
        trainer.load_state(state)
    if trainer.is_main and not cfg.eval_only:
        start_run_dir(trainer, state, recipe_defaults(cfg))
    if cfg.tensorboard and trainer.is_main and not cfg.eval_only:
        open_tensorboard(trainer, resumed=state is not None)
    return trainer


def compile_step(model, flag: str):
    """--compile: the model with phase one's decode step through torch.compile (`twophase.compiled`; the grammar
    of --grammar on wraps it, eager), or the model itself (off)."""
    if flag == "off":
        return model
    return compiled(model, backend="inductor" if flag == "on" else flag)


def claim_and_read(cfg: Config, start: dict | None):
    """The save dir checked (writable, holding no other run; the files --overwrite is to delete, once the run can
    start), and the checkpoint --resume continues (`state`) or --init-from starts from (`init`), checked."""
    stale = []
    try:
        if not cfg.eval_only:  # --eval-only writes nothing, anywhere
            rundir.check_writable(cfg.save_dir)
            stale = rundir.claim(cfg.save_dir, bool(cfg.resume or cfg.resume_from), cfg.overwrite)
        return stale, resume_state(cfg, start), init_state(cfg, start)
    except ValueError as err:
        raise UsageError(str(err)) from None


def default_save_dir(task) -> str:
    """--save-dir when not given: runs/<task name> (a custom task without a name: its callable's)."""
    name = task.name if task.name != tasks.Task.name else task.spec.rpartition(":")[2]
    return f"runs/{name.lower()}"


def open_tensorboard(trainer: Run, resumed: bool) -> None:
    """--tensorboard: <save-dir>/tensorboard, its steps after the checkpoint purged on --resume (as in
    metrics.jsonl); a new run starts without the event files of the run it replaces."""
    folder = trainer.save_dir / "tensorboard"
    if not resumed and folder.is_dir():
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
    writer = tensorboard.writer_class()(log_dir=str(folder), purge_step=trainer.log_step + 1 if resumed else None)
    trainer.metrics.mirror = tensorboard.TensorBoardLog(writer, lambda: trainer.mle_end)


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
    """The trainer train.py would build from these flags (the recipe's defaults, --init-from's model flags under
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
    args = parser.parse_args(argv)
    more, start = start_defaults(args)  # --resume: the checkpoint's configuration; --init-from: its model's
    if start is not None and more:  # these become the defaults too, so the file's and the flags given still win
        unknown = sorted(set(more) - {f.name for f in fields(Config)})
        if unknown:
            refuse(f"the checkpoint's configuration names no flag: {', '.join(unknown)}")
        parser = build_parser()  # without the recipe of the task the command line named (--init-from: its own)
        parser.set_defaults(**{**more, **layer})
        args = parser.parse_args(argv)
    given = startup.flags_given(build_parser(), argv) | configfile.changed(layer)
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
    except (UsageError, DataError, rewards.RewardError, tasks.TaskError, SaveError, startup.StartupError,
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
    trainer = build(cfg, start, given, model=model, task=task, reward=reward)
    if cfg.eval_only:
        scores = evaluate(trainer)
        table = runs.evaluation_table(trainer.task, scores)
        if trainer.is_main:
            step = (start or {}).get("step", trainer.step)
            print(f"{runs.resume_path(cfg) or cfg.init_from} (step {step}):\n" + table)
        return Result(cfg, trainer.save_dir.absolute(), scores, table)
    if trainer.is_main:
        test = f" / {len(trainer.test)} test" if trainer.test is not None else ""
        threads = torch.get_num_threads()
        print(f"task {trainer.task.spec}: {len(trainer.train)} train / {len(trainer.valid)} valid{test} sources; "
              f"reward {trainer.reward.name}; "
              f"{sum(p.numel() for p in trainer.model.parameters()):,} parameters{trainable(trainer.model)} on "
              f"{trainer.device}"
              + (f", {threads} CPU thread{'s' * (threads > 1)}" if trainer.device.type == "cpu" else "")
              + (f" (x {distributed.world()} processes)" if distributed.world() > 1 else ""), flush=True)
    try:
        summary = trainer.run()
        exported = save_final(trainer)
    finally:
        if trainer.metrics.mirror is not None:
            trainer.metrics.mirror.close()
    best, folder = trainer.checkpoints, trainer.save_dir.absolute()  # the Result's paths: from anywhere
    result = Result(cfg, folder, summary, summary_table(summary, with_beams(trainer.task.metrics,
                                                                            test_beams(trainer.cfg))),
                    model=trainer.model, best_metric=trainer.best_key, best=best.best, best_step=trainer.best_step,
                    best_checkpoint=if_written(folder / best.best_path.name) if best.best is not None else None,
                    last_checkpoint=if_written(folder / best.last_path.name),
                    metrics=if_written(folder / "metrics.jsonl"), final_model=exported)
    if not trainer.is_main:
        return result
    print(result.table)
    for line in trainer.task.closing_lines():  # Karel: its baselines, beside the table
        print(line)
    if best.best is not None:
        print(f"best {trainer.best_key}: {best.best:.4f} at step {trainer.best_step}: {best.best_path}")
    print(closing_paths(trainer, exported))
    result.picture = draw_picture(trainer)
    if result.picture is not None:
        print(f"picture: {result.picture}")
    return result


def closing_paths(trainer: Run, exported) -> str:
    """The last line: the files the run wrote (a run of no steps writes no checkpoint and no log)."""
    metrics, last = trainer.save_dir / "metrics.jsonl", trainer.checkpoints.last_path
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


def save_final(trainer: Run):
    """The task's own export of the final model (--hf-model: save_pretrained into <save-dir>/hf_final), once,
    by the main process; None where the task has none."""
    plain = fsdp.plain_copy(trainer.model, trainer.task.build_model) if fsdp.is_sharded(trainer.model) else None
    if not trainer.is_main:
        return None
    try:
        return trainer.task.save_final(plain or runs.export_model(trainer), trainer.save_dir)
    except ValueError as err:  # --export best: a checkpoint_best.pt that does not fit
        raise UsageError(str(err)) from None
    except OSError as err:
        raise UsageError(f"cannot write the final model into {trainer.save_dir}: {err.strerror or err} "
                         f"({trainer.checkpoints.last_path} holds it)") from None


def draw_picture(trainer: Run):
    """--picture: <save-dir>/curves.png from the run's metrics.jsonl (twophase.plot), or None: turned off, no
    matplotlib, or nothing to draw. A picture that cannot be drawn costs the run nothing but a warning line."""
    if not trainer.cfg.picture or os.environ.get("TWOPHASE_PICTURE", "on").lower() in ("off", "0", "no"):
        return None
    out = trainer.save_dir / rundir.PICTURE
    try:
        plot.plot([trainer.save_dir / "metrics.jsonl"], out, [trainer.save_dir.name])
    except plot.NoMatplotlib:
        return None
    except plot.PlotError as err:
        print(f"{PROG}: warning: no picture: {err}", file=sys.stderr)
        return None
    except OSError as err:
        print(f"{PROG}: warning: no picture: cannot write {out}: {err.strerror or err}", file=sys.stderr)
        return None
    return out
