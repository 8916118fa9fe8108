"""Benchmarks and baselines: two-phase against one-phase and the seed-style code (`python -m twophase.bench`).

Nothing in the library or the trainer imports this package.
"""
