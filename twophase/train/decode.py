"""`twophase-decode` / `python -m twophase.train.decode`: the best hypothesis for each input line.

Loads a checkpoint written by training (weights only: nothing in it is executed), reads one source per line,
and writes the highest-scoring beam hypothesis per line, in order. Empty lines give empty lines. The
checkpoint's task reads the sources (split and case-folded as in training) and writes the hypotheses; tokens the
model never saw are counted on stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import grammar
from .checkpoint import CheckpointError, load
from .cli import UsageError, pick_device
from .config import DEFAULT_BEAM, OneLineParser, config_from_dict
from .. import tasks
from ..tasks.base import Example
from ..tasks.data import DataError, read_lines, split_utf8_lines
from .evaluation import best_hypotheses


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="twophase-decode", description="Decode input lines with a trained checkpoint.")
    p.add_argument("--checkpoint", required=True, help="a checkpoint_*.pt written by train.py")
    p.add_argument("--input", default="-", help="UTF-8 file with one source per line; - for stdin (default)")
    p.add_argument("--output", default="-", help="where hypotheses go, one per line; - for stdout (default)")
    p.add_argument("--beam-size", type=int, default=DEFAULT_BEAM,
                   help=f"beam width (default: {DEFAULT_BEAM}, as training's validation)")
    p.add_argument("--max-len", type=int, default=None, help="longest output (default: the training --max-len)")
    p.add_argument("--batch-size", type=int, default=128, help="sources decoded together (default: 128)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--grammar", choices=("off", "on"), default=None,
                   help="constrain decoding to the task's grammar (default: as the checkpoint was trained)")
    p.add_argument("--hf-model", default=None,
                   help="a checkpoint of a --hf-model run: the folder to read the model's config and tokenizer "
                        "from (default: the training --hf-model; the run's hf_final folder holds both too); the "
                        "parameters are the checkpoint's")
    return p


def read_input(path: str) -> list[str]:
    return split_utf8_lines(sys.stdin.buffer.read(), "<stdin>") if path == "-" else read_lines(path)


def load_model(path: str, device: torch.device, hf_model: str | None = None):
    """The checkpoint's model in evaluation mode, its task (ids restored, no data read) and its training config;
    `hf_model`: where a --hf-model run's config and tokenizer are now (default: where training read them)."""
    state = load(path, map_location=device)
    saved = state["config"]
    cfg = config_from_dict(saved)
    if hf_model is not None:
        if cfg.hf_model is None:
            raise UsageError(f"--hf-model: {path} was not trained with --hf-model")
        cfg.hf_model = hf_model
    if "task" in state:
        task = tasks.build(cfg, state["task"]["spec"])
        task.load_state_dict(state["task"]["state"])
    else:  # written before tasks existed: CMUdict or TSV text, with the vocabularies at the top level
        task = tasks.build(cfg, "tsv" if saved.get("train") else "g2p")
        task.load_state_dict({"src_vocab": state["src_vocab"], "tgt_vocab": state["tgt_vocab"],
                              "char_source": saved.get("char_source", True),
                              "char_target": saved.get("char_target", False),
                              "fold_case": saved.get("lowercase_source", saved.get("train") is None)})
    model = task.build_model().to(device)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # --hf-model naming another architecture than the one trained, say
        raise CheckpointError(f"{path}: its parameters do not fit the model its task builds "
                              f"({str(err).strip().splitlines()[-1].strip()})") from None
    return model.eval(), task, saved


def unknown_tokens(task, sources: list) -> str | None:
    """One line for stderr counting the source tokens the model never saw (decoded as <unk>), or None."""
    count, in_lines, examples = 0, 0, []
    for source in sources:
        unseen = task.unknown_source_tokens(source)
        count, in_lines = count + len(unseen), in_lines + bool(unseen)
        examples += [t for t in dict.fromkeys(unseen) if t not in examples][:3 - len(examples)]
    if not count:
        return None
    return (f"twophase-decode: {count} unknown source tokens (in {in_lines} line{'s' * (in_lines > 1)}), e.g. "
            + ", ".join(repr(t) for t in examples))


def decode_lines(model, task, lines: list[str], beam_size: int, max_len: int, batch_size: int,
                 device) -> tuple[list[str], list]:
    """The best hypothesis of each non-blank line (blank lines give empty lines), as the task formats it, and
    the parsed sources."""
    out = [""] * len(lines)
    todo = [(i, Example(task.parse_source(line))) for i, line in enumerate(lines) if line.strip()]
    hyps = best_hypotheses(model, task, [ex for _, ex in todo], beam_size, max_len, device, batch_size)
    for (i, _), hyp in zip(todo, hyps):
        out[i] = task.format_output(hyp)
    return out, [ex.source for _, ex in todo]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for flag in ("beam_size", "batch_size", "max_len"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        check_output(args.output)  # before decoding: a typo should not cost the whole decode
        device = pick_device(args.device)
        model, task, cfg = load_model(args.checkpoint, device, args.hf_model)
        max_len = args.max_len or cfg["max_len"]
        try:
            model = grammar.constrain(model, task, args.grammar or cfg.get("grammar", "off"), max_len)
        except ValueError as err:
            raise UsageError(str(err)) from None
        lines = read_input(args.input)
        hyps, sources = decode_lines(model, task, lines, args.beam_size, max_len, args.batch_size, device)
        write_output(args.output, "".join(h + "\n" for h in hyps))
    except (UsageError, DataError, CheckpointError, tasks.TaskError) as err:
        print(f"twophase-decode: error: {err}", file=sys.stderr)
        return 2
    report = unknown_tokens(task, sources)
    if report:
        print(report, file=sys.stderr)
    return 0


def check_output(path: str) -> None:
    """--output must go into an existing directory: an error naming it, rather than creating a mistyped path."""
    if path != "-" and not Path(path).resolve().parent.is_dir():
        raise UsageError(f"--output {path}: no such directory {str(Path(path).parent)!r}")


def write_output(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise UsageError(f"--output {path}: {err.strerror}") from None


if __name__ == "__main__":
    sys.exit(main())
