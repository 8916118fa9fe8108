"""--rescore-chunk auto under distillation: each chunk first runs the teacher's decode (without a graph), then
holds its output-layer inputs (C, T, H_teacher) beside the student's graph, so the planned chunk makes room for
both. Checked against the teacher's width (what its states cost per row-step) and the profiler's allocation
record of its decode, against phase two itself run at the planned chunk with every chunk measured as it runs (the
planner's few-row probe is not that run), and end to end: a wider teacher gives a run smaller chunks."""
import json

import pytest
import torch

from conftest import toy_batch
from taskfiles import write_task
from twophase import Seq2Seq, beam_search, nested, rescore_backward
from twophase.objectives import distillation
from twophase.system.memory import AllocationPeak, SavedTensorMeter, TensorPeak
from twophase.system.profiling import ChunkPlanner
from twophase.train import cli

pytestmark = pytest.mark.usefixtures("one_thread")


def _lstm(hidden, embed, seed, V=40):
    torch.manual_seed(seed)
    return Seq2Seq(9, V, embed_dim=embed, hidden_size=hidden).eval()


@pytest.fixture(scope="module")
def batch():
    student = _lstm(16, 8, seed=0)
    source = toy_batch(lengths=(5, 5, 5))
    return student, source, beam_search(student, source, beam_size=16, max_len=8)


def chunk_peaks(student, teacher, source, s, chunk, prefix_sharing):
    """Per chunk of one `rescore_backward` with distillation at `chunk`, its peak, measured as it runs: the
    teacher's decode (tensor bytes by the profiler's allocation record, `AllocationPeak`), or after it the bytes
    the student's graph saved (its decoder's: the output layer is differentiated by hand) beside the teacher's
    states, whichever is larger."""
    graphs, decodes, states = [], [], []
    resident = list(student.parameters()) + list(student.buffers())
    decoders = {name: getattr(student, name) for name in ("decoder_states", "tree_decoder_states")}
    teacher_states = teacher.head_states

    def measured(method):
        def run(enc, *args):
            # the shared encoder output and the chunk's tokens, owner or tree exist whatever the chunk
            inputs = [x for a in args for x in nested.tensors(a if isinstance(a, torch.Tensor) else vars(a))]
            with SavedTensorMeter(resident + nested.floating(enc) + inputs) as meter:
                out = method(enc, *args)
            graphs.append(meter.peak_bytes)
            return out
        return run

    def kept(enc, tokens, owner):
        with AllocationPeak() as peak:
            out = teacher_states(enc, tokens, owner)
        decodes.append(peak.peak_bytes)
        states.append(out.hidden.untyped_storage().nbytes())
        return out

    for name, method in decoders.items():
        setattr(student, name, measured(method))
    teacher.head_states = kept
    try:
        rescore_backward(student, source, s, distillation(teacher), chunk_size=chunk, prefix_sharing=prefix_sharing)
    finally:
        for name in decoders:
            delattr(student, name)
        del teacher.head_states
    assert len(graphs) == len(states) > 0  # one teacher decode per chunk
    return [max(d, g + t) for d, g, t in zip(decodes, graphs, states)]


def _decode_peak_per_row_step(planner, teacher, student, source, samples) -> float:
    """The teacher's decode of the planner's probe rows (their longest length), its peak tensor bytes per row-step
    as the profiler's allocation record has it."""
    rows = samples.select(torch.arange(planner.probe_rows))
    longest = int(rows.lengths.max())
    bound = distillation(teacher).bind(student, source, rows)
    with AllocationPeak() as decode:
        bound.decoded(rows.tokens[:, :longest], rows.owner)
    return decode.peak_bytes / (len(rows) * longest)


@pytest.mark.parametrize("width", [32, 96])
def test_the_teachers_pass_shrinks_the_chunk_by_its_cost(batch, width):
    student, source, s = batch
    teacher = _lstm(width, 8, seed=1).requires_grad_(False)
    budget, T = 60_000, s.tokens.shape[1]
    planner = ChunkPlanner(budget)
    plain = planner.chunk_size(student, source, s)
    distilled = planner.chunk_size(student, source, s, distillation(teacher))
    # the teacher's states: H_teacher float32 numbers per row-step, whatever the student
    assert planner.held_per_row_step == width * 4
    # its decode's peak, as the profiler's allocation record has it, on the probe's rows
    assert planner.decode_per_row_step == pytest.approx(_decode_peak_per_row_step(planner, teacher, student, source,
                                                                                 s), rel=0.02)
    # the chunk's peak: the decode's, or the student's graph (its decoder's, the divergence being differentiated
    # by hand) beside the states
    assert planner.objective_per_row_step == max(planner.decode_per_row_step, planner.per_row_step + width * 4)
    assert plain == int(budget // (planner.per_row_step * T)) < len(s)
    assert distilled == int(budget // (planner.objective_per_row_step * T)) < plain
    # coefficient rows after distillation's are planned as before: the two probes do not mix
    assert planner.chunk_size(student, source, s) == plain


@pytest.mark.parametrize("width", [32, 96])
@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_the_planned_chunk_keeps_graph_and_teacher_within_the_budget(batch, width, prefix_sharing):
    student, source, s = batch
    teacher = _lstm(width, 8, seed=1).requires_grad_(False)
    budget = 60_000
    chunk = ChunkPlanner(budget).chunk_size(student, source, s, distillation(teacher))
    assert 1 < chunk < len(s)
    assert max(chunk_peaks(student, teacher, source, s, chunk, prefix_sharing)) <= budget
    # the chunk of the graph alone, what the planner chose before it counted the teacher, does not fit
    graph_only = ChunkPlanner(budget).chunk_size(student, source, s)
    assert graph_only > chunk
    if not prefix_sharing:  # (a tree's chunk may decode fewer nodes than the rows-by-T the planner prices)
        assert max(chunk_peaks(student, teacher, source, s, graph_only, prefix_sharing)) > budget


def test_tensor_peak_counts_what_the_block_creates():
    before = torch.ones(1000)  # exists already: neither it nor its views count
    with TensorPeak() as meter:
        a = before * 2  # 4000 bytes
        view = a[:10]
        b = torch.cat([a, a])  # 8000 more: 12000 at once
        del a  # its storage lives on in view
        c = before.view(10, 100).t()
        del b
        d = view + 1  # 40 bytes
    assert meter.peak_bytes == 12000 and meter.live_bytes == 4040
    del view, c, d
    assert meter.live_bytes == 0


def test_a_wider_teacher_gives_a_run_smaller_chunks(tmp_path):
    """End to end: the same student, data and seed distilled from a narrow and a wide teacher under one
    --memory-budget; the student's candidates are the same (phase one is the student's), the chunks not."""
    write_task(tmp_path / "train.tsv", "reverse", 60, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 6, seed=1)
    data = ["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "valid.tsv")]
    tiny = ["--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size", "4", "--max-len", "8",
            "--eval-every", "100", "--save-every", "100", "--no-compare-mle"]
    chunks = {}
    for width in (8, 96):
        teacher = tmp_path / f"teacher{width}"
        assert cli.main([*data, *tiny, "--hidden-size", str(width), "--mle-steps", "2", "--rl-steps", "0",
                         "--save-dir", str(teacher)]) == 0
        run = tmp_path / f"student{width}"
        assert cli.main([*data, *tiny, "--hidden-size", "12", "--mle-steps", "1", "--rl-steps", "2",
                         "--objective", "distill", "--teacher", str(teacher / "checkpoint_last.pt"),
                         "--rescore-chunk", "auto", "--memory-budget", "40KB", "--save-dir", str(run)]) == 0
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        chunks[width] = [(r["candidates"], r["chunk"]) for r in rows if r.get("phase") == "rl" and "chunk" in r]
    assert [c for c, _ in chunks[8]] == [c for c, _ in chunks[96]] and len(chunks[8]) == 2
    assert all(1 <= wide < narrow < rows for (rows, narrow), (_, wide) in zip(chunks[8], chunks[96])), chunks


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_hugging_face_teachers_are_counted_too(kind):
    """A causal and an encoder-decoder pair: the teacher's states (float64, width 48), its decode's peak as
    the profiler records it, and the student's graph with the divergence itself (a causal LM's first completion
    token reads its prompt's whole distribution with autograd's graph)."""
    pytest.importorskip("transformers")
    import hf_tiny
    from twophase import sample
    from twophase.models.hf import HFCausalLM, HFSeq2Seq

    if kind == "llama":
        student, teacher = HFCausalLM(hf_tiny.causal(kind, seed=0)), HFCausalLM(hf_tiny.causal(kind, seed=3, width=48))
        rows, left = [[5, 6, 7, 8], [10, 11], [4, 8, 11]], True
    else:
        student, teacher = HFSeq2Seq(hf_tiny.seq2seq(kind, seed=0)), HFSeq2Seq(hf_tiny.seq2seq(kind, seed=3, width=48))
        rows, left = [[4, 5, 6, 1], [7, 8, 1], [9, 1]], False
    teacher.requires_grad_(False)
    width = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):  # padded as a tokenizer pads
        at = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, at], mask[i, at] = torch.tensor(r), 1
    source = {"input_ids": ids, "attention_mask": mask}
    s = sample(student, source, 8, 6, generator=torch.Generator().manual_seed(0))
    budget, T = 100_000, s.tokens.shape[1]
    planner = ChunkPlanner(budget)
    plain = planner.chunk_size(student, source, s)
    distilled = planner.chunk_size(student, source, s, distillation(teacher))
    assert planner.held_per_row_step == 48 * 8
    assert planner.decode_per_row_step == pytest.approx(_decode_peak_per_row_step(planner, teacher, student, source,
                                                                                 s), rel=0.02)
    assert planner.objective_per_row_step >= planner.per_row_step + 48 * 8
    assert distilled == int(budget // (planner.objective_per_row_step * T)) <= plain
