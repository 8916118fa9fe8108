"""`python train.py` / `twophase-train`: parse flags, build data, model and reward, run the trainer.

Bad input (flags, files, plug-ins) ends with one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import os
import sys

import torch

from . import amp, distributed, rundir
from .. import rewards
from .config import Config, OneLineParser, add_config_flags, config_from_args
from ..tasks.data import Dataset, DataError, load_cmudict, load_tsv
from ..models.seq2seq import Seq2Seq
from .checkpoint import CheckpointError, load
from .report import best_metric, summary_table
from .interrupt import Interrupted
from .trainer import Trainer
from ..vocab import Vocab


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


def load_data(cfg: Config):
    """train, valid and test (None without --test) Datasets; for the built-in data, sets the flags that describe it
    (the checkpoint keeps them, and decoding reads them back)."""
    if cfg.train is None:
        # CMUdict: the letters of lower-case words -> phonemes
        cfg.char_source, cfg.char_target, cfg.lowercase_source = True, False, True
        return load_cmudict()
    limits = dict(max_source_len=cfg.max_src_len, max_target_len=cfg.max_len - 1, too_long=cfg.too_long,
                  lowercase_source=cfg.lowercase_source)
    data = {}
    for name in ("train", "valid", "test"):
        path = getattr(cfg, name)
        data[name] = None if path is None else load_tsv(path, cfg.char_source, cfg.char_target, **limits)
        if data[name] is not None and data[name].skipped and distributed.rank() == 0:
            print(f"--{name}: skipped {data[name].skipped} lines longer than the limits (--too-long skip)")
    return data["train"], data["valid"], data["test"]


def check_reward(reward, train: Dataset) -> None:
    """Call the reward once before anything slow, on answers whose scores exist whatever the reward means: the
    references of the first two training sources against themselves, and an empty hypothesis. A plug-in that
    raises or returns NaN then stops the run in seconds, not at the first validation after the warm start."""
    refs = [[" ".join(r) for r in train.references[i]] for i in range(min(2, len(train)))]
    try:
        reward([rs[0] for rs in refs] + [""], refs + refs[:1])
    except rewards.RewardError as err:
        raise rewards.RewardError(f"{err} (start-up check: {len(refs)} training references scored against "
                                  "themselves and an empty hypothesis)") from None


def cpu_threads(cfg: Config) -> int | None:
    """--threads, or for 0 (auto) the count to set (None: leave torch's default). A small model's matmuls are
    too small to share out, and torch's threads wait for one another at every op: with another process busy on
    the machine, 2 threads ran hidden-16 and hidden-256 MLE steps 16-20x slower than 1 (2 shared cores)."""
    if cfg.threads:
        return cfg.threads
    if "OMP_NUM_THREADS" in os.environ or cfg.hidden_size >= 512:
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
    for key in ("train", "valid", "char_source", "char_target", "lowercase_source", "embed_dim", "hidden_size",
                "bidirectional", "best_metric"):
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
    if distributed.rank() == 0:  # once, not once per process
        for warning in cfg.warnings():
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    reward = rewards.get(cfg.reward)  # before loading data: a typo should fail in a second, not after it
    try:  # refuse a directory holding another run now; its files are removed only once this run can start
        stale = rundir.claim(cfg.save_dir, cfg.resume, cfg.overwrite)
    except ValueError as err:
        raise UsageError(str(err)) from None
    train, valid, test = load_data(cfg)
    cfg.best_metric = best_metric(cfg.best_metric, builtin_data=cfg.train is None)  # saved as resolved
    if distributed.world() > min(cfg.batch_size, cfg.mle_batch_size, len(train)):
        raise UsageError(f"--batch-size {cfg.batch_size} and --mle-batch-size {cfg.mle_batch_size} count the "
                         f"sources of a whole step; {distributed.world()} processes need at least one each")
    check_reward(reward, train)
    state = resume_state(cfg)
    torch.manual_seed(cfg.seed)
    threads = cpu_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    if state is None:
        src_vocab = Vocab.build(train.sources)
        tgt_vocab = Vocab.build(r for refs in train.references for r in refs)
    else:  # the saved ids, whatever the data would build today
        src_vocab, tgt_vocab = Vocab(state["src_vocab"]), Vocab(state["tgt_vocab"])
    model = Seq2Seq(len(src_vocab), len(tgt_vocab), cfg.embed_dim, cfg.hidden_size, cfg.dropout,
                    cfg.bidirectional).to(device)
    distributed.broadcast_parameters(model)  # the seed already agrees; this makes sure
    if distributed.rank() > 0:  # its own dropout masks; rank 0 goes on as a single process would
        torch.manual_seed(cfg.seed + 1000 * distributed.rank())
    if distributed.rank() == 0:
        rundir.remove(stale)  # --overwrite
    trainer = Trainer(cfg, model, src_vocab, tgt_vocab, train, valid, reward, device, test=test)
    if state is not None:
        trainer.load_state(state)
        if trainer.is_main:  # one run, one log: rows of steps after the checkpoint were lost with it
            for log in rundir.LOGS:
                rundir.cut_back(trainer.save_dir / log, trainer.step)
    return trainer


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(build_parser().parse_args(argv))
    try:
        return _train(cfg)
    finally:
        distributed.finish()


def _train(cfg: Config) -> int:
    try:
        trainer = build(cfg)
        if trainer.is_main:
            test = f" / {len(trainer.test)} test" if trainer.test is not None else ""
            threads = torch.get_num_threads()
            print(f"data: {len(trainer.train)} train / {len(trainer.valid)} valid{test} sources; "
                  f"vocab {len(trainer.src_vocab)} -> {len(trainer.tgt_vocab)}; "
                  f"{sum(p.numel() for p in trainer.model.parameters()):,} parameters on {trainer.device}"
                  + (f", {threads} CPU thread{'s' * (threads > 1)}" if trainer.device.type == "cpu" else "")
                  + (f" (x {distributed.world()} processes)" if distributed.world() > 1 else ""), flush=True)
        summary = trainer.run()
    except (UsageError, DataError, rewards.RewardError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        if distributed.rank() == 0:  # the one that saved
            print(f"{PROG}: {stop}", file=sys.stderr)
        return stop.code
    if not trainer.is_main:
        return 0
    print(summary_table(summary, builtin_data=cfg.train is None))
    best = trainer.checkpoints
    if best.best is not None:
        print(f"best {trainer.best_key}: {best.best:.4f} at step {trainer.best_step}: {best.best_path}")
    print(f"metrics: {trainer.save_dir / 'metrics.jsonl'}; checkpoint: {best.last_path}")
    return 0
