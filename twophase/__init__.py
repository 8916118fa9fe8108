"""twophase: memory-bounded sequence-level RL for any sequence model.

Phase one searches (beam or sampling) without a graph; phase two re-decodes the candidates teacher-forced, in
chunks, back-propagating per-sequence coefficients. Any model that follows `SequenceModel` (twophase.protocol)
can be trained; the built-in LSTM is `twophase.Seq2Seq`. See README.md and docs/library.md.
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
           "estimators", "policy", "compiled", "Compiled"]


def __getattr__(name: str):
    # The core never imports a model; `from twophase import Seq2Seq` still works, loading it on first use.
    if name == "Seq2Seq":
        from .models.seq2seq import Seq2Seq
        return Seq2Seq
    raise AttributeError(f"module 'twophase' has no attribute {name!r}")
