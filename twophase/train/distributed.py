"""Moved to `twophase.system.distributed`; until every import moves, this name is that same module object, so a
caller or test that sets one of its attributes (`rank`, `world`) changes it for every importer."""
import sys

from ..system import distributed

sys.modules[__name__] = distributed
