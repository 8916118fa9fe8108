"""Moved to `twophase.system.fsdp`; this old name re-exports what other modules import from it until their
imports move."""
from ..system.fsdp import (  # noqa: F401
    check, full_model_state, full_optimizer_state, gathered, is_sharded, load_model, load_optimizer, plain_copy,
    shard_model, whole,
)
