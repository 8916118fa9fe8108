"""twophase: memory-bounded sequence-level RL for any sequence model.

Phase one searches (beam or sampling) without a graph; phase two re-decodes the candidates teacher-forced, in
chunks, back-propagating per-sequence coefficients. Any model that follows `SequenceModel` (twophase.protocol)
can be trained; the built-in LSTM is `twophase.Seq2Seq`. `twophase.fit(twophase.Config(...))` runs what
`python train.py` runs. See README.md, docs/library.md and docs/python.md.

Laid out by phase (docs/layout.md): `phase1/` the search, `phase2/` the chunked re-decoding and its backward,
`objectives/` what phase two back-propagates, `rewards/`; the core modules beside them are what both phases share.
"""
from . import nested, objectives, rewards, vocab
from .compiling import Compiled, compiled
from .modelcheck import check_model
from .objectives import estimators, policy
from .phase1.sbs import stochastic_beam_search
from .phase1.search import beam_search, greedy, sample
from .phase2.rescoring import rescore_backward
from .protocol import ModelError, SequenceModel
from .samples import Samples, best_rows

__all__ = ["SequenceModel", "ModelError", "check_model", "Seq2Seq", "Samples", "beam_search", "sample", "greedy",
           "stochastic_beam_search", "rescore_backward", "best_rows", "nested", "vocab", "rewards",
           "objectives", "estimators", "policy", "compiled", "Compiled", "Config", "fit", "Result",
           "additive_attention", "dot_attention"]


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # what a type checker and an editor see of the names __getattr__ imports on first use
    from .config import Config  # noqa: F401
    from .models.attention import additive_attention, dot_attention  # noqa: F401
    from .train.fit import fit  # noqa: F401
    from .train.report import Result  # noqa: F401


def __getattr__(name: str):
    # The core never imports a model or the trainer; `from twophase import Seq2Seq` (or fit, Config) still works,
    # loading it on first use.
    if name == "Seq2Seq":
        from .models.seq2seq import Seq2Seq
        return Seq2Seq
    if name in ("additive_attention", "dot_attention"):  # the blocks for a model of your own (models/attention.py)
        from .models import attention
        return getattr(attention, name)
    if name == "Config":
        from .config import Config
        return Config
    if name == "fit":
        from .train.fit import fit
        return fit
    if name == "Result":
        from .train.report import Result
        return Result
    raise AttributeError(f"module 'twophase' has no attribute {name!r}")
