"""How large a block of temporaries may be on a device.

Phase one's candidate scores, the output layer's logits and the attention's tanh are built a block of rows at a
time so that no (N, V) or (N, S, A) tensor exists at once. The right block depends on the device: on a CPU a
block that stays in cache wins (8 MiB, measured at Karel's and G2P's sizes); on an accelerator every block is a
round of kernel launches, so blocks are made larger until the launches are a small part of the work, yet still
a small part of its memory.
"""
from __future__ import annotations

import torch

CPU_BLOCK_BYTES = 8 * 2**20
ACCELERATOR_BLOCK_BYTES = 128 * 2**20


def block_bytes(device: torch.device | str, cpu_bytes: int = CPU_BLOCK_BYTES) -> int:
    """Bytes of one block on `device`: `cpu_bytes` on the CPU (a module's own setting, which tests shrink to
    force many blocks), at least ACCELERATOR_BLOCK_BYTES elsewhere."""
    if torch.device(device).type == "cpu":
        return cpu_bytes
    return max(cpu_bytes, ACCELERATOR_BLOCK_BYTES)
