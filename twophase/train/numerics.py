"""Moved to `twophase.system.devices`; this old name re-exports what other modules import from it until their
imports move."""
from ..system.devices import configure  # noqa: F401
