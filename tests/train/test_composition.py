"""train/ by composition: no class in twophase/train/ derives from two or more of the project's own classes (a
run holds its trainer and parts; it is not assembled from base classes that share its attributes)."""
import ast
from pathlib import Path

import pytest
from twophase.train import recipe

ROOT = Path(__file__).resolve().parents[2] / "twophase"


def _project_names(tree: ast.Module) -> set[str]:
    """The names a module binds to the project's own objects: its classes, and what it imports from twophase
    (relative imports included)."""
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("twophase")):
            names |= {a.asname or a.name for a in node.names}
    return names


def _project_base(base: ast.expr, project: set[str]) -> str | None:
    """The base's class name where it is the project's: `Name` bound to one, or `module.Name` of a project
    module the file imported."""
    if isinstance(base, ast.Name) and base.id in project:
        return base.id
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in project:
        return base.attr
    return None


def project_bases(path: Path) -> dict[str, list[str]]:
    """class name -> its bases that are the project's own classes, for every class of the module at `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    project = _project_names(tree)
    return {node.name: [name for name in (_project_base(b, project) for b in node.bases) if name]
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_the_check_sees_a_class_of_two_project_bases(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from .a import A\nfrom . import b\nimport torch\n\n\nclass Own:\n    pass\n\n\n"
                      "class Mixed(A, b.B, Own, torch.nn.Module):\n    pass\n")
    assert project_bases(module) == {"Own": [], "Mixed": ["A", "B", "Own"]}


def test_no_class_in_train_derives_from_two_project_classes():
    files = sorted((ROOT / "train").rglob("*.py"))
    assert files
    mixed = {f"{path.relative_to(ROOT.parent)}:{name}": bases for path in files
             for name, bases in project_bases(path).items() if len(bases) >= 2}
    assert not mixed, mixed


def test_the_steps_have_no_baseline_branch():
    """The one-phase baseline and phase two without prefix sharing are measurements (benchmarks.baselines): no
    module of twophase/train/ reads a flag of them or imports the one-phase search."""
    found = []
    for path in sorted((ROOT / "train").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.name}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr in ("one_phase", "no_prefix_sharing")
                  or isinstance(n, ast.ImportFrom) and "onephase" in (n.module or "")]
    assert not found, found


def test_every_sequence_step_gets_phase_two(tmp_path):
    from twophase.train import cli
    from twophase.config import Config
    from twophase.train.steps.parts import PHASE_TWO
    from taskfiles import write_task
    write_task(tmp_path / "train.tsv", "reverse", 8, seed=0)
    run = recipe.setup(Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "train.tsv"), hidden_size=8,
                           embed_dim=4, batch_size=2, mle_batch_size=2, save_dir=str(tmp_path / "run")))
    assert run.trainer.rl.gradient is PHASE_TWO


# The run itself, and the command-line front that builds one and reports on it: the modules that may hold a Run.
FRONT = {"run.py", "cli.py", "fit.py", "recipe.py"}
RUN_NAMES = {"run", "training"}  # what the package calls a Run where it holds one


def _names_the_run(node: ast.expr) -> bool:
    """`run` / `training`, or `self.run` / `self.training`."""
    if isinstance(node, ast.Name):
        return node.id in RUN_NAMES
    return isinstance(node, ast.Attribute) and node.attr in RUN_NAMES and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def run_uses(path: Path) -> list[str]:
    """Where the module at `path` is given a Run or calls back into one: a parameter named run / training or
    annotated `Run`, an attribute of run / training / self.run, an import of the Run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is None:
                    continue
                annotation = ast.unparse(a.annotation) if a.annotation is not None else ""
                if a.arg in RUN_NAMES or "Run" in annotation.replace("'", "").replace('"', "").split("."):
                    found.append(f"{path.name}:{a.lineno}: parameter {a.arg}")
        elif isinstance(node, ast.Attribute) and (_names_the_run(node.value) or _names_the_run(node)):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "run" \
                and any(a.name == "Run" for a in node.names):
            found.append(f"{path.name}:{node.lineno}: imports Run")
    return sorted(set(found), key=lambda use: (int(use.split(":")[1]), use))


def test_the_run_check_sees_a_part_given_the_run(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from .run import Run\n\n\ndef part(run, x: 'Run'):\n    return run.trainer\n\n\n"
                      "class Part:\n    def __init__(self, r: Run):\n        self.run = r\n\n"
                      "    def step(self):\n        return self.run.train_step('mle')\n\n\n"
                      "def fine(trainer, running):\n    return trainer.run_count + running.step\n")
    assert run_uses(module) == ["m.py:1: imports Run", "m.py:4: parameter run", "m.py:4: parameter x",
                                "m.py:5: run.trainer", "m.py:9: parameter r", "m.py:10: self.run", "m.py:13: self.run",
                                "m.py:13: self.run.train_step"]


def test_no_part_of_train_is_given_the_run():
    """The run gives each part what it uses (the trainer, the state, the calls it makes); no part of train/ but
    the run itself and the command-line front holds the Run or calls back into it."""
    parts = sorted(p for p in (ROOT / "train").rglob("*.py") if p.name not in FRONT)
    assert len(parts) >= 8
    uses = [use for path in parts for use in run_uses(path)]
    assert not uses, uses


def test_every_objective_has_its_step_family():
    """The registry replaces the branches: each --objective choice names its RL step's family, none is left out."""
    from typing import get_args
    from twophase.config.sections import Objective
    from twophase.train.steps import STEPS
    assert set(STEPS) == set(get_args(Objective))


def _owners_in(value, owners: tuple) -> bool:
    """value is one of owners' instances, or a method bound to one."""
    return isinstance(value, owners) or isinstance(getattr(value, "__self__", None), owners)


@pytest.mark.parametrize("objective", ["beam", "reinforce", "policy", "distill"])
def test_no_part_holds_its_owner_or_its_owners_methods(tmp_path, objective):
    """Built for a run: no part the Run holds keeps the Run; the steps (MLE and the objective's RL step) and the
    parts they run on keep neither the trainer nor the Run, nor a method bound to either, and every step runs on
    the trainer's one `Parts`."""
    from twophase.train import cli
    from twophase.config import Config
    from twophase.train.run import Run
    from twophase.train.steps import STEPS
    from twophase.train.trainer import Trainer
    from taskfiles import write_task
    write_task(tmp_path / "train.tsv", "reverse", 8, seed=0)
    teacher = None
    if objective == "distill":  # a teacher: a checkpoint of the same vocabularies
        assert cli.main(["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "train.tsv"),
                         "--hidden-size", "8", "--embed-dim", "4", "--mle-steps", "1", "--rl-steps", "0",
                         "--save-dir", str(tmp_path / "teacher")]) == 0
        teacher = str(tmp_path / "teacher" / "checkpoint_last.pt")
    run = recipe.setup(Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "train.tsv"), hidden_size=8,
                           embed_dim=4, batch_size=2, mle_batch_size=2, objective=objective, teacher=teacher,
                           sampler="beam" if objective == "beam" else "sample", save_dir=str(tmp_path / "run")))
    tr = run.trainer
    assert type(tr.rl) is STEPS[objective]
    parts = [tr, run.state, run.checkpoints, run.metrics, run.plateau, run.comparison, run.saver, tr.parts, tr.mle,
             tr.rl]
    held = {type(part).__name__: [name for name, value in vars(part).items() if isinstance(value, Run)]
            for part in parts}
    assert not any(held.values()), held
    for part in (tr.parts, tr.mle, tr.rl):
        owned = [name for name, value in vars(part).items() if _owners_in(value, (Trainer, Run))]
        assert not owned, (type(part).__name__, owned)
        # a step is given its own sections of the configuration, never the whole record
        configs = [name for name, value in vars(part).items() if isinstance(value, Config)]
        assert not configs, (type(part).__name__, configs)
    # the --compare-mle control and the checkpoint it shares with the run: the trainer they wind back and save,
    # never the Run nor a method bound to the Run or the trainer
    for part in (run.comparison, run.saver):
        owned = [name for name, value in vars(part).items()
                 if _owners_in(value, (Run,)) or isinstance(getattr(value, "__self__", None), Trainer)]
        assert not owned, (type(part).__name__, owned)
    assert tr.mle.parts is tr.parts and tr.rl.parts is tr.parts
    assert not hasattr(tr, "train")  # the data splits are the task's; train() is the Run's loop alone


def test_each_step_family_is_given_the_sections_it_names():
    """A family names the sections it reads (`reads`): its constructor takes the parts and exactly those, each a
    section of the configuration; no module of the steps takes the whole Config but `Parts.build` (its fields are
    plain data)."""
    import inspect
    from twophase.config.sections import SECTIONS
    from twophase.train.steps import STEPS, MleStep
    for family in {MleStep, *STEPS.values()}:
        params = list(inspect.signature(family).parameters)
        assert params == ["parts", *family.reads], (family.__name__, params)
        assert set(family.reads) <= set(SECTIONS), family.reads
    found = []
    for path in sorted((ROOT / "train" / "steps").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.Lambda)) and getattr(node, "name", "") != "build":
                found += [f"{path.name}:{a.lineno}: {a.arg}" for a in node.args.args
                          if a.arg == "cfg" or a.annotation is not None and ast.unparse(a.annotation) == "Config"]
    assert not found, found
