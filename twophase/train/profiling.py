"""Moved to `twophase.system.profiling`; this old name re-exports what other modules import from it until their
imports move."""
from ..system.profiling import ChunkPlanner, StepProfiler  # noqa: F401
