"""Tests for twophase.rewards: built-in scores, name resolution and output validation."""
from __future__ import annotations

import importlib.metadata
import textwrap
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch

from twophase import rewards
from twophase.rewards import RewardError, registry

PAIRS: list[tuple[str, list[str]]] = [
    ("the cat sat on the mat", ["the cat sat on the mat"]),
    ("the cat sat on a mat", ["the cat sat on the mat"]),
    ("a cat", ["the cat sat on the mat"]),  # shorter than 4 tokens: effective order matters
    ("cat", ["cat"]),
    ("dog", ["the cat"]),
    ("", ["the cat"]),
    ("there is a cat on the mat", ["the cat is on the mat", "there is a cat on the mat ."]),
    ("the quick brown fox jumps", ["a fast brown fox leaps", "the quick fox jumped", "quick brown foxes jump"]),
]


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("hyp, refs", PAIRS)
def test_bleu_matches_sacrebleu(hyp: str, refs: list[str]) -> None:
    assert rewards.bleu([hyp], [refs]) == [sacrebleu.sentence_bleu(hyp, refs).score / 100]


@pytest.mark.parametrize("hyp, refs", PAIRS)
def test_chrf_matches_sacrebleu(hyp: str, refs: list[str]) -> None:
    assert rewards.chrf([hyp], [refs]) == [sacrebleu.sentence_chrf(hyp, refs).score / 100]


def test_bleu_and_chrf_batches_keep_order() -> None:
    hyps, refs = [h for h, _ in PAIRS], [r for _, r in PAIRS]
    assert rewards.bleu(hyps, refs) == [sacrebleu.sentence_bleu(h, r).score / 100 for h, r in PAIRS]
    assert rewards.chrf(hyps, refs) == [sacrebleu.sentence_chrf(h, r).score / 100 for h, r in PAIRS]


def test_exact() -> None:
    hyps = ["a b c", "a  b c ", "a b", "x"]
    refs = [["a b c"], ["a b c"], ["a b c", "a b"], ["y", "z"]]
    assert rewards.exact(hyps, refs) == [1.0, 1.0, 1.0, 0.0]


def test_edit_hand_computed() -> None:
    hyps = ["a b c d", "a x c d", "a b y c d", "a b", "a b c d e f g h i", "", "", "a"]
    refs = [["a b c d"], ["a b c d"], ["a b c d"], ["z z z z", "a b c"], ["a b"], [""], ["a b"], [""]]
    expected = [
        1.0,
        0.75,  # one substitution out of 4
        0.75,  # one insertion out of 4
        2 / 3,  # second reference is closer: one deletion out of 3
        0.0,  # 7 insertions over a 2-token reference floors at 0, not -2.5
        1.0,  # empty hypothesis, empty reference
        0.0,  # two deletions out of 2
        0.0,  # non-empty hypothesis, empty reference
    ]
    assert rewards.edit(hyps, refs) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["bleu", "chrf", "exact", "edit"])
def test_get_builtin(name: str) -> None:
    fn = rewards.get(name)
    assert fn.name == name  # type: ignore[attr-defined]
    hyps, refs = ["a b c"], [["a b c"]]
    assert fn(hyps, refs) == rewards.BUILTINS[name](hyps, refs) == pytest.approx([1.0])


def test_get_module_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "tp_plugin_ok", """
        def length(hyps, refs):
            return [float(len(h.split())) for h in hyps]
        class Holder:
            @staticmethod
            def neg(hyps, refs):
                return (-1, -2)
    """)
    assert rewards.get("tp_plugin_ok:length")(["a b", "c"], [["x"], ["y"]]) == [2.0, 1.0]
    assert rewards.get("tp_plugin_ok:Holder.neg")(["a", "b"], [["x"], ["y"]]) == [-1.0, -2.0]


@pytest.mark.parametrize("spec, fragment", [
    ("tp_no_such_module:fn", "cannot import module 'tp_no_such_module' (ModuleNotFoundError"),
    ("tp_plugin_bad:missing", "module 'tp_plugin_bad' has no attribute 'missing'"),
    ("tp_plugin_bad:NOT_CALLABLE", "int object is not callable"),
    ("tp_plugin_broken:fn", "tp_plugin_broken.py:1: RuntimeError: boom on import)"),  # its file and line
    (":fn", "expected 'package.module:callable'"),
])
def test_get_module_spec_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, fragment: str) -> None:
    _write_module(tmp_path, monkeypatch, "tp_plugin_bad", "NOT_CALLABLE = 3\n")
    _write_module(tmp_path, monkeypatch, "tp_plugin_broken", "raise RuntimeError('boom on import')\n")
    with pytest.raises(RewardError) as info:
        rewards.get(spec)
    assert f"reward '{spec}'" in str(info.value) and fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_name_lists_available() -> None:
    with pytest.raises(RewardError, match=r"unknown reward 'blue'; available: bleu, chrf, countdown, edit, exact"):
        rewards.get("blue")


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: importlib.metadata.EntryPoint) -> None:
    def entry_points(**kwargs: str) -> list[importlib.metadata.EntryPoint]:
        assert kwargs == {"group": "twophase.rewards"}
        return list(eps)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_third_party_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "tp_plugin_ep", """
        def half(hyps, refs):
            return [0.5] * len(hyps)
    """)
    group = "twophase.rewards"
    _fake_entry_points(
        monkeypatch,
        importlib.metadata.EntryPoint(name="half", value="tp_plugin_ep:half", group=group),
        importlib.metadata.EntryPoint(name="broken", value="tp_plugin_ep:nope", group=group),
    )
    assert rewards.available() == ["bleu", "broken", "chrf", "edit", "exact", "half"]
    fn = rewards.get("half")
    assert fn.name == "half"  # type: ignore[attr-defined]
    assert fn(["a", "b"], [["a"], ["b"]]) == [0.5, 0.5]
    with pytest.raises(RewardError, match=r"^reward 'broken': cannot load entry point 'tp_plugin_ep:nope'"):
        rewards.get("broken")
    with pytest.raises(RewardError, match=r"available: bleu, broken, chrf, edit, exact, half$"):
        rewards.get("missing")


def test_entry_point_overrides_builtin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "tp_plugin_override", "def bleu(hyps, refs):\n    return [0.25] * len(hyps)\n")
    ep = importlib.metadata.EntryPoint(name="bleu", value="tp_plugin_override:bleu", group="twophase.rewards")
    _fake_entry_points(monkeypatch, ep)
    assert rewards.get("bleu")(["a"], [["a"]]) == [0.25]


def test_installed_entry_points_declare_builtins() -> None:
    try:
        importlib.metadata.distribution("twophase")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("twophase is not installed, so it has no entry points")
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="twophase.rewards")}
    assert {"bleu", "chrf", "exact", "edit"} <= set(eps)
    for name, fn in rewards.BUILTINS.items():
        assert eps[name].value == f"twophase.rewards:{name}"
        assert eps[name].load() is fn


@pytest.mark.parametrize("output", [
    [0.1, 0.2, 0.3],
    (0.1, 0.2, 0.3),
    np.array([0.1, 0.2, 0.3]),
    np.array([0.1, 0.2, 0.3], dtype=np.float32),
    torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64, requires_grad=True),
    [np.float64(0.1), torch.tensor(0.2, dtype=torch.float64), 0.3],
])
def test_validated_accepts(output: object) -> None:
    out = rewards.validated(lambda h, r: output, "ok")(["a", "b", "c"], [["a"], ["b"], ["c"]])
    assert type(out) is list and all(type(v) is float for v in out)
    assert out == pytest.approx([0.1, 0.2, 0.3])


def _raises_value_error(hyps: list[str], refs: list[list[str]]) -> list[float]:
    raise ValueError("bad input\nsecond line")


@pytest.mark.parametrize("fn, message", [
    (_raises_value_error, "reward 'plug' raised ValueError: bad input"),
    (lambda h, r: None, "reward 'plug' returned NoneType; expected a sequence of floats"),
    (lambda h, r: "0.1 0.2", "reward 'plug' returned str; expected a sequence of floats"),
    (lambda h, r: {0.1, 0.2}, "reward 'plug' returned set; expected a sequence of floats"),
    (lambda h, r: [0.1, 0.2, 0.3], "reward 'plug' returned 3 values for 2 hypotheses"),
    (lambda h, r: torch.zeros(2, 1), "reward 'plug' returned a 2-D array; expected 1-D"),
    (lambda h, r: np.float64(0.5), "reward 'plug' returned float64; expected a sequence of floats"),
    (lambda h, r: [0.1, float("nan")], "reward 'plug' returned a non-finite value at position 1 (nan)"),
    (lambda h, r: np.array([-np.inf, 0.0]), "reward 'plug' returned a non-finite value at position 0 (-inf)"),
    (lambda h, r: [0.1, "0.2"], "reward 'plug' returned a non-real value at position 1 ('0.2')"),
    (lambda h, r: [0.1, None], "reward 'plug' returned a non-real value at position 1 (None)"),
    (lambda h, r: [1j, 0.0], "reward 'plug' returned a non-real value at position 0 (1j)"),
])
def test_validation_failures_name_the_plugin(fn: object, message: str) -> None:
    wrapped = rewards.validated(fn, "plug")  # type: ignore[arg-type]
    with pytest.raises(RewardError) as info:
        wrapped(["a", "b"], [["a"], ["b"]])
    assert str(info.value) == message


def test_validation_through_get(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "tp_plugin_nan", "def fn(hyps, refs):\n    return [float('nan')] * len(hyps)\n")
    with pytest.raises(RewardError, match=r"^reward 'tp_plugin_nan:fn' returned a non-finite value at position 0"):
        rewards.get("tp_plugin_nan:fn")(["a"], [["a"]])


def test_mismatched_inputs_are_reported() -> None:
    with pytest.raises(RewardError, match=r"reward 'bleu' called with 2 hypotheses but 1 reference lists"):
        rewards.get("bleu")(["a", "b"], [["a"]])


# ---- context: rewards that see the source (or other per-example fields)

HYPS, REFS, SOURCES = ["a b", "c"], [["a b"], ["d"]], ["x y z", "w"]


def test_two_argument_plugins_ignore_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "tp_plugin_plain", "def fn(hyps, refs):\n    return [1.0] * len(hyps)\n")
    reward = rewards.get("tp_plugin_plain:fn")
    assert reward(HYPS, REFS, sources=SOURCES, lang=["en", "fr"]) == [1.0, 1.0]
    assert rewards.get("exact")(HYPS, REFS, sources=SOURCES) == [1.0, 0.0]


def test_source_aware_plugin_through_get(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "tp_plugin_src", """
        def ratio(hypotheses, references, *, sources):
            return [len(h.split()) / len(s.split()) for h, s in zip(hypotheses, sources)]
    """)
    assert rewards.get("tp_plugin_src:ratio")(HYPS, REFS, sources=SOURCES, lang=["en", "fr"]) == [2 / 3, 1.0]


def _seen(hyps, refs, **context):
    """Rewards every hypothesis with how many context lists it was given."""
    return [float(len(context))] * len(hyps)


@pytest.mark.parametrize("fn, context, want", [
    (lambda h, r, sources: [float(len(s)) for s in sources], dict(sources=SOURCES, lang=["en", "fr"]), [5.0, 1.0]),
    (lambda h, r, *, lang: [float(x == "fr") for x in lang], dict(sources=SOURCES, lang=["en", "fr"]), [0.0, 1.0]),
    (lambda h, r, sources=None: [float(sources is None)] * 2, {}, [1.0, 1.0]),
    (lambda h, r, sources=None: [float(sources is None)] * 2, dict(sources=SOURCES), [0.0, 0.0]),
    (_seen, dict(sources=SOURCES, lang=["en", "fr"]), [2.0, 2.0]),  # **kwargs: all of it
    (lambda h, r, sources, **fields: [float(len(fields))] * 2, dict(sources=SOURCES, lang=["en", "fr"]), [1.0, 1.0]),
])
def test_each_plugin_gets_the_context_it_declares(fn, context, want) -> None:
    assert rewards.validated(fn, "ctx")(HYPS, REFS, **context) == want


def test_missing_context_names_plugin_and_key() -> None:
    reward = rewards.validated(lambda h, r, *, sources, lang: [0.0] * len(h), "ctx")
    with pytest.raises(RewardError) as info:
        reward(HYPS, REFS, sources=SOURCES)
    assert str(info.value) == "reward 'ctx' needs 'lang', which the caller did not give (it gave: sources)"
    with pytest.raises(RewardError, match=r"^reward 'ctx' needs 'lang', 'sources', .*\(it gave: no context\)$"):
        reward(HYPS, REFS)


@pytest.mark.parametrize("context, message", [
    (dict(sources=["only one"]), "reward 'ctx' called with 2 hypotheses but 1 sources"),
    (dict(sources=SOURCES, lang=["en"] * 3), "reward 'ctx' called with 2 hypotheses but 3 lang"),
    (dict(sources=SOURCES, lang=None), "reward 'ctx' called with NoneType lang; expected one entry per hypothesis"),
])
def test_every_context_list_has_one_entry_per_hypothesis(context, message) -> None:
    reward = rewards.validated(lambda h, r, sources: [0.0] * len(h), "ctx")  # lang is checked though unused
    with pytest.raises(RewardError) as info:
        reward(HYPS, REFS, **context)
    assert str(info.value) == message


def test_signature_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = registry.inspect.signature
    monkeypatch.setattr(registry.inspect, "signature", lambda fn: calls.append(fn) or real(fn))
    reward = rewards.validated(lambda h, r, sources: [0.0] * len(h), "ctx")
    for _ in range(3):
        reward(HYPS, REFS, sources=SOURCES)
    assert len(calls) == 1


def test_unreadable_signature_gets_the_two_lists() -> None:
    class Opaque:
        __signature__ = "not a signature"  # inspect.signature raises TypeError, as for some C callables

        def __call__(self, *args, **kwargs):
            assert len(args) == 2 and not kwargs
            return [0.5] * len(args[0])

    assert rewards.validated(Opaque(), "opaque")(HYPS, REFS, sources=SOURCES) == [0.5, 0.5]


@pytest.mark.parametrize("fn, message", [
    (lambda hyps: [0.0], "reward 'bad' must take (hypotheses, references) as its first two arguments"),
    (lambda h, r, src, /: [0.0], "reward 'bad': its argument 'src' is positional-only; context is passed by name"),
])
def test_unusable_signatures_fail_at_get_time(fn, message) -> None:
    with pytest.raises(RewardError) as info:
        rewards.validated(fn, "bad")
    assert str(info.value) == message
