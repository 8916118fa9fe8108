"""The device a command computes on (`--device`) and how it computes float32 there (`--deterministic`, `--tf32`).

`--device` is checked before anything is built. `auto` is CUDA where available, else the CPU. An explicit
device must exist on this machine: `cuda:3` on a host with two GPUs, `mps` away from Apple's GPU or `cuda`
without one is refused in one line naming the flag (a `DeviceError`, which the commands turn into exit status
2), not a traceback at the first tensor moved there.

Under torchrun every process trains on its own GPU: an unindexed CUDA device (`--device cuda` or `auto`) becomes
cuda:LOCAL_RANK, and an explicit index other than LOCAL_RANK (every rank on `cuda:0`) is refused.

`--deterministic` makes repeated CUDA runs give the same bits: `torch.use_deterministic_algorithms(True)` (an op
with only a nondeterministic CUDA kernel raises instead of running; phase two's `index_add_`, whose CUDA kernel
adds with atomics in whatever order the threads arrive, switches to its deterministic kernel),
`CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS's own reductions in a fixed order; set before the first cuBLAS call,
so before any model runs), `torch.backends.cudnn.deterministic = True` and `benchmark = False` (the same cuDNN
algorithm every run). The CPU is deterministic without it; on a GPU it costs some speed.

`--tf32` lets CUDA float32 matmuls and cuDNN convolutions run on TF32 tensor cores (Ampere on): faster, with a
10-bit mantissa (~1e-3 relative rounding per product), so a search score and its phase-two log-probability agree
only to that. Off (the default), both run in full float32 (`torch.set_float32_matmul_precision("highest")`,
`torch.backends.cudnn.allow_tf32 = False`). Neither flag changes the CPU's arithmetic.
"""
from __future__ import annotations

import os

import torch

from ..errors import OneLineError

CUBLAS_WORKSPACES = (":4096:8", ":16:8")  # the settings under which cuBLAS is deterministic
KINDS = ("cpu", "cuda", "mps")  # what twophase runs on (the flag's help names them)


class DeviceError(OneLineError, ValueError):
    """A --device this machine (or this torchrun process) cannot compute on: one line naming the flag."""


def pick(name: str, flag: str = "--device") -> torch.device:
    """The device `name` names (cpu, cuda, cuda:N, mps or auto), refused unless it is there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"{flag}: unknown device {name!r} (cpu, cuda, cuda:N, mps or auto)") from None
    if device.type not in KINDS:
        raise DeviceError(f"{flag} {name}: twophase runs on {', '.join(KINDS)}, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{flag} {name}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"{flag} {name}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                              f"(cuda:0 to cuda:{count - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{flag} {name}: MPS (Apple's GPU) is not available on this machine")
    return device


def for_rank(device: torch.device, flag: str = "--device") -> torch.device:
    """This process's device: under torchrun (WORLD_SIZE > 1) an unindexed CUDA device becomes cuda:LOCAL_RANK;
    an explicit index other than LOCAL_RANK would put two processes on one GPU, and is refused."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.index is not None and device.index != local:
        raise DeviceError(f"{flag} {device} under torchrun: this process (LOCAL_RANK {local}) trains on its own "
                          f"GPU, cuda:{local}; pass {flag} cuda and each process takes cuda:LOCAL_RANK")
    count = torch.cuda.device_count()
    if local >= count:
        raise DeviceError(f"{flag} {device} under torchrun: LOCAL_RANK {local}, but this machine has {count} CUDA "
                          f"device{'s' if count != 1 else ''}; start at most {count} processes per machine")
    return torch.device("cuda", local)


def configure(deterministic: bool, tf32: bool) -> None:
    """Set the process's float32 and determinism modes; ValueError (naming the flag) for a CUBLAS_WORKSPACE_CONFIG
    that cuBLAS cannot be deterministic with."""
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    if not deterministic:
        return
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACES[0])
    if workspace not in CUBLAS_WORKSPACES:
        raise ValueError(f"--deterministic: CUBLAS_WORKSPACE_CONFIG={workspace} leaves cuBLAS nondeterministic; "
                         f"unset it or use {' or '.join(CUBLAS_WORKSPACES)}")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
