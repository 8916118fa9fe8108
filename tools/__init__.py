"""Tools for developing twophase, not shipped with it: `python -m tools.beforeafter` (an RL step in two
checkouts side by side) and its worker `tools/stepworker.py`."""
