"""Old module paths: each moved module is still importable under the path it had before the package was laid
out by phase, and that path gives the SAME module object as its new one.

So `import twophase.search`, `from twophase.rescoring import rescore_backward` and
`monkeypatch.setattr("twophase.rescoring.x", ...)` act on the module that runs, not on a copy: one module object,
two names. Installed by `twophase/__init__.py` as a finder at the front of `sys.meta_path`, which answers only
for the names below, lazily (an old path costs nothing until imported). None of the moved modules had a
`__main__` but the two-checkout tools, `python -m tools.beforeafter` now (they run from a checkout).

`twophase.objectives` and `twophase.rewards` are not here: they are packages now, and re-export what the
modules of those names held.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "twophase.search": "twophase.phase1.search",
    "twophase.sbs": "twophase.phase1.sbs",
    "twophase.draw": "twophase.phase1.truncation",
    "twophase.stepchecks": "twophase.phase1.stepchecks",
    "twophase.onephase": "twophase.phase1.onephase",
    "twophase.rescoring": "twophase.phase2.rescoring",
    "twophase.chunkplan": "twophase.phase2.chunkplan",
    "twophase.prefixtree": "twophase.phase2.prefixtree",
    "twophase.tokenweights": "twophase.phase2.tokenweights",
    "twophase.tree": "twophase.nested",
    "twophase.estimators": "twophase.objectives.estimators",
    "twophase.advantage": "twophase.objectives.advantage",
    "twophase.policy": "twophase.objectives.policy",
    "twophase.policyloss": "twophase.objectives.policyloss",
    "twophase.mismatch": "twophase.objectives.mismatch",
    "twophase.entropycontrol": "twophase.objectives.entropycontrol",
    "twophase.rewardsum": "twophase.rewards.weighted",
    "twophase.trlcall": "twophase.rewards.trlstyle",
    # train/'s machinery: where and how the computation runs went down to system/, the run's configuration to
    # config/, and train/'s small modules into the one of their concept (the old names all still there)
    "twophase.train.config": "twophase.config",
    "twophase.train.configfile": "twophase.config.file",
    "twophase.train.config_rules": "twophase.config.rules",
    "twophase.train.resume_rules": "twophase.config.rules",
    "twophase.train.amp": "twophase.system.amp",
    "twophase.train.devices": "twophase.system.devices",
    "twophase.train.numerics": "twophase.system.devices",
    "twophase.train.peaks": "twophase.system.memory",
    "twophase.train.memstats": "twophase.system.memory",
    "twophase.train.profiling": "twophase.system.profiling",
    "twophase.train.distributed": "twophase.system.distributed",
    "twophase.train.fsdp": "twophase.system.fsdp",
    "twophase.train.params": "twophase.system.fsdp",
    "twophase.train.reference": "twophase.train.klreference",
    "twophase.train.references": "twophase.train.evaluation",
    "twophase.train.rewardlog": "twophase.train.report",
    "twophase.train.basemodel": "twophase.train.resume",
    "twophase.train.startup": "twophase.train.start",
    "twophase.train.userparts": "twophase.train.build",
    "twophase.train.interrupt": "twophase.train.runstate",
    "twophase.train.schedule": "twophase.train.mlephase",
}


def new_name(module: str) -> str:
    """`module`'s path today: its new one where it moved, else itself."""
    return MOVED.get(module, module)


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module already imported (or imported now) at the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        # The import system keeps this object's own __name__, __file__ and __loader__ (it fills in missing ones
        # only), files it in sys.modules under the old name too and sets it as the parent package's attribute;
        # __spec__ alone it overwrites with the old path's, so the module's own is kept to be put back.
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Nothing to run (it ran once, at its new path): its own spec back, so that its relative imports and
        # importlib.reload see the package it lives in.
        if module.__spec__.loader is self:
            module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder first on sys.meta_path (once): an old path never reaches a stale file of that name."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
