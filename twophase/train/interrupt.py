"""Moved: `GracefulStop` and `Interrupted` live in `twophase.train.runstate`."""
from .runstate import GracefulStop, Interrupted  # noqa: F401
