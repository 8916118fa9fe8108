"""Every `train.py` command of README.md's and the manual's shell blocks (docs/*.md; docs/results/ keeps what was
run then) parses with today's train.py: its flags exist and their values have their types. Parsed, not run: a
command's `...` (more flags of the reader's) and what follows a shell operator are cut off."""
import re
import shlex
from pathlib import Path

import pytest

from twophase.train import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "console", "")
OPERATOR = re.compile(r"\s(?:&&|\|\|?|>>?|;)\s")


def commands(page: Path) -> list[str]:
    """The arguments after train.py of each command in the page's shell blocks (continued lines joined)."""
    fence, lines = None, []
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence in SHELL:
            lines.append(line)
    out = []
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].rstrip()
        words = line.split()
        if "train.py" not in words or words[0] not in ("python", "torchrun", "nice"):
            continue
        rest = OPERATOR.split(line[line.index("train.py") + len("train.py"):] + " ", maxsplit=1)[0].strip()
        out.append(rest.removesuffix("...").strip())
    return out


COMMANDS = [(page.name, args) for page in PAGES for args in commands(page)]


def test_the_manual_has_train_py_commands():
    assert len(COMMANDS) > 30 and {"README.md", "distillation.md", "distributed.md"} <= {p for p, _ in COMMANDS}


@pytest.mark.parametrize("page, args", COMMANDS, ids=[f"{p}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_the_command_parses(page, args, capsys):
    try:
        cli.build_parser().parse_args(shlex.split(args))
    except SystemExit:
        pytest.fail(f"{page}: train.py {args}\n{capsys.readouterr().err}")
