"""Run by torchrun from test_fsdp: several `train.py` commands (a JSON list of argument lists) one after the
other in the same process group, so that one launch (one import of torch and transformers) tests them all."""
import json
import sys

from twophase.train import cli, distributed

if __name__ == "__main__":
    finish, distributed.finish = distributed.finish, lambda: None  # the group outlives each command
    try:
        for argv in json.loads(sys.argv[1]):
            code = cli.main(argv)
            if code != 0:
                sys.exit(f"exit status {code}: {argv}")
    finally:
        finish()
