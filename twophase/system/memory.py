"""Memory: the process's peaks (what the device can tell, per section and for the whole run) and the bytes an
autograd graph keeps for backward.

The peaks:
- CUDA: the caching allocator's peaks, `allocated` (bytes held by tensors) and `reserved` (bytes the allocator
  took from the device, cached blocks included: what runs out first and raises an out-of-memory error);
- CPU: the process's resident set (RSS), its high-water mark from the kernel (the CPU keeps no record of tensor
  bytes short of the slow allocation profiler, `AllocationPeak` below).

`--profile-memory` gives every section of a step its own peak by resetting these high-water marks (`reset`); each
reset first folds the peak so far into the run's overall peak, so `overall` is the whole process's peak whatever
was reset, which the closing table reports.

What a graph keeps for backward (the bytes of tensors saved by its nodes): `SavedTensorMeter` sees every tensor
autograd saves while it is active (built-in ops and custom Functions' `save_for_backward` alike) through
`torch.autograd.graph.saved_tensors_hooks`. A storage is counted once however many views of it are saved, and only
while the graph still holds it: each saved tensor is wrapped in a small holder whose finalizer runs when autograd
frees it (after backward, or when the graph becomes unreachable), so `peak_bytes` is the peak of bytes the graph
kept alive. Tensors that exist anyway (parameters, buffers, the shared encoder outputs) can be declared `resident`:
they are tallied in `resident_bytes`, not in the peak.

`AllocationPeak` is the CPU's counterpart of `torch.cuda.max_memory_allocated`: the peak of bytes held by
tensors, read from the profiler's record of every allocation and free. It leaves out what the C allocator keeps
mapped after tensors are freed, which the process's resident set (RSS) includes.

`TensorPeak` is a cheap, device-agnostic counterpart for a short block run without a graph (a teacher's decode,
which saves nothing for backward): the peak bytes of the tensors its operations create, alive at once, seen
through a dispatch mode (every operation's outputs, counted by storage while a reference to them lives).

`graph_bytes` measures phase two as training runs it: the largest per-chunk graph of one `rescore_backward`
call.

Letters: B sources, N candidate rows, C rows per chunk.
"""
from __future__ import annotations

import resource
import weakref
from typing import Iterable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import nested
from ..phase2.rescoring import rescore_backward

MB = 2**20
_overall: dict[str, dict[str, int]] = {}  # device -> kind -> bytes: the peaks before the last reset


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: fall back to the peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_peak_bytes() -> int:
    """The resident set's high-water mark since the last reset_rss_peak() (or since the process began)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_rss_peak() -> None:
    """Linux lets a process reset its resident-set high-water mark, so each section gets its own CPU peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the CPU peak is the process's peak so far


def current(device: torch.device) -> dict[str, int]:
    """The peaks since the last reset: {"allocated", "reserved"} bytes on CUDA, {"rss"} elsewhere."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device)}
    return {"rss": rss_peak_bytes()}


def _fold(device: torch.device) -> dict[str, int]:
    key = str(device) if device.type == "cuda" else "cpu"
    kept = _overall.setdefault(key, {})
    for kind, value in current(device).items():
        kept[kind] = max(kept.get(kind, 0), value)
    return kept


def reset(device: torch.device) -> None:
    """Start a new section's peaks, the peak so far kept in the overall one."""
    _fold(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_rss_peak()


def overall(device: torch.device) -> dict[str, int]:
    """The process's peaks since it began, through every reset: the keys of `current`."""
    return dict(_fold(device))


def overall_mb(device: torch.device) -> dict[str, float]:
    """`overall` in MiB, keyed as the run summary records them: peak_allocated_mb and peak_reserved_mb on CUDA,
    peak_rss_mb elsewhere."""
    return {f"peak_{kind}_mb": value / MB for kind, value in overall(device).items()}


# ------------------------------------------------------------------ what a run can hold
def available_bytes(device: torch.device) -> int | None:
    """Bytes this process may still take on `device`: CUDA's free memory plus what its allocator caches unused;
    on the CPU the kernel's MemAvailable (Linux; None elsewhere: nothing to compare with)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def row_state_bytes(model, source) -> tuple[float, float, int]:
    """What one search row holds, in bytes: its decoder state after one or two steps (the larger), the most a
    step after the first creates for it at once (its new state, its temporaries, its scores; `TensorPeak`), and
    the model's vocabulary. Two steps of 2 and of 6 rows of `source`'s first source, without a graph; the difference of the
    two counts is the rows' own (a tensor the rows share, such as the source's encoding, is in both). A cache
    that grows with the prefix is counted as two steps hold it (with the room a buffered cache keeps ahead): a
    floor, not what --max-len steps may reach."""
    from .. import nested, owners
    from ..protocol import eval_mode

    held, made = {}, {}
    with torch.inference_mode(), eval_mode(model):
        enc = model.encode(source)
        device = nested.device_of(enc)
        enc = nested.select_rows(enc, torch.zeros(1, dtype=torch.long, device=device))  # the first source
        for rows in (2, 6):
            owner = owners.repeated(1, rows, device)  # (rows,) all of source 0
            prev = torch.full((rows,), model.bos_id, dtype=torch.long, device=device)
            state = model.init_state(enc, owner)
            for t in range(2):
                with TensorPeak() as peak:
                    state, logp = model.step(enc, owner, prev, state)  # logp (rows, V)
                held[rows, t], made[rows, t] = storage_bytes(nested.tensors(state)), peak.peak_bytes
    state_bytes = max((held[6, t] - held[2, t]) / 4 for t in range(2))
    step_bytes = (made[6, 1] - made[2, 1]) / 4  # the second step's: a buffered cache is made at the first
    return max(0.0, state_bytes), max(0.0, step_bytes), logp.shape[-1]


# ------------------------------------------------------------------ what a graph saves for backward
def _storage_key(t: Tensor) -> tuple[int, int]:
    """(address, bytes) of t's whole storage: views of one buffer share the key, so it is counted once."""
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # no ordinary storage (e.g. sparse): fall back to identity
        return id(t), t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages of tensors: what holding them keeps alive (views of one buffer counted once)."""
    return sum(dict(_storage_key(t) for t in tensors).values())


class _LiveStorages:
    """Bytes of the storages that objects handed to `hold` keep alive, each storage counted once however many of
    them share it (until the last dies), and the peak of that sum."""

    def __init__(self):
        self._refs: dict[int, int] = {}  # storage address -> live holders
        self._sizes: dict[int, int] = {}  # storage address -> bytes, while held
        self.live_bytes = self.peak_bytes = 0

    def __contains__(self, key: int) -> bool:
        """Whether the storage was ever held here."""
        return key in self._refs

    def hold(self, holder, key: int, nbytes: int) -> None:
        if self._refs.get(key, 0) == 0:
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(holder, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live_bytes -= self._sizes.pop(key)


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
        self._saved = _LiveStorages()  # held by the graph's saved tensors
        self._seen: set[int] = set()
        self._resident_seen: set[int] = set()
        self.total_bytes = self.resident_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def live_bytes(self) -> int:
        return self._saved.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self._saved.peak_bytes

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
        self._saved.hold(held, key, nbytes)
        return held

    @staticmethod
    def _unpack(held: _Held) -> Tensor:
        return held.tensor


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


class TensorPeak(TorchDispatchMode):
    """Context manager: peak_bytes / live_bytes of the tensors created by the operations inside the block, alive
    at once (a storage counted once however many views of it live, until the last of them dies: `live_bytes` is
    still updated after the block). A storage an operation reads before any creates it existed before the block
    and is not counted. Every operation passes through Python while it is active: for a probe, not a loop."""

    def __init__(self):
        super().__init__()
        self._created_here = _LiveStorages()  # held by tensors created in the block
        self._before: set[int] = set()

    @property
    def live_bytes(self) -> int:
        return self._created_here.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self._created_here.peak_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, Tensor) and _storage_key(t)[0] not in self._created_here:
                self._before.add(_storage_key(t)[0])
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._created(t)
        return out

    def _created(self, t: Tensor) -> None:
        key, nbytes = _storage_key(t)
        if key in self._before or nbytes == 0:
            return
        self._created_here.hold(t, key, nbytes)


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
            inputs = [x for a in args for x in nested.tensors(a if isinstance(a, Tensor) else vars(a))]
            with SavedTensorMeter(resident + nested.floating(enc) + inputs) as meter:
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
