"""`python train.py` / `twophase-train`: parse flags, build data, model and reward, run the trainer.

Bad input (flags, files, plug-ins) ends with one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import os
import sys

import torch

from . import amp, distributed
from .. import rewards
from .config import Config, OneLineParser, add_config_flags, config_from_args
from ..tasks.data import DataError, load_cmudict, load_tsv
from ..models.seq2seq import Seq2Seq
from .checkpoint import CheckpointError, load
from .report import summary_table
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
    if cfg.train is None:
        cfg.char_source, cfg.char_target = True, False  # CMUdict: spelling -> phonemes; decode reads this back
        train, valid, _ = load_cmudict()
    else:
        limits = dict(max_source_len=cfg.max_src_len, max_target_len=cfg.max_len - 1, too_long=cfg.too_long)
        train = load_tsv(cfg.train, cfg.char_source, cfg.char_target, **limits)
        valid = load_tsv(cfg.valid, cfg.char_source, cfg.char_target, **limits)
        for name, data in (("--train", train), ("--valid", valid)):
            if data.skipped and distributed.rank() == 0:
                print(f"{name}: skipped {data.skipped} lines longer than the limits (--too-long skip)")
    return train, valid


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
    for key in ("train", "valid", "char_source", "char_target", "embed_dim", "hidden_size", "bidirectional"):
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
    train, valid = load_data(cfg)
    if distributed.world() > min(cfg.batch_size, cfg.mle_batch_size, len(train)):
        raise UsageError(f"--batch-size {cfg.batch_size} and --mle-batch-size {cfg.mle_batch_size} count the "
                         f"sources of a whole step; {distributed.world()} processes need at least one each")
    state = resume_state(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
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
    trainer = Trainer(cfg, model, src_vocab, tgt_vocab, train, valid, reward, device)
    if state is not None:
        trainer.load_state(state)
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
            print(f"data: {len(trainer.train)} train / {len(trainer.valid)} valid sources; "
                  f"vocab {len(trainer.src_vocab)} -> {len(trainer.tgt_vocab)}; "
                  f"{sum(p.numel() for p in trainer.model.parameters()):,} parameters on {trainer.device}"
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
    print(summary_table(summary))
    print(f"metrics: {trainer.save_dir / 'metrics.jsonl'}; checkpoint: {trainer.save_dir / 'checkpoint_last.pt'}")
    return 0
