"""train/ by composition: no class in twophase/train/ derives from two or more of the project's own classes (a
run holds its trainer and parts; it is not assembled from base classes that share its attributes)."""
import ast
from pathlib import Path

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


def test_the_trainer_has_no_one_phase_branch():
    """--one-phase is a measurement baseline: the trainer's step reads no flag of it and imports nothing of it;
    the run gives the trainer its gradient part (onephase.OnePhase) where it is assembled."""
    tree = ast.parse((ROOT / "train" / "trainer.py").read_text(encoding="utf-8"))
    reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "one_phase"]
    imports = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and "onephase" in (n.module or "")]
    assert not reads and not imports, (reads, imports)


def test_the_run_gives_the_trainer_its_gradient(tmp_path):
    from twophase.phase1.onephase import OnePhase
    from twophase.train import cli
    from twophase.config import Config
    from twophase.train.trainer import PhaseTwo
    from taskfiles import write_task
    write_task(tmp_path / "train.tsv", "reverse", 8, seed=0)
    for flag, part in ((False, PhaseTwo), (True, OnePhase)):
        run = cli.build(Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "train.tsv"), hidden_size=8,
                               embed_dim=4, batch_size=2, mle_batch_size=2, one_phase=flag,
                               save_dir=str(tmp_path / str(flag))))
        assert type(run.trainer.gradient) is part

