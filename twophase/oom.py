"""Out of memory on an accelerator: which errors mean it, and handing the freed memory back.

PyTorch raises `torch.cuda.OutOfMemoryError` when its caching allocator cannot find a block, but a library that
allocates on its own reports the same shortage as a plain RuntimeError: cuBLAS's workspace
("CUBLAS_STATUS_ALLOC_FAILED"), cuDNN's ("CUDNN_STATUS_ALLOC_FAILED"), a kernel launch's "CUDA error: out of
memory". `is_out_of_memory` counts them all, so phase two's chunk halving and the trainer's batch skip see them.

The failed attempt's tensors are referenced by the exception's traceback (its frames' locals) for as long as the
`except` block runs: `release` is to be called after leaving it, when they are garbage, never inside it.
"""
from __future__ import annotations

import gc

import torch

MESSAGES = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
            "CUDA error: out of memory")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is a device allocation failure, whichever library reported it."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in MESSAGES)


def release() -> None:
    """Collect what the failed attempt left in reference cycles, then return the allocator's cached blocks to the
    device (a no-op where CUDA was never initialised). Call it outside the `except` block."""
    gc.collect()
    torch.cuda.empty_cache()
