"""twophase: memory-bounded sequence-level RL for any sequence model.

Phase one searches (beam or sampling) without a graph; phase two re-decodes the candidates teacher-forced, in
chunks, back-propagating per-sequence coefficients. Any model that follows `SequenceModel` (twophase.protocol)
can be trained; the built-in LSTM is `twophase.Seq2Seq`. `twophase.fit(twophase.Config(...))` runs what
`python train.py` runs. See README.md, docs/library.md and docs/python.md.

Laid out by phase (docs/layout.md): `phase1/` the search, `phase2/` the chunked re-decoding and its backward,
`objectives/` what phase two back-propagates, `rewards/`; the core modules beside them are what both phases share.
"""
import importlib

from . import _moved

_moved.install()  # first: the old module paths (twophase.search, twophase.rescoring, ...) keep working

from . import nested, objectives, rewards, vocab  # noqa: E402
from .compiling import Compiled, compiled  # noqa: E402
from .modelcheck import check_model  # noqa: E402
from .objectives import estimators, policy  # noqa: E402
from .phase1.sbs import stochastic_beam_search  # noqa: E402
from .phase1.search import beam_search, greedy, sample  # noqa: E402
from .phase2.rescoring import rescore_backward  # noqa: E402
from .protocol import ModelError, SequenceModel  # noqa: E402
from .samples import Samples, best_rows  # noqa: E402

__all__ = ["SequenceModel", "ModelError", "check_model", "Seq2Seq", "Samples", "beam_search", "sample", "greedy",
           "stochastic_beam_search", "rescore_backward", "best_rows", "nested", "tree", "vocab", "rewards",
           "objectives", "estimators", "policy", "compiled", "Compiled", "Config", "fit", "Result"]


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # what a type checker and an editor see of the names __getattr__ imports on first use
    from .config import Config  # noqa: F401
    from .train.fit import fit  # noqa: F401


def __getattr__(name: str):
    # The core never imports a model or the trainer; `from twophase import Seq2Seq` (or fit, Config) still works,
    # loading it on first use.
    if name == "Seq2Seq":
        from .models.seq2seq import Seq2Seq
        return Seq2Seq
    if name == "Config":
        from .config import Config
        return Config
    if name == "fit":
        from .train.fit import fit
        return fit
    if name == "Result":
        from .train.report import Result
        return Result
    if f"twophase.{name}" in _moved.MOVED:  # twophase.rescoring without importing it by that name first
        return importlib.import_module(f"twophase.{name}")
    raise AttributeError(f"module 'twophase' has no attribute {name!r}")
