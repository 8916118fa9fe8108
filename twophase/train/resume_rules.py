"""Moved: `twophase.train.config.rules` (the resume rules, declared on the configuration's fields)."""
from .config.rules import (FIXED, FREE, GROW, NOT_INHERITED, PATHS, PHASE, RULES, check, inherited,  # noqa: F401
                          rule, same, show)
