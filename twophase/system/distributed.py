"""Data-parallel training under torchrun: every process takes a share of each global batch, gradients are summed.

Launched by `torchrun --nproc_per_node N train.py ...`, each process (rank r of W) draws the same global batch of
B sources from the same seeded BatchSampler and works on its own contiguous share (`shard`); every candidate of a
source stays on the rank of its source, so the per-source objectives need no communication. Objectives are
normalised by the *global* B, so the per-rank gradients add up to exactly the single-process gradient.

Why one explicit all-reduce and not DistributedDataParallel: phase two (`rescore_backward`) calls
`model.encode` / `model.score` directly and runs one backward per chunk plus one for the encoder. DDP's reducer
hooks into `forward()` and expects one backward per forward; it would not see these backwards properly (or would
communicate once per chunk). Instead, after phase two has accumulated the whole local gradient in `.grad`,
`all_reduce_grads` sums every gradient over ranks once per optimizer step, in buckets of bounded size (in place
for a large gradient, through one small flat buffer for several small ones: no copy of every gradient), so the
chunk size never changes the amount of communication. Clipping and the non-finite-skip decision come after
it, on identical numbers, so every rank takes the same decision and the parameters stay identical.

Without torchrun (no WORLD_SIZE > 1 in the environment) nothing here creates a process group: every helper
falls back to the single-process answer (rank 0 of 1, reductions are the identity).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

_device: torch.device | None = None  # where collectives put their tensors: CPU for gloo, this rank's GPU for NCCL


def launched() -> bool:
    """True in a process started by torchrun with more than one process in all."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def init(device: torch.device, timeout_minutes: float = 30.0) -> None:
    """Join the process group torchrun describes (NCCL for CUDA, gloo otherwise); a no-op without torchrun."""
    global _device
    if not launched() or active():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and all_gather_object use the current device
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
    _device = device if device.type == "cuda" else torch.device("cpu")


def finish() -> None:
    global _device
    if active():
        dist.destroy_process_group()
    _device = None


def shard(indices: list, rank_: int | None = None, world_: int | None = None) -> list:
    """This rank's contiguous share of a global batch: an even split, the remainder going to the first ranks.

    The shares of ranks 0..W-1 concatenated give back `indices`; a batch smaller than W leaves some shares empty.
    """
    r = rank() if rank_ is None else rank_
    w = world() if world_ is None else world_
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in a world of {w}")
    size, extra = divmod(len(indices), w)
    start = r * size + min(r, extra)
    return indices[start:start + size + (r < extra)]


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers everywhere: the same seed already gives the same initialisation, this makes
    sure of it (a different torch build or device on one node would otherwise drift silently)."""
    if not active():
        return
    for tensor in module.state_dict().values():
        dist.broadcast(tensor, src=0)


# Gradients travel in buckets of at most this many bytes: a bucket of several small gradients is flattened into one
# buffer (the only copy made), a gradient at least this large is reduced in place in its own .grad.
BUCKET_BYTES = 25 * 2**20


def all_reduce_grads(params: list[Tensor], bucket_bytes: int | None = None) -> None:
    """Sum .grad of `params` over all ranks, in place, in buckets: the extra memory is one bucket's flat buffer
    (at most `bucket_bytes`, default BUCKET_BYTES), never a copy of every gradient.

    A rank whose share had nothing to back-propagate (every coefficient zero) has .grad None; it contributes zeros.
    A flag per parameter goes first in a small all-reduce of its own, so a parameter that no rank gave a gradient
    keeps .grad None, exactly as in a single process (Adam treats None and zero differently).
    """
    params = [p for p in params if p.requires_grad]
    if not active() or not params:
        return
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    flags = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(flags)
    present = []
    for p, has_grad in zip(params, flags.tolist()):
        if has_grad > 0:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            present.append(p)
        else:
            p.grad = None
    bucket, size = [], 0
    for p in present:
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and (size + nbytes > bucket_bytes or p.grad.dtype != bucket[0].grad.dtype):
            _reduce_bucket(bucket)
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(bucket: list) -> None:
    """All-reduce the .grad of the bucket's parameters (one dtype): in place for one contiguous gradient,
    through one flat buffer for several."""
    if len(bucket) == 1 and bucket[0].grad.is_contiguous():
        dist.all_reduce(bucket[0].grad)  # the model's device is the collective's device (cuda:LOCAL_RANK or CPU)
        return
    flat = torch.cat([p.grad.reshape(-1) for p in bucket])
    dist.all_reduce(flat)
    offset = 0
    for p in bucket:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def reduce_sums(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over ranks (float64, one all-reduce); the identity in a single process."""
    if not active():
        return {k: float(v) for k, v in values.items()}
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=_device)
    dist.all_reduce(t)
    return dict(zip(values, t.tolist()))


def reduce_max(value: float) -> float:
    if not active():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def agree_to_stop(signum: int | None) -> int | None:
    """The signal that stops the run, if any rank received one: every rank gets every signal under torchrun, but
    not necessarily before the same step, so without agreement one rank would wait forever in a collective."""
    if not active():
        return signum
    t = torch.tensor([signum or 0], dtype=torch.int64, device=_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) or None


def gather_objects(obj) -> list:
    """[rank 0's obj, rank 1's obj, ...] on every rank (picklable objects); [obj] in a single process."""
    if not active():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out
