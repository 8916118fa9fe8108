"""The process's memory peaks: what the device can tell, per section and for the whole run.

- CUDA: the caching allocator's peaks, `allocated` (bytes held by tensors) and `reserved` (bytes the allocator
  took from the device, cached blocks included: what runs out first and raises an out-of-memory error);
- CPU: the process's resident set (RSS), its high-water mark from the kernel (the CPU keeps no record of tensor
  bytes short of the slow allocation profiler, `memstats.AllocationPeak`).

`--profile-memory` gives every section of a step its own peak by resetting these high-water marks (`reset`); each
reset first folds the peak so far into the run's overall peak, so `overall` is the whole process's peak whatever
was reset, which the closing table reports.
"""
from __future__ import annotations

import resource

import torch

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
