"""Moved: `twophase.train.build` (--grammar on: the task's grammar around the model, and the check that the
training references are in it)."""
from .build import check_grammar_references as check_references, constrain  # noqa: F401
