"""Benchmarks and baselines: two-phase against one-phase and the seed-style code (`python -m benchmarks`), the
peers (TRL, Hugging Face `generate`) and the GPU check (`python -m benchmarks.gpu`).

Run from a checkout; not installed with the library, and nothing in twophase/ imports it.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: benchmarks/, twophase/ and train.py side by side


def checkout_env() -> dict:
    """The environment of a child `python -m benchmarks...`: this checkout first on its path, wherever it runs."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
