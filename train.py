#!/usr/bin/env python
"""Train a seq2seq model with an MLE warm start and two-phase sequence-level RL. See `python train.py --help`."""
import sys

from twophase.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
