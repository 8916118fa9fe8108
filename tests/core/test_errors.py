"""Every refusal of the user's input is one type, `OneLineError`, which the commands print as one line: the error
classes are listed independently, from the source (every class named ...Error that twophase defines), and each is
either a one-line refusal deriving from the base, keeping its other base, or named here as no refusal."""
import ast
import importlib
from pathlib import Path

from twophase.errors import OneLineError

ROOT = Path(__file__).resolve().parents[2] / "twophase"

# The refusals, each with the base its callers catch besides OneLineError.
REFUSALS = {
    "UsageError": ValueError, "ConfigError": ValueError, "ConfigFileError": ValueError, "TaskError": ValueError,
    "ExportMismatch": ValueError, "DataError": ValueError, "RewardError": ValueError, "PluginError": ValueError,
    "ResumeError": ValueError, "CheckpointError": ValueError, "Busy": ValueError,
    "DeviceError": ValueError, "ModelError": ValueError, "GrammarError": ValueError, "SaveError": OSError,
    "PlotError": Exception,
}
# Errors that refuse nothing a user gave: a program the model wrote is scored, not refused; a task's code reading a
# setting not its own is a bug in that code, whose traceback shows where.
NOT_REFUSALS = {"KarelSyntaxError", "NotATaskSetting"}


def _defined() -> dict[str, str]:
    """{class name: module} for every class of twophase whose name ends in Error or that raises as one of the
    refusals' kinds (its bases name an Error or an Exception)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            if node.name.endswith("Error") or any(b.endswith(("Error", "Exception")) for b in bases):
                found[node.name] = module
    return found


def test_every_refusal_derives_from_the_one_line_error_and_keeps_its_other_base():
    defined = _defined()
    internal = {name for name in defined if name.startswith("_")}  # a module's own control flow, never raised out
    signals = {"Interrupted", "NoMatplotlib"}  # a stop after the save; PlotError's missing extra (a refusal below)
    classified = set(REFUSALS) | NOT_REFUSALS | {"OneLineError"}
    assert set(defined) - internal - signals == classified, "classify the new error class here"
    for name, other in REFUSALS.items():
        cls = getattr(importlib.import_module(defined[name]), name)
        assert issubclass(cls, OneLineError) and issubclass(cls, other), name
    for name in NOT_REFUSALS:
        assert not issubclass(getattr(importlib.import_module(defined[name]), name), OneLineError), name


def test_the_commands_catch_the_one_line_error_alone():
    """train.py and twophase-decode print every refusal through one except clause: the base, no list of kinds."""
    for module in ("train/cli.py", "train/decode.py"):
        tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
        caught = {ast.unparse(h.type) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler)
                  and h.body and any(isinstance(n, ast.Return) and getattr(n.value, "value", None) == 2
                                     for n in h.body)}
        assert caught == {"OneLineError"}, (module, caught)
