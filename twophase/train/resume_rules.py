"""Moved: `twophase.train.configrules` (the resume rules, declared on the configuration's fields)."""
from .configrules import (FIXED, FREE, GROW, NOT_INHERITED, PATHS, PHASE, RULES, check, inherited,  # noqa: F401
                          rule, same, show)
