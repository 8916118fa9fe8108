"""Moved to `twophase.train.resume` (check_flags to export_model), `twophase.train.rundir` (set_aside,
write_config) and `twophase.train.report` (evaluation_table); this old name re-exports what other modules import
from it until their imports move."""
from .report import evaluation_table  # noqa: F401
from .resume import (  # noqa: F401
    check_flags, check_init, export_model, init_defaults, load_checkpoint, load_init, resume_path,
)
from .rundir import set_aside, write_config  # noqa: F401
