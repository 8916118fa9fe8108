"""`twophase-decode` / `python -m twophase.train.decode`: the best hypothesis for each input line.

Loads a checkpoint written by training (weights only: nothing in it is executed), reads one source per line,
and writes the highest-scoring beam hypothesis per line, in order. Empty lines give empty lines. The
checkpoint's task reads the sources (split and case-folded as in training) and writes the hypotheses; tokens the
model never saw are counted on stderr. A line the task cannot read or decode (longer than training allowed, out
of the model's positions, a `collate` that raises) stops the decode with one line naming FILE:LINE.

`--nbest K` writes the K best beam hypotheses of every input line, best first, as K output lines (empty lines
where the beam found fewer); `--scores` puts each hypothesis' log-probability and a tab before it (`-inf` and
a tab where the beam found fewer). A blank input line is not decoded: it gives K blank lines, with or without
`--scores`.
A task plug-in (`--task module:callable`) is imported from where training found it (the checkpoint records the
folder), whatever the directory decode runs in.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import resume
from ..constraints import constrain
from ..errors import UsageError
from .recipe import compile_step, pick_device
from .checkpoint import CheckpointError, load
from ..config import DEFAULT_BEAM, OneLineParser, config_from_dict
from .. import oom, tasks
from ..tasks.base import Example
from ..tasks.data import DataError, read_lines, split_utf8_lines
from ..plugins import brief
from ..errors import OneLineError
from ..protocol import ModelError
from ..phase1.search import beam_search
from ..system.fsdp import load_saved


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="twophase-decode", description="Decode input lines with a trained checkpoint.")
    p.add_argument("--checkpoint", required=True, help="a checkpoint_*.pt written by train.py")
    p.add_argument("--input", default="-", help="UTF-8 file with one source per line; - for stdin (default)")
    p.add_argument("--output", default="-", help="where hypotheses go, one per line; - for stdout (default)")
    p.add_argument("--beam-size", type=int, default=DEFAULT_BEAM,
                   help=f"beam width (default: {DEFAULT_BEAM}, as training's validation)")
    p.add_argument("--max-len", type=int, default=None, help="longest output (default: the training --max-len)")
    p.add_argument("--batch-size", type=int, default=128, help="sources decoded together (default: 128)")
    p.add_argument("--nbest", type=int, default=1,
                   help="write the K best hypotheses of each line, best first, as K lines (default: 1; at most "
                        "--beam-size)")
    p.add_argument("--scores", action="store_true",
                   help="prefix each hypothesis with its log-probability under the model and a tab")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--grammar", choices=("off", "on"), default=None,
                   help="constrain decoding to the task's grammar (default: as the checkpoint was trained)")
    p.add_argument("--compile", choices=("off", "on", "aot_eager", "eager"), default="off",
                   help="the decode step through torch.compile: on (inductor), or a backend that only traces "
                        "(what it pays: docs/compile.md) (default: off)")
    p.add_argument("--hf-model", default=None,
                   help="a checkpoint of a --hf-model run: the folder to read the model's config and tokenizer "
                        "from (default: the training --hf-model; the run's hf_final folder holds both too); the "
                        "parameters are the checkpoint's. A --lora-r run's checkpoint holds its adapters alone: "
                        "the folder of its base model, wherever it is now (its fingerprint is checked)")
    return p


def read_input(path: str) -> list[str]:
    return split_utf8_lines(sys.stdin.buffer.read(), "<stdin>") if path == "-" else read_lines(path)


def load_model(path: str, device: torch.device, hf_model: str | None = None):
    """The checkpoint's model in evaluation mode, its task (ids restored, no data read) and its training config;
    `hf_model`: where a --hf-model run's config and tokenizer are now (default: where training read them)."""
    if Path(path).is_dir():  # a run's directory: say which file
        raise UsageError(f"--checkpoint {path}: a directory; give a checkpoint file, e.g. "
                         f"{Path(path) / 'checkpoint_best.pt'}")
    state = load(path, mmap=True)  # on the CPU, the optimizer's state never read; the model's copied onto device
    saved = state["config"]
    try:
        cfg = config_from_dict(saved)
    except ValueError as err:  # a value an older version recorded that this one refuses
        raise UsageError(f"--checkpoint {path}: its recorded configuration: {err}") from None
    if hf_model is not None:
        if cfg.hf_model is None:
            raise UsageError(f"--hf-model: {path} was not trained with --hf-model")
        folder = Path(hf_model)
        if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
            raise UsageError(f"--hf-model {hf_model}: LoRA adapters (a --lora-r run's hf_final), not a model; the "
                             f"checkpoint holds its adapters: give the folder of the base model they adapt "
                             f"(default: training's, {cfg.hf_model})")
        cfg.hf_model = hf_model
    if "task" in state:
        task = build_task(cfg, state["task"]["spec"], state["task"].get("origin"))
        task.load_state_dict(state["task"]["state"])
    else:  # written before tasks existed: CMUdict or TSV text, with the vocabularies at the top level
        task = tasks.build(cfg, "tsv" if saved.get("train") else "g2p")
        task.load_state_dict({"src_vocab": state["src_vocab"], "tgt_vocab": state["tgt_vocab"],
                              "char_source": saved.get("char_source", True),
                              "char_target": saved.get("char_target", False),
                              "fold_case": saved.get("lowercase_source", saved.get("train") is None)})
    model = task.build_model().to(device)
    try:  # a --lora-r checkpoint's adapters need the base they were trained on
        resume.check(state.get("base_model"), resume.record(model, cfg.hf_model), path, cfg.hf_model)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        load_saved(model, state["model"])
    except RuntimeError as err:  # --hf-model naming another architecture than the one trained, say
        own = "" if cfg.hf_model else ("; a run trained on a model of its own (twophase.fit(config, model=...)) "
                                       "decodes in Python: that model with the checkpoint's 'model' state dict "
                                       "loaded, and twophase.beam_search")
        raise CheckpointError(f"{path}: its parameters do not fit the model its task builds "
                              f"({str(err).strip().splitlines()[-1].strip()}){own}") from None
    return model.eval(), task, saved


def build_task(cfg, spec: str, origin: str | None):
    """The checkpoint's task; a plug-in module that does not import from here is looked for in the folder
    training imported it from (`origin`), or the error says where to run."""
    try:
        return tasks.build(cfg, spec)
    except tasks.TaskError as err:
        if ":" not in spec:
            raise
        if origin and Path(origin).is_dir() and origin not in sys.path:
            sys.path.append(origin)  # as training's working directory (or PYTHONPATH) had it
            return tasks.build(cfg, spec)
        where = f"it was trained from {origin}" if origin else "it was trained from another folder"
        raise tasks.TaskError(f"{err} ({where}: run twophase-decode there, or put the module's folder on "
                              "PYTHONPATH)") from None


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
                 device, nbest: int = 1, scores: bool = False, name: str = "<input>") -> tuple[list[str], list]:
    """The output lines (the best hypothesis of each non-blank line as the task formats it, blank lines for blank
    lines; with nbest/scores see the module docstring) and the parsed sources. DataError naming name:LINE
    for a line the task cannot read or decode."""
    todo = parse_lines(task, lines, max_len, name)
    found = ranked(model, task, todo, beam_size, nbest, max_len, device, batch_size, name)
    best = {number: hyps for (number, _), hyps in zip(todo, found)}
    out = []
    for number in range(1, len(lines) + 1):
        if number not in best:  # a blank line: nothing decoded, so no hypothesis and no score (not -inf)
            out += [""] * nbest
            continue
        hyps = best[number]
        if nbest == 1 and not scores:
            out.append(task.format_output(hyps[0][1]) if hyps else "")
            continue
        for k in range(nbest):
            if k < len(hyps):
                text = task.format_output(hyps[k][1])
                out.append(f"{hyps[k][0]:.4f}\t{text}" if scores else text)
            else:
                out.append("-inf\t" if scores else "")
    return out, [ex.source for _, ex in todo]


def parse_lines(task, lines: list[str], max_len: int, name: str) -> list[tuple[int, Example]]:
    """(line number, Example) of every non-blank line, read by the task and checked as training checks it."""
    todo = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            source = task.parse_source(line)
            problem = task.source_problem(source, max_len)
        except DataError as err:
            raise DataError(f"{name}:{number}: {err}") from None
        except Exception as exc:  # a plug-in's parse_source may raise anything
            raise DataError(f"{name}:{number}: task '{task.spec}' cannot read this line ({brief(exc)})") from None
        if problem:
            raise DataError(f"{name}:{number}: {problem}")
        todo.append((number, Example(source)))
    return todo


@torch.inference_mode()
def ranked(model, task, todo: list[tuple[int, Example]], beam_size: int, nbest: int, max_len: int, device,
           batch_size: int, name: str) -> list[list[tuple[float, str]]]:
    """The `nbest` best (log-probability, hypothesis) of each example, best first (beam search's order)."""
    out = []
    for start in range(0, len(todo), batch_size):
        batch = todo[start:start + batch_size]
        try:
            s = beam_search(model, task.collate([ex for _, ex in batch], device), beam_size, max_len)
        except ModelError:
            raise
        except Exception as exc:  # a task's collate (or the ids it made) failing on some line
            if oom.is_out_of_memory(exc):
                raise UsageError(f"{name}:{batch[0][0]}-{batch[-1][0]}: out of memory decoding {len(batch)} lines "
                                 "together; lower --batch-size (or --beam-size)") from None
            raise culprit(model, task, batch, beam_size, max_len, device, name, exc) from None
        per = [[] for _ in batch]
        for row, owner, score in zip(s.tokens.tolist(), s.owner.tolist(), s.scores.tolist()):
            if len(per[owner]) < nbest:
                per[owner].append((score, task.detokenize(row)))
        out += per
    return out


def culprit(model, task, batch, beam_size: int, max_len: int, device, name: str, exc: Exception) -> DataError:
    """The first line of a failed batch that fails alone, as name:LINE with the task's exception."""
    for number, ex in batch:
        try:
            beam_search(model, task.collate([ex], device), beam_size, max_len)
        except Exception as alone:
            return DataError(f"{name}:{number}: task '{task.spec}' cannot decode this source ({brief(alone)})")
    return DataError(f"{name}:{batch[0][0]}-{batch[-1][0]}: task '{task.spec}' cannot decode these lines "
                     f"together ({brief(exc)})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for flag in ("beam_size", "batch_size", "max_len", "nbest"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        if args.nbest > args.beam_size:
            raise UsageError(f"--nbest {args.nbest}: the beam holds --beam-size {args.beam_size} hypotheses; "
                             f"raise --beam-size to at least {args.nbest}")
        check_output(args.output)  # before decoding: a typo should not cost the whole decode
        device = pick_device(args.device)
        model, task, cfg = load_model(args.checkpoint, device, args.hf_model)
        max_len = args.max_len or cfg["max_len"]
        model = compile_step(model, args.compile)
        try:
            model = constrain(model, task, args.grammar or cfg.get("grammar", "off"), max_len)
        except ValueError as err:
            raise UsageError(str(err)) from None
        lines = read_input(args.input)
        hyps, sources = decode_lines(model, task, lines, args.beam_size, max_len, args.batch_size, device,
                                     args.nbest, args.scores, "<stdin>" if args.input == "-" else args.input)
        write_output(args.output, "".join(h + "\n" for h in hyps))
    except OneLineError as err:
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
