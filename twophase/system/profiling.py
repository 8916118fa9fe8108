"""Where a training step's time and memory go (`--profile-memory`), and how big a phase-two chunk may be
(`--rescore-chunk auto --memory-budget SIZE`).

A `StepProfiler` cuts a step into named sections (encoder, phase one, every phase-two chunk, optimizer step) and
records for each its wall time, its memory and the bytes the autograd graph saved for backward inside it.
Sections do not nest: the innermost saved-tensor hook wins. Memory is what the device can tell:
- CUDA: `allocated_mb` (bytes held by tensors at the section's end), `peak_allocated_mb` (their peak inside
  it) and `peak_reserved_mb` (the allocator's own peak inside it, cached blocks included: what runs out), from
  the caching allocator;
- CPU: `rss_mb` (the process's resident set at the section's end) and `rss_peak_mb` (its peak inside the
  section: Linux lets the high-water mark be reset at the section's start). The CPU has no record of tensor bytes
  short of the slow allocation profiler (`memory.AllocationPeak`, which the benchmark uses), so the resident
  set, which also holds what the C allocator keeps after tensors are freed, is all a row can show cheaply.
Each section's reset keeps the run's overall peak (`memory`), which the closing table reports.

Letters: N candidate rows, C rows per chunk, T target length, S source length.
"""
from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager

import torch
from torch import Tensor
from tqdm import tqdm

from .. import nested
from ..phase2 import rescoring, tokenweights
from ..phase2.rescoring import chunk_gradients
from ..protocol import scoring_mode
from . import memory
from .memory import MB, SavedTensorMeter, TensorPeak, rss_bytes, rss_peak_bytes


class StepProfiler:
    def __init__(self, device: torch.device):
        self.device = device
        self.rows: list[dict] = []

    @contextmanager
    def section(self, name: str | None, part: str | None = None):
        """A row for the section `name` (None: a part of the step that is no section of its own, phase two's
        whole, whose chunks are sections: no row). `part` names the part of the step it belongs to, for a
        caller that groups sections by part (a benchmark's timer); the rows do not record it."""
        if name is None:
            yield
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        memory.reset(self.device)  # the run's overall peak is kept through it (the closing table's)
        start = time.perf_counter()
        with SavedTensorMeter() as meter:
            yield
        if cuda:
            torch.cuda.synchronize(self.device)
        row = {"section": name, "seconds": time.perf_counter() - start}
        if cuda:
            row.update(allocated_mb=torch.cuda.memory_allocated(self.device) / MB,
                       peak_allocated_mb=torch.cuda.max_memory_allocated(self.device) / MB,
                       peak_reserved_mb=torch.cuda.max_memory_reserved(self.device) / MB)
        else:
            row.update(rss_mb=rss_bytes() / MB, rss_peak_mb=rss_peak_bytes() / MB)
            # The kernel keeps resident-set counts per CPU and folds them in batches, so the reset high-water
            # mark and a later reading of the RSS can disagree by a few hundred KB either way; a peak below the
            # value it must bound is that noise, and the bound is the truer figure.
            row["rss_peak_mb"] = max(row["rss_peak_mb"], row["rss_mb"])
        self.rows.append({**row, "graph_mb": meter.peak_bytes / MB})

    def write(self, path, step: int, phase: str, echo: bool) -> None:
        """Append this step's sections to a JSONL file; with echo, also print the table."""
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "phase": phase, "sections": self.rows}) + "\n")
        if echo:
            tqdm.write(f"memory profile of step {step} ({phase}):\n{self.table()}")

    def table(self) -> str:
        cuda = self.device.type == "cuda"
        columns = ((("allocated_mb", "allocated MB"), ("peak_allocated_mb", "peak alloc MB"),
                    ("peak_reserved_mb", "peak resv MB")) if cuda else
                   (("rss_mb", "RSS MB"), ("rss_peak_mb", "RSS peak MB")))
        lines = [f"{'section':34}{'ms':>9}" + "".join(f"{head:>15}" for _, head in columns) + f"{'graph MB':>10}"]
        shown = summarised(self.rows)
        for r in shown:
            cells = "".join(f"{r[key]:>15.1f}" for key, _ in columns)
            lines.append(f"{r['section']:34}{1000 * r['seconds']:>9.1f}{cells}{r['graph_mb']:>10.2f}")
        top = max(self.rows, key=lambda r: r["graph_mb"], default=None)
        if top is not None and top["graph_mb"] > 0:
            lines.append(f"largest autograd graph: {top['section']} ({top['graph_mb']:.2f} MB)")
        if len(shown) < len(self.rows):
            lines.append("(a line of N chunks: their time summed, their memory the largest of them; every chunk is in "
                         "memory_profile.jsonl)")
        return "\n".join(lines)


CHUNK = "phase 2: chunk"
SHOWN_CHUNKS = 3  # a step of more phase-two chunks prints them as one line


def summarised(rows: list[dict]) -> list[dict]:
    """The rows of the printed table: each run of more than SHOWN_CHUNKS phase-two chunks as one row (time
    summed, every memory figure the largest of the run); other sections as they are."""
    out, run = [], []

    def flush():
        if len(run) > SHOWN_CHUNKS:
            counts = [re.search(r"of (\d+) rows", r["section"]) for r in run]
            rows_of = sum(int(m.group(1)) for m in counts if m)
            merged = {k: max(r[k] for r in run) for k in run[0] if k not in ("section", "seconds")}
            out.append({"section": f"phase 2: {len(run)} chunks, {rows_of} rows", **merged,
                        "seconds": sum(r["seconds"] for r in run)})
        else:
            out.extend(run)
        run.clear()

    for r in rows:
        if r["section"].startswith(CHUNK):
            run.append(r)
            continue
        flush()
        out.append(r)
    flush()
    return out


class ChunkPlanner:
    """Chooses the phase-two chunk size from a memory budget for what a chunk holds: its graph, and what an
    objective decodes for the chunk alone (a distillation teacher's pass and output-layer inputs,
    `objectives.distill`).

    Graph bytes grow with rows x steps, so one probe (a few rows, teacher-forced with grad, measured by a
    saved-tensor meter, then dropped) gives bytes per row-step; a step's chunk is then budget / (that x T).
    An objective that meets each chunk's rows itself (`bind`, then `decoded` per chunk) gets a probe of its own,
    the same rows decoded by it and differentiated with it: the peak of its decode (a pass without a graph,
    measured by `memory.TensorPeak`), and its graph beside the tensors it holds for the chunk (`chunk_states`),
    whichever is larger, per row-step. The probes are repeated when a batch has larger sources (elements per
    source) than any probed so far (attention keeps S-sized tensors per row-step), so the estimate never
    undercounts. The output layers' transient logit blocks (fused.py, at most a fixed block of rows at a time,
    a teacher's beside the student's) and the gradients come on top of the budget, except the chunk-time copy
    of the gradients that CUDA's out-of-memory retry makes, which the budget includes.
    """

    def __init__(self, budget_bytes: int, probe_rows: int = 8):
        self.budget = budget_bytes
        self.probe_rows = probe_rows
        self.per_row_step = 0.0  # the graph of rows with fixed coefficients
        self.probed_source_size = 0.0
        # an objective that decodes each chunk itself: its chunk's peak, the states it holds, its decode's peak
        self.objective_per_row_step = self.held_per_row_step = self.decode_per_row_step = 0.0
        self.objective_source_size = 0.0

    def chunk_size(self, model, source, samples, objective=None) -> int:
        """The rows per chunk of phase two over samples; objective: what phase two is given for them (the
        coefficients, or an objective such as `objectives.distillation`), whose own chunk costs are counted."""
        if len(samples) == 0:
            return 1
        size = _source_size(source)
        if isinstance(objective, tokenweights.UnboundObjective):  # it decodes each chunk's rows itself
            if size > self.objective_source_size:
                self._probe(model, source, samples, objective)
                self.objective_source_size = size
            per_row_step = self.objective_per_row_step
        else:
            if size > self.probed_source_size:
                self._probe(model, source, samples)
                self.probed_source_size = size
            per_row_step = self.per_row_step
        T = max(int(samples.tokens.shape[1]), 1)
        return max(1, min(len(samples), int(self.graph_budget(model, samples) // max(per_row_step * T, 1.0))))

    def graph_budget(self, model, samples) -> float:
        """The budget left for the chunk's graph: on a device where phase two retries out-of-memory chunks
        (CUDA), each chunk's gradient is collected before it is added, a copy of the trainable parameters'
        gradients that exists while the chunk's graph does, so it is taken off the budget first."""
        if not rescoring.retries_out_of_memory(samples.tokens.device):
            return self.budget
        return max(0.0, self.budget - rescoring.collected_bytes(model))

    def _probe(self, model, source, samples, objective=None) -> None:
        """One phase-two chunk of a few rows, forward and backward, its gradients returned and dropped. With an
        objective that decodes each chunk, the chunk is its: bound to the probe rows, decoded (without a graph,
        its peak measured), the tensors it then holds for the chunk counted beside the graph."""
        rows = samples.select(torch.arange(min(self.probe_rows, len(samples)), device=samples.tokens.device))
        T = int(rows.lengths.max())
        tokens = rows.tokens[:, :T]
        weights: Tensor | tokenweights.ChunkLoss = torch.ones(len(rows), dtype=torch.float64,
                                                              device=rows.tokens.device)
        held: list[Tensor] = []  # what the objective holds for the chunk alone
        decode_bytes = 0
        if objective is not None:  # as rescore_backward meets it: bound to the rows, decoded per chunk
            chunk = objective.bind(model, source, rows)
            if isinstance(chunk, tokenweights.DecodesChunks):
                with TensorPeak() as decode:  # (no graph: the saved-tensor meter would see nothing)
                    chunk = chunk.decoded(tokens, rows.owner)
                decode_bytes = decode.peak_bytes
            held = chunk.chunk_states() if callable(getattr(chunk, "chunk_states", None)) else []
            weights = tokenweights.ChunkLoss(chunk)
        with torch.enable_grad(), scoring_mode(model):
            boundary = nested.cut_floating(model.encode(source))
            params = [p for p in model.parameters() if p.requires_grad]
            resident = list(model.parameters()) + list(model.buffers()) + nested.floating(boundary) + held
            inputs = params + [x for x in nested.floating(boundary) if x.requires_grad]
            with SavedTensorMeter(resident) as meter:  # phase two's graph, as rescore_backward builds it
                chunk_gradients(model, boundary, tokens, rows.owner, weights, inputs, collect=True)
        row_steps = len(rows) * T
        if objective is None:
            self.per_row_step = max(self.per_row_step, meter.peak_bytes / row_steps)
            return
        # the chunk's peak: while the objective decodes (its states among what it creates), or later, its
        # states beside the graph
        held_bytes = memory.storage_bytes(held)
        self.held_per_row_step = max(self.held_per_row_step, held_bytes / row_steps)
        self.decode_per_row_step = max(self.decode_per_row_step, decode_bytes / row_steps)
        self.objective_per_row_step = max(self.objective_per_row_step,
                                          max(decode_bytes, meter.peak_bytes + held_bytes) / row_steps)


def _source_size(source) -> float:
    """Elements per source in a batch of sources: what grows when longer sources arrive."""
    parts = nested.tensors(source)
    return sum(x.numel() for x in parts) / max(1, nested.leading_size(source)) if parts else 0.0
