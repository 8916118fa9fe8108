"""Sequence-level rewards: the built-ins and the plug-in registry that finds them (`registry`, re-exported here, so
`rewards.get("edit")`, `rewards.RewardError`, `rewards.needs_references` read as before), TRL-signature reward
functions (`trlstyle`), several rewards summed with weights (`weighted`) and a Hugging Face sequence-classification
model as the reward (`hfmodel`, `--reward hf:FOLDER`).
"""
from .registry import (BUILTINS, GROUP, Reward, RewardError, available, bleu, chrf, edit, exact, get,  # noqa: F401
                       needs_references, validated)
