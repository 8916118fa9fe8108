"""Moved to `twophase.resume`; this old name re-exports what other modules import from it until their
imports move."""
from .resume import check, record  # noqa: F401
