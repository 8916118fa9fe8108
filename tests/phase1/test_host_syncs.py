"""Phase one's host syncs per decoder step (`benchmarks.hostsyncs.count_host_syncs`): at most 2 for beam
search (compacted steps included), sampling and stochastic beam search, with the built-in LSTM, both Karel
models and the Hugging Face wrappers (seq2seq and causal). A search is counted at two max_len values it runs to
the end; the fixed costs (encode, the end's one read of the deferred checks, `_finish`) cancel in the
difference, so per step = (total(T2) - total(T1)) / (T2 - T1). Reads inside transformers' own forward (its
attention masks check their padding on the host) are counted apart: they are the library's, not twophase's, and
bounded separately (T5 one a step, BART two). models/fused.py's share is printed apart and counts as twophase's:
the searches declare their owner layouts (`twophase.owners`), so the fused attention reads none. The counts are
printed (pytest -s) and in every assertion message."""
import collections
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from twophase import beam_search, sample
from benchmarks import hostsyncs
from twophase.phase1 import search
from twophase.phase1.sbs import stochastic_beam_search
from twophase.vocab import EOS

from conftest import tiny_model, toy_batch

PER_STEP = 2
PACKAGE = str(Path(search.__file__).resolve().parent)


def _counted(run, monkeypatch):
    """(total, {"transformers": reads made inside it, "fused": reads of models/fused.py}, Samples) of one run."""
    inside = collections.Counter()
    record = hostsyncs.HostSyncs.record

    def classified(self, kind):
        frame = sys._getframe(1)
        while frame is not None:  # the innermost frame of twophase's or transformers' code decides
            name = frame.f_code.co_filename
            if "transformers" in name:
                inside["transformers"] += 1
                break
            if name.endswith("fused.py"):  # the fused attention's own reads, counted apart for now
                inside["fused"] += 1
                break
            if name.startswith(PACKAGE) and "hostsyncs" not in name:
                break
            frame = frame.f_back
        record(self, kind)

    monkeypatch.setattr(hostsyncs.HostSyncs, "record", classified)
    with hostsyncs.count_host_syncs() as syncs:
        found = run()
    monkeypatch.setattr(hostsyncs.HostSyncs, "record", record)
    return syncs, inside, found


def _per_step(name, run, steps, monkeypatch):
    """Per-step reads of run(max_len) between max_len steps[0] and steps[1]: twophase's own (fused.py's among
    them, also printed apart) and transformers' apart."""
    (t1, t2), out = steps, {}
    for T in steps:
        syncs, inside, found = _counted(lambda: run(T), monkeypatch)
        ran = int(found.lengths.max())
        assert ran == T, f"{name}: the search stopped at step {ran} of {T}; the difference would not count steps"
        out[T] = (syncs.total, inside["fused"], inside["transformers"], syncs.report(6))

    def per_step(i):
        return (out[t2][i] - out[t1][i]) / (t2 - t1)
    fused, library = per_step(1), per_step(2)
    own = per_step(0) - library  # fused.py's included
    line = (f"{name}: {out[t1][0]} syncs at max_len {t1}, {out[t2][0]} at {t2}: per step {own:.2f} twophase's "
            f"(of which {fused:.2f} models/fused.py's) + {library:.2f} transformers'; {out[t2][3]}")
    print(line)
    return own, library, line


def _spy_compaction(monkeypatch) -> list:
    """A list that gets an entry at each compacted beam step: the counts must include some."""
    compacted, step = [], search._compact_step
    monkeypatch.setattr(search, "_compact_step", lambda *a: compacted.append(1) or step(*a))
    return compacted


def _lstm(eos_bias):
    model = tiny_model(tgt_vocab=300, seed=2)
    with torch.no_grad():
        model.out.bias[EOS] += eos_bias  # some rows finish (compaction has work), not all within the steps
    return model


SEARCHES = {
    "beam": lambda m, src, T: beam_search(m, src, 6, T),
    "sample": lambda m, src, T: sample(m, src, 6, T, generator=torch.Generator().manual_seed(0)),
    "sample, truncated": lambda m, src, T: sample(m, src, 6, T, 0.8, torch.Generator().manual_seed(0), top_k=20,
                                                  top_p=0.9, min_len=2),
    "sbs": lambda m, src, T: stochastic_beam_search(m, src, 6, T, torch.Generator().manual_seed(0)),
}


@pytest.mark.parametrize("compact_at", [search.COMPACT_AT, 0.0])
@pytest.mark.parametrize("kind", SEARCHES)
def test_lstm_search_reads_at_most_two_per_step(kind, compact_at, monkeypatch, one_thread):
    if compact_at == 0.0 and kind.startswith("sample"):
        pytest.skip("sampling never compacts")
    monkeypatch.setattr(search, "COMPACT_AT", compact_at)
    compacted = _spy_compaction(monkeypatch)
    model, src = _lstm(eos_bias=1.0), toy_batch((3, 1, 5, 4))
    own, library, line = _per_step(f"LSTM {kind} (COMPACT_AT {compact_at})",
                                   lambda T: SEARCHES[kind](model, src, T), (6, 12), monkeypatch)
    assert library == 0
    assert own <= PER_STEP, line
    if compact_at == 0.0:
        assert compacted, "no step was compacted: the counts miss compaction's bookkeeping"


@pytest.mark.parametrize("paper", [False, True])
def test_karel_search_reads_at_most_two_per_step(paper, monkeypatch, one_thread):
    from twophase.models.karel import IN_CHANNELS, KarelModel
    from twophase.models.karel_paper import KarelPaperModel
    torch.manual_seed(0)
    V, R, C = 40, 4, 4
    if paper:
        model = KarelPaperModel(V, R, C, embed_dim=8, hidden_size=8, channels=4, blocks=1, pair_dim=8)
    else:
        model = KarelModel(V, R, C, embed_dim=6, hidden_size=12, channels=(4, 5))
    model = model.double().eval()
    source = (torch.rand(3, 2, IN_CHANNELS, R, C, generator=torch.Generator().manual_seed(1)) < 0.2).double()
    monkeypatch.setattr(search, "COMPACT_AT", 0.0)
    compacted = _spy_compaction(monkeypatch)
    for kind in ("beam", "sample", "sbs"):
        own, library, line = _per_step(f"Karel{' paper' if paper else ''} {kind}",
                                       lambda T: SEARCHES[kind](model, source, T), (4, 8), monkeypatch)
        assert own <= PER_STEP, line
    assert compacted, "no beam step was compacted"


def test_deferred_checks_still_raise(monkeypatch):
    """NaN log-probabilities are refused as before, once the search ends, with the same ModelError."""
    from twophase.protocol import ModelError
    model, src = tiny_model(), toy_batch()
    with torch.no_grad():
        model.out.bias[5] = float("nan")
    for run in (lambda: beam_search(model, src, 3, 4), lambda: sample(model, src, 3, 4),
                lambda: stochastic_beam_search(model, src, 3, 4)):
        with pytest.raises(ModelError, match="returned NaN log-probabilities"):
            run()


hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")


@hf
@pytest.mark.parametrize("search_kind", ["beam", "sample", "sbs"])
@pytest.mark.parametrize("kind", ["t5", "bart", "gpt2", "llama"])
def test_hf_search_reads_at_most_two_per_step(kind, search_kind, monkeypatch, one_thread):
    import hf_tiny
    from twophase.models.hf import HFCausalLM, HFSeq2Seq
    V = 30  # eos likely enough that rows end (compacted steps), rare enough that some row runs to max_len
    if kind in hf_tiny.SEQ2SEQ:
        wrapper = HFSeq2Seq(hf_tiny.seq2seq(kind, seed=1 if kind == "t5" else 0, vocab=V))  # seed 0's T5 never ends
    else:
        wrapper = HFCausalLM(hf_tiny.causal(kind, vocab=V))
    rows = [[5, 6, 7, 8, 9], [10, 11], [4, 8, 11, 6]]
    P, left = max(map(len, rows)), kind in hf_tiny.CAUSAL
    ids = torch.full((len(rows), P), wrapper.pad_id)
    mask = torch.zeros(len(rows), P, dtype=torch.long)
    for i, r in enumerate(rows):
        at = slice(P - len(r), P) if left else slice(0, len(r))
        ids[i, at], mask[i, at] = torch.tensor(r), 1
    src = {"input_ids": ids, "attention_mask": mask}
    monkeypatch.setattr(search, "COMPACT_AT", 0.0)  # compacted steps counted too (beam, sbs)
    compacted = _spy_compaction(monkeypatch)
    own, library, line = _per_step(f"{kind} {search_kind}", lambda T: SEARCHES[search_kind](wrapper, src, T),
                                   (4, 8), monkeypatch)
    assert own <= PER_STEP, line
    # with transformers' own reads: BART's decoder checks the self-attention mask it builds on the host twice a
    # step (transformers' code, reached through its public forward), so BART's whole step makes 3
    assert own + library <= PER_STEP + (1 if kind == "bart" else 0), line
    assert compacted or search_kind == "sample", "no beam step was compacted"
