"""Measure what an autograd graph keeps for backward: the bytes of tensors saved by its nodes.

`SavedTensorMeter` sees every tensor autograd saves while it is active (built-in ops and custom Functions'
`save_for_backward` alike) through `torch.autograd.graph.saved_tensors_hooks`. A storage is counted once however
many views of it are saved, and only while the graph still holds it: each saved tensor is wrapped in a small
holder whose finalizer runs when autograd frees it (after backward, or when the graph becomes unreachable), so
`peak_bytes` is the peak of bytes the graph kept alive. Tensors that exist anyway (parameters, buffers, the
shared encoder outputs) can be declared `resident`: they are tallied in `resident_bytes`, not in the peak.

`AllocationPeak` is the CPU's counterpart of `torch.cuda.max_memory_allocated`: the peak of bytes held by
tensors, read from the profiler's record of every allocation and free. It leaves out what the C allocator keeps
mapped after tensors are freed, which the process's resident set (RSS) includes.

`graph_bytes` measures phase two as training runs it: the largest per-chunk graph of one `rescore_backward`
call.

Letters: B sources, N candidate rows, C rows per chunk.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import Tensor

from .. import tree
from ..rescoring import rescore_backward


def _storage_key(t: Tensor) -> tuple[int, int]:
    """(address, bytes) of t's whole storage: views of one buffer share the key, so it is counted once."""
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # no ordinary storage (e.g. sparse): fall back to identity
        return id(t), t.numel() * t.element_size()


class _Held:
    """What the graph stores in place of a saved tensor; its death tells the meter the graph let go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Context manager recording the tensors saved for backward inside its block.

    live_bytes      bytes of distinct storages the graph holds now (still updated after the block exits,
                    as backward releases what was saved inside it)
    peak_bytes      the maximum of live_bytes
    total_bytes     bytes of distinct storages ever saved inside the block, released or not
    resident_bytes  bytes of saved storages declared resident (not part of the three figures above)
    """

    def __init__(self, resident: Iterable[Tensor] = ()):
        self._resident = {_storage_key(t)[0] for t in resident}
        self._refs: dict[int, int] = {}  # storage address -> saved tensors holding it
        self._sizes: dict[int, int] = {}  # storage address -> bytes
        self._seen: set[int] = set()
        self._resident_seen: set[int] = set()
        self.live_bytes = self.peak_bytes = self.total_bytes = self.resident_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: Tensor) -> _Held:
        key, nbytes = _storage_key(t)
        held = _Held(t)
        if key in self._resident:
            if key not in self._resident_seen:
                self._resident_seen.add(key)
                self.resident_bytes += nbytes
            return held
        if key not in self._seen:
            self._seen.add(key)
            self.total_bytes += nbytes
        if self._refs.get(key, 0) == 0:
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held: _Held) -> Tensor:
        return held.tensor

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live_bytes -= self._sizes.pop(key)


class AllocationPeak:
    """Context manager: peak_bytes / end_bytes of CPU tensor memory allocated inside the block, above what was
    allocated when it began. Frees of tensors allocated before the block are not recorded (the profiler warns),
    so those bytes count as still held: the figure is never an underestimate. Runs the profiler with memory
    events, so it slows the block down (measure on a step that is not timed) and holds its event list until
    exit, which raises the block's RSS."""

    def __enter__(self) -> "AllocationPeak":
        self.peak_bytes = self.end_bytes = 0
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        # One event per allocation (+bytes) or free (-bytes); the sort is stable, so events stamped at the
        # same nanosecond keep the profiler's order.
        events = sorted(((e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                         if e.name() == "[memory]" and e.device_type().name == "CPU"), key=lambda x: x[0])
        live = 0
        for _, nbytes in events:
            live += nbytes
            self.peak_bytes = max(self.peak_bytes, live)
        self.end_bytes = live
        del self._prof


def graph_bytes(model, source, samples, coefficients: Tensor, chunk_size: int, prefix_sharing: bool = True) -> int:
    """Peak bytes saved for backward by the largest chunk of one `rescore_backward` call.

    For the built-in `Seq2Seq`. Each chunk's graph is freed before the next is built, so the call's graph footprint is the maximum over
    chunks. Phase two's only graph is the decoder's, built inside `model.decoder_states` (rows) or
    `model.tree_decoder_states` (a prefix tree; the output layer is differentiated by hand, without a graph), so
    those methods are wrapped for the duration of the call (instance attributes shadowing them, removed
    afterwards). Parameters, buffers and the arguments (shared encoder outputs; the chunk's tokens, owner, or
    tree) are resident: they exist whatever the chunk, so they are not counted."""
    per_chunk: list[int] = []
    resident = list(model.parameters()) + list(model.buffers())

    def measured(method):
        def run(enc, *args):
            inputs = [x for a in args for x in tree.tensors(a if isinstance(a, Tensor) else vars(a))]
            with SavedTensorMeter(resident + tree.floating(enc) + inputs) as meter:
                out = method(enc, *args)
            per_chunk.append(meter.peak_bytes)
            return out
        return run

    model.decoder_states = measured(model.decoder_states)
    model.tree_decoder_states = measured(model.tree_decoder_states)
    try:
        rescore_backward(model, source, samples, coefficients, chunk_size, prefix_sharing=prefix_sharing)
    finally:
        del model.decoder_states, model.tree_decoder_states
    return max(per_chunk, default=0)
