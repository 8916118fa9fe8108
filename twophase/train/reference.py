"""Moved to `twophase.klreference`; this old name re-exports what other modules import from it until their
imports move."""
from .klreference import Reference  # noqa: F401
