"""Counting the reads that make the host wait for the device, on any device, the CPU included.

On a GPU the host queues kernels and runs ahead; a read of a tensor's value (`.item()`, `bool(t)`, `.tolist()`,
`nonzero`, a boolean-mask index, a tensor built from Python data) makes it wait until the queue drains. On the
CPU such reads cost nothing, so they creep into per-step code unseen. `count_host_syncs()` counts them where they
happen, by the operators that need a value on the host (a dispatch mode) and by the Python methods that read one
(`tolist`, `numpy`, `cpu`), each with the line of twophase's code that asked:

    with count_host_syncs() as syncs:
        beam_search(model, source, beam_size=64, max_len=50)
    print(syncs.total, syncs.by_site.most_common(5))

A tensor made from Python data (`torch.tensor(...)`) counts: on an accelerator it is a blocking copy from host
memory. Ops the CPU build routes through the same value reads on CUDA are counted by their operator, so the
count is what a GPU run would wait for, up to kernels that synchronise inside a library.

On a CUDA device `count_cuda_syncs()` gives CUDA's own count of the same block (`torch.cuda.set_sync_debug_mode`),
which sees what synchronises inside a library too.
"""
from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import twophase

_PACKAGE = str(Path(twophase.__file__).resolve().parent)  # the sites counted: twophase's own code
_HERE = str(Path(__file__).resolve())

_aten = torch.ops.aten
# Operators whose result needs a value on the host: a scalar read, an output whose size depends on the data, or
# a comparison answered on the host.
_VALUE_READS = {
    _aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t) (with autograd's dispatch)
    _aten.item.default,  # the same reads, as inference mode dispatches them
    _aten.is_nonzero.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.equal.default,
    _aten.bincount.default,
    _aten.lift_fresh.default,  # torch.tensor(data): a copy from host memory
}


def _reads_value(func, args, kwargs) -> bool:
    if func is _aten.lift_fresh.default:
        # torch.tensor([]): copying no element returns before it touches the device (transformers' caches make
        # such placeholders at every step)
        return args[0].numel() > 0
    if func in _VALUE_READS:
        return True
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        # a boolean-mask index becomes nonzero inside the kernel
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _site() -> str:
    """`file:line` of the innermost frame in twophase's own code (outside this module), else the caller's."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) and name != _HERE:
            return f"{Path(name).relative_to(Path(_PACKAGE).parent)}:{frame.f_lineno}"
        if fallback is None and name != _HERE and "torch" not in name:
            fallback = f"{Path(name).name}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


class HostSyncs(TorchDispatchMode):
    """The counter itself: `total` reads, `by_site[file:line]`, `by_kind[operator or method]`."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_site: collections.Counter[str] = collections.Counter()
        self.by_kind: collections.Counter[str] = collections.Counter()

    def record(self, kind: str) -> None:
        self.total += 1
        self.by_kind[kind] += 1
        self.by_site[_site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_value(func, args, kwargs):
            self.record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    def report(self, top: int = 10) -> str:
        sites = ", ".join(f"{s} x{n}" for s, n in self.by_site.most_common(top))
        return f"{self.total} host syncs ({sites})"


@contextlib.contextmanager
def count_host_syncs():
    """Count the host syncs of the code inside; yields the `HostSyncs` counter."""
    counter = HostSyncs()
    patched = {}

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            counter.record(name)
            return original(self, *args, **kwargs)

        patched[name] = original
        setattr(torch.Tensor, name, read)

    for name in ("tolist", "numpy", "cpu"):
        wrap(name)
    try:
        with counter:
            yield counter
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)


# CUDA's own count: with torch.cuda.set_sync_debug_mode("warn"), every call that synchronises the host with the
# device (a copy to the host, cudaStreamSynchronize behind .item(), nonzero, a blocking copy from pageable
# memory, ...) raises this warning, from the line of Python that asked.
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class CudaSyncs:
    """CUDA's count of the synchronising calls of a block: `total`, `by_site[file:line]`."""

    def __init__(self):
        self.total = 0
        self.by_site: collections.Counter[str] = collections.Counter()

    def add(self, caught) -> list:
        """Count the sync warnings of `caught` (warnings.WarningMessage); return the others."""
        others = []
        for w in caught:
            if CUDA_SYNC_WARNING in str(w.message):
                self.total += 1
                self.by_site[f"{Path(w.filename).name}:{w.lineno}"] += 1
            else:
                others.append(w)
        return others


@contextlib.contextmanager
def count_cuda_syncs(get_mode=None, set_mode=None):
    """CUDA's own count of the synchronising calls inside the block (torch.cuda.set_sync_debug_mode("warn"), its
    warnings caught and counted, every one: the filter is "always"); yields the `CudaSyncs` counter, filled when
    the block ends. The mode is restored after, and warnings of other kinds are issued again. `get_mode` and
    `set_mode` default to torch.cuda's (a test passes its own)."""
    import warnings
    get_mode = get_mode or torch.cuda.get_sync_debug_mode
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    counter = CudaSyncs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = get_mode()
        set_mode("warn")
        try:
            yield counter
        finally:
            set_mode(before)
    for w in counter.add(caught):
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
