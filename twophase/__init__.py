"""twophase: memory-bounded sequence-level RL for seq2seq models.

Phase one searches (beam or sampling) without a graph; phase two re-decodes the candidates teacher-forced, in
chunks, back-propagating per-sequence coefficients. See README.md.
"""
from . import objectives, rewards, vocab
from .models.seq2seq import Seq2Seq
from .rescoring import rescore_backward
from .search import Samples, beam_search, greedy, sample

__all__ = ["Seq2Seq", "Samples", "beam_search", "sample", "greedy", "rescore_backward", "vocab", "rewards",
           "objectives"]
