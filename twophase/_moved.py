"""Old module paths: each moved module is still importable under the path it had before the package was laid
out by phase, and that path gives the SAME module object as its new one.

So `import twophase.search`, `from twophase.rescoring import rescore_backward` and
`monkeypatch.setattr("twophase.rescoring.x", ...)` act on the module that runs, not on a copy: one module object,
two names. Installed by `twophase/__init__.py` as a finder at the front of `sys.meta_path`, which answers only
for the names below, lazily (an old path costs nothing until imported). None of the moved modules had a
`__main__`, so no `python -m` command changed.

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
    # the run's configuration, read by train/ and bench/ alike, is a package of its own
    "twophase.train.config": "twophase.config",
    "twophase.train.config.documented": "twophase.config.documented",
    "twophase.train.config.sections": "twophase.config.sections",
    "twophase.train.config.runsections": "twophase.config.runsections",
    "twophase.train.config.rules": "twophase.config.rules",
    "twophase.train.config.file": "twophase.config.file",
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
