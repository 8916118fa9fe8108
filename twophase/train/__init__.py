"""The training loop and its machinery: trainer, checkpoints and resume, signals, torchrun, AMP, flags, the
`train.py` / `twophase-decode` commands and validation."""
