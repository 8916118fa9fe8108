"""How a run computes float32 on CUDA: `--deterministic` and `--tf32`.

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

CUBLAS_WORKSPACES = (":4096:8", ":16:8")  # the settings under which cuBLAS is deterministic


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
