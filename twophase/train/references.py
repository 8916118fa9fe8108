"""Moved to `twophase.evaluation`; this old name re-exports what other modules import from it until their
imports move."""
from .evaluation import with_references  # noqa: F401
