"""Sequence-level rewards and the plug-in registry that finds them.

A reward is any callable ``(hypotheses, references) -> list[float]`` over detokenised strings (tokens joined
by single spaces): ``references[i]`` holds one or more reference strings for ``hypotheses[i]``; higher is better.
It may also declare keyword *context*, per-hypothesis lists the caller gives by name: ``sources`` (``sources[i]``
is the raw source of ``hypotheses[i]``'s example) and whatever extra fields a task's examples carry, e.g.
``def reward(hypotheses, references, sources, **fields)``, and ``completion_ids`` where the trainer has them
(each candidate's ids, up to and including its eos). A function in TRL's signature, ``(prompts, completions,
...)`` or declaring ``completion_ids``, is called TRL's way instead (``twophase.rewards.trlstyle``). Each plug-in is
passed only the context its signature names (all of it with ``**kwargs``), so two-argument rewards keep working
whatever the caller knows.

``get(name)`` resolves a name to a reward, in this order:

* ``"hf:FOLDER"`` is a Hugging Face reward model (``twophase.rewards.hfmodel``);
* ``"package.module:callable"`` is imported directly (from ``sys.path``, then the working directory: see
  ``twophase.plugins``), so a one-off reward needs no packaging;
* otherwise the ``twophase.rewards`` entry-point group, so installed third-party plug-ins are found by name;
* otherwise the built-ins below, so a plain checkout works without ``pip install``;
* otherwise a folder holding a config.json, a reward model as with ``hf:``.

Whatever it returns is wrapped by ``validated``, so a faulty plug-in fails with a one-line ``RewardError``
naming it instead of corrupting a training run with a wrong-length or NaN reward vector.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any, Callable

from ..plugins import PluginError, brief, load_spec
from .trlstyle import Call, is_trl_style
from .errors import RewardError

Reward = Callable[..., list[float]]  # (hypotheses, references, **context) -> one float per hypothesis
GROUP = "twophase.rewards"


@functools.cache
def _scorer(kind: str) -> Any:
    # Built once: the metric objects are costly to construct and rewards are called every training step.
    # Imported lazily so that importing this module (e.g. just to list rewards) stays cheap.
    from sacrebleu.metrics import BLEU, CHRF

    return BLEU(effective_order=True) if kind == "bleu" else CHRF()


def bleu(hypotheses: list[str], references: list[list[str]]) -> list[float | None]:
    """Sentence BLEU in [0, 1], identical to ``sacrebleu.sentence_bleu(h, refs).score / 100``."""
    scorer = _scorer("bleu")
    return [scorer.sentence_score(h, list(refs)).score / 100 if refs else None
            for h, refs in zip(hypotheses, references)]


def chrf(hypotheses: list[str], references: list[list[str]]) -> list[float | None]:
    """Sentence chrF in [0, 1], identical to ``sacrebleu.sentence_chrf(h, refs).score / 100``."""
    scorer = _scorer("chrf")
    return [scorer.sentence_score(h, list(refs)).score / 100 if refs else None
            for h, refs in zip(hypotheses, references)]


# ---- corpus scores: what translation compares systems by, beside the mean sentence reward
# A run whose reward is bleu reports sacrebleu's corpus BLEU of its validation and test hypotheses; chrf's, corpus
# BLEU and corpus chrF. Each is sacrebleu's `corpus_bleu` / `corpus_chrf` (default settings, 0-100) computed from
# its sufficient statistics, summed over the segments: sums of shards add up, so several processes' validation
# equals one process's.
CORPUS = {"bleu": ("bleu",), "chrf": ("bleu", "chrf")}


def corpus_kinds(reward) -> tuple[str, ...]:
    """The corpus scores a run of `reward` reports: ("bleu",), ("bleu", "chrf") or () (a reward of neither
    kind); a sum of rewards (`weighted.WeightedSum`, `names`) reports those of each."""
    names = getattr(reward, "names", None) or [getattr(reward, "name", None)]
    kinds = {kind for name in names for kind in CORPUS.get(name, ())}
    return tuple(kind for kind in ("bleu", "chrf") if kind in kinds)


def _corpus_metric(kind: str) -> Any:
    from sacrebleu.metrics import BLEU, CHRF

    return BLEU() if kind == "bleu" else CHRF()  # sacrebleu.corpus_bleu's and corpus_chrf's defaults


def corpus_statistics(kind: str, hypotheses: list[str], references: list[list[str]]) -> list[float]:
    """sacrebleu's sufficient statistics of `kind` ("bleu" or "chrf") over the segments, summed (zeros for no
    segment); a segment may have any number of references (at least one)."""
    metric = _corpus_metric(kind)
    if not hypotheses:
        return [0.0] * len(metric._extract_corpus_statistics(["a"], [["a"]])[0])
    # sacrebleu reads references as streams, the i-th reference of every segment; None where a segment has fewer
    streams = [[refs[i] if i < len(refs) else None for refs in references]
               for i in range(max(len(refs) for refs in references))]
    return [float(sum(column)) for column in zip(*metric._extract_corpus_statistics(hypotheses, streams))]


def corpus_score(kind: str, sums: list[float]) -> float:
    """The corpus score (0-100) of summed `corpus_statistics`."""
    return float(_corpus_metric(kind)._compute_score_from_stats(list(sums)).score)


def exact(hypotheses: list[str], references: list[list[str]]) -> list[float | None]:
    """1.0 if the hypothesis equals any reference token for token, else 0.0."""
    # Token lists rather than raw strings, so stray or doubled spaces do not turn a match into a miss.
    return [float(h.split() in [r.split() for r in refs]) if refs else None for h, refs in zip(hypotheses, references)]


def _edit_one(hyp: str, ref: str) -> float:
    from rapidfuzz.distance import Levenshtein  # here: `import twophase` needs no rapidfuzz

    hyp_toks, ref_toks = hyp.split(), ref.split()
    if not ref_toks:
        # Normalising by the reference length is undefined here; only an empty hypothesis is right.
        return float(not hyp_toks)
    return max(0.0, 1.0 - Levenshtein.distance(hyp_toks, ref_toks) / len(ref_toks))


def edit(hypotheses: list[str], references: list[list[str]]) -> list[float | None]:
    """Best over references of ``max(0, 1 - token_edit_distance / len(ref))``."""
    return [max(_edit_one(h, r) for r in refs) if refs else None for h, refs in zip(hypotheses, references)]


# The built-ins compare with references: a hypothesis whose example has none gets None (no reward), and train.py
# refuses, before training, data whose rows only such rewards would score but which have no reference. A plug-in
# may declare the same (`needs_references = True` on its function).
for _fn in (bleu, chrf, exact, edit):
    _fn.needs_references = True  # type: ignore[attr-defined]


def needs_references(reward: Callable) -> bool:
    """Whether a (validated) reward scores only hypotheses whose examples have references."""
    return bool(getattr(reward, "needs_references", False))


BUILTINS: dict[str, Reward] = {"bleu": bleu, "chrf": chrf, "exact": exact, "edit": edit}


def _entry_points() -> list[metadata.EntryPoint]:
    # Looked up through the module attribute at call time so tests can substitute fake entry points.
    return list(metadata.entry_points(group=GROUP))


def available() -> list[str]:
    """Names ``get`` accepts without a ``module:callable`` spec: installed entry points and built-ins."""
    return sorted({ep.name for ep in _entry_points()} | set(BUILTINS))


def _load_entry_point(name: str) -> Any | None:
    matches = [ep for ep in _entry_points() if ep.name == name]
    if not matches:
        return None
    # Several matches usually mean the same distribution is visible twice (e.g. editable plus site-packages);
    # the first is what importlib.metadata ranks highest on sys.path.
    ep = matches[0]
    try:
        return ep.load()
    except Exception as exc:
        raise RewardError(f"reward '{name}': cannot load entry point '{ep.value}' ({brief(exc)})") from exc


def recorded(name: str) -> str:
    """How a run records the reward ``name``: a reward model's folder as ``hf:`` and its absolute path (--resume
    and decoding find it from anywhere, whatever the working directory), any other name as given."""
    from . import hfmodel

    if name.startswith(hfmodel.PREFIX):
        return hfmodel.PREFIX + os.path.abspath(hfmodel.folder_of(name))
    if name and ":" not in name and name not in BUILTINS and hfmodel.is_folder_spec(name) \
            and _load_entry_point(name) is None:  # as `get` finds it: a folder never hides a reward's name
        return hfmodel.PREFIX + os.path.abspath(name)
    return name


def get(name: str, device: Any = None, causal: bool = False) -> Reward:
    """Resolve ``name`` (a reward model's folder, a ``module:callable`` spec, an entry point or a built-in) to a
    validated reward. A reward model (``hf:FOLDER``, or a folder holding a config.json: ``rewards.hfmodel``) runs
    on ``device`` and scores prompt + completion where ``causal`` (the task's model is a causal LM), else the
    (source, hypothesis) pair; other rewards ignore both."""
    from . import hfmodel  # no transformers until a reward model is built

    if name.startswith(hfmodel.PREFIX):
        fn = hfmodel.RewardModel(name, device, causal)
    elif ":" in name:
        try:
            fn = load_spec(name, "reward")
        except PluginError as err:
            raise RewardError(str(err)) from err.__cause__
    else:
        fn = _load_entry_point(name)
        if fn is None:
            fn = BUILTINS.get(name)
        if fn is None and hfmodel.is_folder_spec(name):  # a folder never hides a reward of that name
            fn = hfmodel.RewardModel(name, device, causal)
        if fn is None:
            raise RewardError(f"unknown reward '{name}'; available: {', '.join(available())}")
    if not callable(fn):
        raise RewardError(f"reward '{name}': {type(fn).__name__} object is not callable")
    return validated(fn, name)


def _as_list(out: Any, label: str) -> list[Any]:
    # Checked via sys.modules so that neither heavy library is imported just to validate a plain list.
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if (np is not None and isinstance(out, np.ndarray)) or (torch is not None and isinstance(out, torch.Tensor)):
        if out.ndim != 1:
            raise RewardError(f"reward '{label}' returned a {out.ndim}-D array; expected 1-D")
        return out.detach().cpu().tolist() if torch is not None and isinstance(out, torch.Tensor) else out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardError(f"reward '{label}' returned {type(out).__name__}; expected a sequence of floats")
    return list(out)


def _to_float(value: Any, position: int, label: str, none_ok: bool = False) -> float:
    if value is None and none_ok:  # a TRL-style reward's "no reward for this candidate"
        return math.nan
    # Complex numbers would silently lose their imaginary part in float(), so they count as non-real.
    if isinstance(value, (str, bytes, numbers.Complex)) and not isinstance(value, numbers.Real):
        raise RewardError(f"reward '{label}' returned a non-real value at position {position} ({value!r})")
    try:
        result = float(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RewardError(f"reward '{label}' returned a non-real value at position {position} ({value!r})") from exc
    if not math.isfinite(result):
        raise RewardError(f"reward '{label}' returned a non-finite value at position {position} ({result})")
    return result


class _Context:
    """What context a plug-in's signature takes beyond (hypotheses, references); read once, at get() time."""

    def __init__(self, params: list[inspect.Parameter] | None, label: str):
        P = inspect.Parameter
        if params is None:  # e.g. some C callables: nothing to read, so pass the two lists only
            self.takes_all, self.names, self.required = False, frozenset(), frozenset()
            return
        positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2 and not any(p.kind is P.VAR_POSITIONAL for p in params):
            raise RewardError(f"reward '{label}' must take (hypotheses, references) as its first two arguments")
        extra = positional[2:] + [p for p in params if p.kind is P.KEYWORD_ONLY]
        for p in extra:
            if p.kind is P.POSITIONAL_ONLY and p.default is P.empty:
                raise RewardError(f"reward '{label}': its argument '{p.name}' is positional-only; context is "
                                  "passed by name")
        self.takes_all = any(p.kind is P.VAR_KEYWORD for p in params)
        self.names = frozenset(p.name for p in extra if p.kind is not P.POSITIONAL_ONLY)
        self.required = frozenset(p.name for p in extra if p.kind is not P.POSITIONAL_ONLY and p.default is P.empty)

    def select(self, context: dict[str, Any], label: str) -> dict[str, Any]:
        missing = sorted(self.required - context.keys())
        if missing:
            raise RewardError(f"reward '{label}' needs {', '.join(repr(m) for m in missing)}, which the caller "
                              f"did not give (it gave: {', '.join(sorted(context)) or 'no context'})")
        return context if self.takes_all else {k: v for k, v in context.items() if k in self.names}


def _check_inputs(label: str, hypotheses: list[str], references: list[list[str]], context: dict[str, Any]) -> None:
    n = len(hypotheses)
    for name, values in [("reference lists", references), *context.items()]:
        try:
            count = len(values)
        except TypeError:
            raise RewardError(f"reward '{label}' called with {type(values).__name__} {name}; expected one entry "
                              "per hypothesis") from None
        if count != n:
            raise RewardError(f"reward '{label}' called with {n} hypotheses but {count} {name}")


def validated(fn: Callable[..., Any], label: str) -> Reward:
    """Wrap ``fn`` so that any failure or malformed output becomes a ``RewardError`` naming ``label``; the
    wrapper takes ``(hypotheses, references, **context)`` and passes ``fn`` the context it declares. A function
    in TRL's signature (``trlstyle``) is called TRL's way, and its None entries become NaN, as those of a
    reward that declares ``needs_references`` (for the examples without references)."""
    try:
        params = list(inspect.signature(fn).parameters.values())  # read once, not per call
    except (TypeError, ValueError):
        params = None
    trl = Call(fn, params) if params is not None and is_trl_style(params) else None
    wants = None if trl else _Context(params, label)

    @functools.wraps(fn)
    def wrapper(hypotheses: list[str], references: list[list[str]], **context: Any) -> list[float]:
        _check_inputs(label, hypotheses, references, context)
        if trl is not None:
            kwargs, missing = trl.arguments(hypotheses, context)
            if missing:
                raise RewardError(f"reward '{label}' needs {', '.join(repr(m) for m in missing)}, which the caller "
                                  f"did not give (it gave: {', '.join(sorted(kwargs))})")
        else:
            kwargs = wants.select(context, label)
        try:
            out = trl(kwargs) if trl is not None else fn(hypotheses, references, **kwargs)
        except RewardError:
            raise  # already names a plug-in (e.g. a reward built from get()); rewrapping would double the prefix
        except Exception as exc:
            raise RewardError(f"reward '{label}' raised {brief(exc)}") from exc
        values = _as_list(out, label)
        if len(values) != len(hypotheses):
            raise RewardError(f"reward '{label}' returned {len(values)} values for {len(hypotheses)} hypotheses")
        return [_to_float(v, i, label, none_ok=none_ok) for i, v in enumerate(values)]

    none_ok = trl is not None or needs_references(fn)
    wrapper.name = label  # type: ignore[attr-defined]
    wrapper.needs_references = needs_references(fn)  # type: ignore[attr-defined]
    return wrapper
