"""`twophase-decode` / `python -m twophase.train.decode`: the best hypothesis for each input line.

Loads a checkpoint written by training (weights only: nothing in it is executed), reads one source per line,
and writes the highest-scoring beam hypothesis per line, in order. Empty lines give empty lines. Sources are
split and case-folded as in training (the checkpoint's flags); tokens the model never saw are counted on stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load
from .cli import UsageError, pick_device
from .config import DEFAULT_BEAM, OneLineParser
from ..tasks.data import DataError, pad_batch, read_lines, split_utf8_lines, tokenize_source
from ..models.seq2seq import Seq2Seq
from ..samples import best_rows
from ..search import beam_search
from ..vocab import Vocab


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
    return p


def read_input(path: str) -> list[str]:
    return split_utf8_lines(sys.stdin.buffer.read(), "<stdin>") if path == "-" else read_lines(path)


def load_model(path: str, device: torch.device):
    state = load(path, map_location=device)
    model = Seq2Seq(**state["model_config"]).to(device)
    model.load_state_dict(state["model"])
    return model.eval(), Vocab(state["src_vocab"]), Vocab(state["tgt_vocab"]), state["config"]


def source_tokens(line: str, char_source: bool, lowercase: bool) -> tuple[str, ...]:
    return tokenize_source(line.lower() if lowercase else line, char_source)


def unknown_tokens(src_vocab: Vocab, lines: list[str], char_source: bool, lowercase: bool) -> str | None:
    """One line for stderr counting the source tokens the model never saw (decoded as <unk>), or None."""
    count, in_lines, examples = 0, 0, []
    for line in lines:
        unseen = [t for t in source_tokens(line, char_source, lowercase) if t not in src_vocab.stoi]
        count, in_lines = count + len(unseen), in_lines + bool(unseen)
        examples += [t for t in dict.fromkeys(unseen) if t not in examples][:3 - len(examples)]
    if not count:
        return None
    return (f"twophase-decode: {count} unknown source tokens (in {in_lines} line{'s' * (in_lines > 1)}), e.g. "
            + ", ".join(repr(t) for t in examples))


def decode_lines(model, src_vocab, tgt_vocab, lines, char_source, char_target, beam_size, max_len,
                 batch_size, device, lowercase: bool = False) -> list[str]:
    out = [""] * len(lines)
    todo = [(i, src_vocab.encode(source_tokens(line, char_source, lowercase))) for i, line in enumerate(lines)]
    todo = [(i, ids) for i, ids in todo if ids]
    joiner = "" if char_target else " "
    for start in range(0, len(todo), batch_size):
        chunk = todo[start:start + batch_size]
        source = pad_batch([ids for _, ids in chunk], device)  # (B, S), (B,)
        best = best_rows(beam_search(model, source, beam_size, max_len))  # (B, T)
        for (i, _), row in zip(chunk, best.tolist()):
            out[i] = joiner.join(tgt_vocab.decode(row))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for flag in ("beam_size", "batch_size", "max_len"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        check_output(args.output)  # before decoding: a typo should not cost the whole decode
        device = pick_device(args.device)
        model, src_vocab, tgt_vocab, cfg = load_model(args.checkpoint, device)
        lines = read_input(args.input)
        # Checkpoints from before the flag existed: the built-in data (no --train) was always lower-case.
        split = cfg.get("char_source", False), cfg.get("lowercase_source", cfg.get("train") is None)
        hyps = decode_lines(model, src_vocab, tgt_vocab, lines, split[0], cfg.get("char_target", False),
                            args.beam_size, args.max_len or cfg["max_len"], args.batch_size, device,
                            lowercase=split[1])
        write_output(args.output, "".join(h + "\n" for h in hyps))
    except (UsageError, DataError, CheckpointError) as err:
        print(f"twophase-decode: error: {err}", file=sys.stderr)
        return 2
    report = unknown_tokens(src_vocab, lines, *split)
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
