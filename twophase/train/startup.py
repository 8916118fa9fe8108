"""Moved: `twophase.train.start` (how a command starts, its start-up checks included)."""
from .start import (StartupError, changed_fields, check_model_on_a_batch, check_references,  # noqa: F401
                    check_reward_references, check_task_flags, flags_given)
