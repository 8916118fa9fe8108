"""Moved to `twophase.system.fsdp`; this old name re-exports what other modules import from it until their
imports move."""
from ..system.fsdp import saved_state  # noqa: F401
