"""Phase two waits for the device at most 8 times per chunk: every chunk's sizes come from a plan read back once
per batch (`twophase.phase2.chunkplan.ChunkPlan`), the tree's per-depth owner layouts are declared on the host
(`twophase.owners`),
and the chunks' losses are summed on the device. Counted on the CPU by `benchmarks.hostsyncs.count_host_syncs`
(what a GPU run would wait for), at two chunk sizes, so that the per-batch reads cancel out of the per-chunk
figure. The counts are printed (pytest -s) and in every assertion's message."""
import importlib.util

import pytest
import torch

from twophase import Seq2Seq, beam_search, rescore_backward
from benchmarks.hostsyncs import count_host_syncs
from twophase.models.karel import KarelModel

from conftest import tiny_model, toy_batch

pytestmark = pytest.mark.usefixtures("one_thread")

PER_CHUNK = 8


def _syncs(model, source, s, c, chunk, **kw):
    """(chunks, host syncs, the counter) of one rescore_backward."""
    model.zero_grad()
    stats = {}
    with count_host_syncs() as syncs:
        rescore_backward(model, source, s, c, chunk_size=chunk, stats=stats, **kw)
    return stats["chunks"], syncs.total, syncs


def _per_chunk(name, model, source, s, sizes, **kw):
    c = torch.randn(len(s), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (n1, t1, _), (n2, t2, syncs) = (_syncs(model, source, s, c, size, **kw) for size in sizes)
    assert n2 >= n1 + 3, f"{name}: the chunk sizes {sizes} gave {n1} and {n2} chunks; the test needs more apart"
    per = (t2 - t1) / (n2 - n1)
    fixed = t1 - per * n1
    line = (f"{name}: {n1} chunks {t1} syncs, {n2} chunks {t2} syncs: {per:.2f} per chunk, {fixed:.1f} per "
            f"batch; {syncs.report(8)}")
    print(line)
    return per, line


class _StepOnly(torch.nn.Module):
    """The LSTM seen through the protocol's three methods only: phase two decodes its tree with `step`."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.pad_id, self.bos_id, self.eos_id = inner.pad_id, inner.bos_id, inner.eos_id

    def encode(self, source):
        return self.inner.encode(source)

    def init_state(self, enc, owner):
        return self.inner.init_state(enc, owner)

    def step(self, enc, owner, prev, state):
        return self.inner.step(enc, owner, prev, state)


def _lstm():
    torch.manual_seed(0)
    model = Seq2Seq(12, 40, embed_dim=8, hidden_size=12).double().eval()
    src, lengths = toy_batch(lengths=(4, 2, 5, 3), src_vocab=12)
    s = beam_search(model, (src, lengths), beam_size=8, max_len=8)
    return model, (src, lengths), s


# What the LSTM's chunks read today: the count of positions its output layer scores (a tree's nodes with a weight;
# a row chunk's non-pad positions, twice); a model with only `step` reads nothing per chunk.
LSTM_READS = {"tree": 1, "rows": 2, "tree-collect": 1, "step-only tree": 0}


@pytest.mark.parametrize("layout", list(LSTM_READS))
def test_lstm_phase_two_host_syncs_per_chunk(layout):
    model, source, s = _lstm()
    kw = {"prefix_sharing": layout != "rows", "oom_retry": layout == "tree-collect"}
    if layout == "step-only tree":
        model = _StepOnly(model)
    per, line = _per_chunk(f"LSTM {layout}", model, source, s, (16, 2), **kw)
    assert per <= PER_CHUNK, line
    assert per <= LSTM_READS[layout], line


def test_karel_phase_two_host_syncs_per_chunk():
    torch.manual_seed(0)
    model = KarelModel(12, 4, 4, embed_dim=4, hidden_size=6, channels=(3, 3)).double().eval()
    source = torch.rand(3, 2, 32, 4, 4, dtype=torch.float64)
    s = beam_search(model, source, beam_size=6, max_len=6)
    per, line = _per_chunk("Karel", model, source, s, (8, 2))
    assert per <= PER_CHUNK, line


HF = importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not HF, reason="transformers is not installed")
@pytest.mark.parametrize("kind", ["t5", "gpt2"])
@pytest.mark.parametrize("head", [True, False])
def test_hf_phase_two_host_syncs_per_chunk(kind, head):
    import hf_tiny
    from twophase.models.hf import HFCausalLM, HFSeq2Seq

    wrapper = HFSeq2Seq(hf_tiny.seq2seq(kind)) if kind == "t5" else HFCausalLM(hf_tiny.causal(kind))
    if not head:
        wrapper.head = None  # the model's full logits, differentiated by autograd
    ids = torch.randint(4, hf_tiny.VOCAB, (3, 4), generator=torch.Generator().manual_seed(1))
    source = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    s = beam_search(wrapper, source, beam_size=4, max_len=5)
    per, line = _per_chunk(f"HF {kind} head={head}", wrapper, source, s, (6, 1))
    assert per <= PER_CHUNK, line


def test_planned_tree_shape_and_layouts_are_the_devices():
    """The host's plan of a chunk (prefixtree.shape from the batch's lists) gives the tree the device's own
    reads give, and each depth's declared owner layout is the one fused.groups finds by reading the owners."""
    from twophase import owners
    from twophase.models import fused
    from twophase.phase2 import prefixtree

    tokens = torch.tensor([[5, 6, 3, 0], [5, 6, 7, 3], [5, 6, 3, 0], [8, 3, 0, 0], [5, 6, 3, 0], [5, 3, 0, 0]])
    owner, lengths = torch.tensor([0, 0, 0, 0, 1, 2]), torch.tensor([3, 4, 3, 2, 3, 2])
    order = prefixtree.sort_rows(tokens, owner, lengths)
    tokens, owner, lengths = tokens[order], owner[order], lengths[order]
    c = torch.arange(1.0, 7.0, dtype=torch.float64)
    common = prefixtree.common_prefix(tokens, owner, lengths).tolist()
    for a in range(6):
        for b in range(a + 1, 7):
            rows = slice(a, b)
            plan = prefixtree.shape(lengths.tolist()[rows], common[rows], owner.tolist()[rows])
            planned = prefixtree.build(tokens[rows], owner[rows], lengths[rows], c[rows], plan)
            read = prefixtree.build(tokens[rows], owner[rows], lengths[rows], c[rows])
            assert planned.offsets == read.offsets and planned.positions == read.positions
            for name in ("tokens", "owner", "parent", "weights"):
                assert torch.equal(getattr(planned, name), getattr(read, name)), (a, b, name)
            for t in range(planned.depth):
                level = planned.level_owner(t)
                assert owners.known(level) == plan.groups[t]
                assert fused.groups(level.clone()) == plan.groups[t], (a, b, t)  # a fresh tensor: read


def test_a_declared_layout_is_not_read_and_dies_with_its_tensor():
    from twophase import owners
    from twophase.models import fused

    owner = owners.declare(torch.tensor([3, 3, 4, 4]), (3, 2))
    searched = owners.repeated(3, 2, "cpu")  # a search's B x K rows
    with count_host_syncs() as syncs:
        assert fused.groups(owner) == (3, 2) and fused.groups(searched) == (0, 2)
        assert owners.known_blocks(searched, 3) == 2 and owners.known_blocks(owner, 2) == 0
    assert syncs.total == 0, syncs.report()
    assert owners.known(owner.clone()) is owners.UNKNOWN and owners.known_blocks(owner.clone(), 2) is None
    key = id(owner)
    del owner
    assert key not in owners._KNOWN
