"""Loading ``package.module:callable`` plug-in specs, the form ``--reward`` (and other plug-in flags) accept.

The module is imported from ``sys.path``; where that fails because the module itself (or its top-level package)
is not there, the working directory is tried too, as ``python -m`` does, so ``--reward mymodule:fn`` finds
``./mymodule.py`` without ``PYTHONPATH=.``. Two choices differ from ``python -m``:

* the working directory is *appended* to ``sys.path``, after installed packages: a stray ``./random.py`` can make a
  plug-in importable, but never shadows a module the program imports later;
* it stays there once it has served (it is removed again if it did not), because a plug-in may import its
  neighbours lazily, at call time, and those imports must find them too.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

from .errors import OneLineError


class PluginError(OneLineError, ValueError):
    """A plug-in could not be found or loaded; the message is one line naming it."""


def brief(exc: BaseException) -> str:
    """`Type: first line of the message`, for one-line errors about exceptions raised by a plug-in."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def where(exc: BaseException) -> str | None:
    """FILE:LINE of a plug-in's fault: a SyntaxError's own place, else the innermost frame of the traceback outside
    the interpreter's import machinery, the standard library and installed packages (the user's module, not the
    library it called); None where there is none (a module that is not there at all)."""
    if isinstance(exc, SyntaxError) and exc.filename and not exc.filename.startswith("<"):
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    frames = [f for f in frames if os.path.abspath(f.filename) != os.path.abspath(__file__)]
    library = tuple({os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(library)]
    return f"{own[-1].filename}:{own[-1].lineno}" if own else None


def _on_path(directory: str) -> bool:
    return any(isinstance(p, str) and os.path.abspath(p or os.curdir) == directory for p in sys.path)


def _missing_itself(exc: ModuleNotFoundError, module_name: str) -> bool:
    """True if `exc` says `module_name` or one of its parent packages is absent, not something it imports."""
    return exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + "."))


def import_module(module_name: str) -> Any:
    """importlib.import_module, falling back to the working directory (see the module docstring)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if not _missing_itself(exc, module_name) or _on_path(cwd):
            raise
    sys.path.append(cwd)
    importlib.invalidate_caches()  # the directory's listing may predate a file written just now
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _missing_itself(exc, module_name):
            sys.path.remove(cwd)  # it did not help: leave sys.path as it was
        raise


def load_spec(spec: str, kind: str) -> Any:
    """The object ``spec`` ("package.module:attr.attr") names; `kind` ("reward", ...) prefixes every error."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise PluginError(f"{kind} '{spec}': expected 'package.module:callable'")
    try:
        obj: Any = import_module(module_name)
    except Exception as exc:  # a plug-in may fail on import with anything, not only ImportError
        place = where(exc)
        raise PluginError(f"{kind} '{spec}': cannot import module '{module_name}' ("
                          + (f"{place}: " if place else "") + f"{brief(exc)})") from exc
    for attr in attr_path.split("."):  # dotted paths reach class or instance attributes
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            raise PluginError(f"{kind} '{spec}': module '{module_name}' has no attribute '{attr_path}'") from exc
    return obj
