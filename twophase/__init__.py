"""twophase: memory-bounded sequence-level RL for any sequence model.

Phase one searches (beam or sampling) without a graph; phase two re-decodes the candidates teacher-forced, in
chunks, back-propagating per-sequence coefficients. Any model that follows `SequenceModel` (twophase.protocol)
can be trained; the built-in LSTM is `twophase.Seq2Seq`. `twophase.fit(twophase.Config(...))` runs what
`python train.py` runs. See README.md, docs/library.md and docs/python.md.
"""
from . import estimators, objectives, policy, rewards, tree, vocab
from .compiling import Compiled, compiled
from .modelcheck import check_model
from .protocol import ModelError, SequenceModel
from .rescoring import rescore_backward
from .samples import Samples, best_rows
from .sbs import stochastic_beam_search
from .search import beam_search, greedy, sample

__all__ = ["SequenceModel", "ModelError", "check_model", "Seq2Seq", "Samples", "beam_search", "sample", "greedy",
           "stochastic_beam_search", "rescore_backward", "best_rows", "tree", "vocab", "rewards", "objectives",
           "estimators", "policy", "compiled", "Compiled", "Config", "fit", "Result"]


def __getattr__(name: str):
    # The core never imports a model or the trainer; `from twophase import Seq2Seq` (or fit, Config) still works,
    # loading it on first use.
    if name == "Seq2Seq":
        from .models.seq2seq import Seq2Seq
        return Seq2Seq
    if name == "Config":
        from .train.config import Config
        return Config
    if name == "fit":
        from .train.fit import fit
        return fit
    if name == "Result":
        from .train.report import Result
        return Result
    raise AttributeError(f"module 'twophase' has no attribute {name!r}")
