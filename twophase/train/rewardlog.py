"""Moved to `twophase.report`; this old name re-exports what other modules import from it until their
imports move."""
from .report import RewardLog  # noqa: F401
