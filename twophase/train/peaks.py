"""Moved to `twophase.system.memory`; this old name re-exports what other modules import from it until their
imports move."""
from ..system.memory import overall_mb  # noqa: F401
