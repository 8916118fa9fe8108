"""`python train.py` / `twophase-train`: parse flags, build data, model and reward, run the trainer.

Bad input (flags, files, plug-ins) ends with one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import os
import sys

import torch

from . import amp, distributed, rundir
from .. import rewards
from .config import PRESETS, Config, OneLineParser, add_config_flags, config_from_args
from .. import tasks
from ..tasks.data import DataError
from .evaluation import score
from .checkpoint import CheckpointError, load
from .report import summary_table
from .interrupt import Interrupted
from .trainer import Trainer
from . import tensorboard


PROG = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(("train.py", "twophase-train")) \
    else "train.py"  # messages name the command the user typed


class UsageError(Exception):
    """A problem with what the user gave us; printed as one line, exit status 2."""


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description="MLE warm start, then two-phase sequence-level RL.")
    add_config_flags(parser)
    return parser


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    return device


def check_reward(reward, task) -> None:
    """Call the reward once before anything slow, on answers whose scores exist whatever the reward means: the
    references of the first two training sources against themselves, and an empty hypothesis. A plug-in that
    raises or returns NaN then stops the run in seconds, not at the first validation after the warm start."""
    examples = [ex for ex in task.train[:2] if ex.references]
    if not examples:  # a task without references (execution rewards, say): an empty hypothesis only
        examples = task.train[:1]
    hyps = [ex.references[0] if ex.references else "" for ex in examples] + [""]
    try:
        score(reward, hyps, examples + examples[:1])
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


def resume_state(cfg: Config) -> dict | None:
    """The checkpoint --resume continues from, checked against the flags of this run."""
    if not cfg.resume:
        return None
    path = f"{cfg.save_dir}/checkpoint_last.pt"
    try:
        state = load(path)
    except CheckpointError as err:
        raise UsageError(f"--resume: {err}") from None
    saved = state["config"]
    for key in ("task", "train", "valid", "char_source", "char_target", "lowercase_source", "embed_dim",
                "hidden_size", "bidirectional", "best_metric", "hf_model", "karel_model", "karel_channels",
                "karel_blocks", "karel_pair_dim", "karel_layers"):
        if key in saved and saved[key] != getattr(cfg, key):
            raise UsageError(f"--resume: {path} was trained with --{key.replace('_', '-')} {saved[key]}, "
                             f"not {getattr(cfg, key)}")
    return state


def build(cfg: Config) -> Trainer:
    try:
        cfg.validate()
    except ValueError as err:
        raise UsageError(str(err)) from None
    device = distributed.local_device(pick_device(cfg.device))  # under torchrun: cuda:LOCAL_RANK
    try:
        amp.check_device(cfg.amp, device)
    except ValueError as err:
        raise UsageError(str(err)) from None
    distributed.init(device)  # a no-op without torchrun
    if cfg.hf_model is not None:  # saved as an absolute path: --resume and decoding find it from anywhere
        cfg.hf_model = os.path.abspath(cfg.hf_model)
    if distributed.rank() == 0:  # once, not once per process
        for warning in cfg.warnings():
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    cfg.task = tasks.default_name(cfg)  # saved as resolved, as the reward and the best metric
    task = tasks.build(cfg)  # cheap: the data comes later
    cfg.reward = cfg.reward or task.default_reward
    reward = rewards.get(cfg.reward)  # before loading data: a typo should fail in a second, not after it
    cfg.best_metric = resolve_best_metric(cfg, task)
    if cfg.tensorboard:
        try:
            tensorboard.writer_class()
        except ImportError as err:
            raise UsageError(str(err)) from None
    try:  # refuse a directory holding another run now; its files are removed only once this run can start
        stale = rundir.claim(cfg.save_dir, cfg.resume, cfg.overwrite)
    except ValueError as err:
        raise UsageError(str(err)) from None
    state = resume_state(cfg)
    load_task_data(task, state)
    if distributed.world() > min(cfg.batch_size, cfg.mle_batch_size, len(task.train)):
        raise UsageError(f"--batch-size {cfg.batch_size} and --mle-batch-size {cfg.mle_batch_size} count the "
                         f"sources of a whole step; {distributed.world()} processes need at least one each")
    check_reward(reward, task)
    torch.manual_seed(cfg.seed)
    threads = cpu_threads(cfg, getattr(task, "model_width", None))
    if threads:
        torch.set_num_threads(threads)
    model = task.build_model().to(device)
    distributed.broadcast_parameters(model)  # the seed already agrees; this makes sure
    if distributed.rank() > 0:  # its own dropout masks; rank 0 goes on as a single process would
        torch.manual_seed(cfg.seed + 1000 * distributed.rank())
    if distributed.rank() == 0:
        rundir.remove(stale)  # --overwrite
    trainer = Trainer(cfg, task, model, reward, device)
    if state is not None:
        trainer.load_state(state)
        if trainer.is_main:  # one run, one log: rows of steps after the checkpoint were lost with it
            for log in rundir.LOGS:
                rundir.cut_back(trainer.save_dir / log, trainer.log_step)
    if cfg.tensorboard and trainer.is_main:
        open_tensorboard(trainer, resumed=state is not None)
    return trainer


def open_tensorboard(trainer: Trainer, resumed: bool) -> None:
    """--tensorboard: <save-dir>/tensorboard, its steps after the checkpoint purged on --resume (as in
    metrics.jsonl); a new run starts without the event files of the run it replaces."""
    folder = trainer.save_dir / "tensorboard"
    if not resumed and folder.is_dir():
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
    writer = tensorboard.writer_class()(log_dir=str(folder), purge_step=trainer.log_step + 1 if resumed else None)
    trainer.metrics.mirror = tensorboard.TensorBoardLog(writer, lambda: trainer.mle_end)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = recipe_defaults(args)
    if defaults:  # the recipe's values become the defaults, so the flags given on the command line still win
        unknown = sorted(set(defaults) - set(vars(args)))
        if unknown:
            parser.error(f"--task {args.task}: its flag_defaults name no flag: {', '.join(unknown)}")
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        return _train(cfg)
    finally:
        distributed.finish()


def recipe_defaults(args) -> dict:
    """The defaults a run starts from, beyond the flags' own: its task's (`Task.flag_defaults`: Karel's model
    size and RL recipe, say), then --preset's. Flags given on the command line win over both."""
    try:
        factory = tasks.get(tasks.default_name(args))
    except tasks.TaskError:
        factory = None  # reported in one line when the run builds its task
    defaults = dict(getattr(factory, "flag_defaults", None) or {})
    if args.preset:
        defaults.update(PRESETS[args.preset])
    return defaults


def _train(cfg: Config) -> int:
    try:
        trainer = build(cfg)
        if trainer.is_main:
            test = f" / {len(trainer.test)} test" if trainer.test is not None else ""
            threads = torch.get_num_threads()
            print(f"task {trainer.task.spec}: {len(trainer.train)} train / {len(trainer.valid)} valid{test} sources; "
                  f"reward {trainer.reward.name}; "
                  f"{sum(p.numel() for p in trainer.model.parameters()):,} parameters on {trainer.device}"
                  + (f", {threads} CPU thread{'s' * (threads > 1)}" if trainer.device.type == "cpu" else "")
                  + (f" (x {distributed.world()} processes)" if distributed.world() > 1 else ""), flush=True)
        try:
            summary = trainer.run()
            exported = save_final(trainer)
        finally:
            if trainer.metrics.mirror is not None:
                trainer.metrics.mirror.close()
    except (UsageError, DataError, rewards.RewardError, tasks.TaskError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        if distributed.rank() == 0:  # the one that saved
            print(f"{PROG}: {stop}", file=sys.stderr)
        return stop.code
    if not trainer.is_main:
        return 0
    print(summary_table(summary, trainer.task.metrics))
    best = trainer.checkpoints
    if best.best is not None:
        print(f"best {trainer.best_key}: {best.best:.4f} at step {trainer.best_step}: {best.best_path}")
    print(f"metrics: {trainer.save_dir / 'metrics.jsonl'}; checkpoint: {best.last_path}"
          + (f"; final model: {exported}" if exported else ""))
    return 0


def save_final(trainer: Trainer):
    """The task's own export of the final model (--hf-model: save_pretrained into <save-dir>/hf_final), once,
    by the main process; None where the task has none."""
    if not trainer.is_main:
        return None
    try:
        return trainer.task.save_final(trainer.model, trainer.save_dir)
    except OSError as err:
        raise UsageError(f"cannot write the final model into {trainer.save_dir}: {err.strerror or err} "
                         f"({trainer.checkpoints.last_path} holds it)") from None
