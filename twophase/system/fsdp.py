"""Sharded data-parallel training (`--fsdp`): PyTorch FSDP2's `fully_shard`, exact with the chunked phase two;
and what a checkpoint holds of a model (`saved_state`, `load_saved`), sharded or not.

Under torchrun with DDP-style training (`distributed`) every process holds the whole model, its gradients and
Adam's two moments. With `shard_model` each process keeps only its 1/W share of every parameter (a DTensor,
Shard(0)), and the optimizer, built on those shards, keeps only its share of Adam's moments.

A step runs on gathered parameters, inside `gathered(model, reduce=True)`:
  - on entry, ONE all-gather (FSDP2's `unshard()`) gives every process the whole parameters, as plain tensors
    registered on the model: phase one searches with them (no re-gathering at every decoding step), phase two
    decodes its chunks and back-propagates through them, the encoder-boundary backward and the by-hand output
    layers (`weighted_tree_backward` writes into `.grad`) included, exactly as in one process;
  - every chunk's gradient accumulates, unreduced, into the gathered parameters' `.grad` (the deferred
    reduction FSDP2's `set_requires_gradient_sync(False)` would give);
  - on exit, a fixed number of all-reduces of flat buffers (8 buckets; DDP-style training's
    `distributed.all_reduce_grads` reduces in bounded buckets in place) sums the step's gradient over the processes; each keeps its own Shard(0)
    slice as the DTensor `.grad` of its shard, and `reshard()` frees the gathered copy.
So the step's gradient is the one-process gradient of the same global batch whatever the chunking, the
communication is one gather and one (bucketed) reduction per step, and clipping (`clip_grad_norm_` on the
DTensor grads: the global norm over shards) and the non-finite skip see identical numbers on every process.

Why not FSDP2's own forward hooks: twophase calls `encode` / `step` / `score` (and by-hand backward paths), not
`forward`, and runs many backwards per step; the hooks would gather and free at every decoding step. The cost:
during a step each process holds one gathered copy of the parameters and their whole gradient (as DDP does);
between steps, and for Adam's moments always, 1/W. Every model is therefore sharded as one unit.

A wrapper that is itself a `SequenceModel` (`--grammar on`'s `Constrained`) wraps the sharded model: it is the
sharded model, not the wrapper, that `fully_shard` turns into an FSDP module, so the wrapper's state_dict (the
model's) is a plain run's. Every function here takes either and finds the sharded module (`sharded_root`).
A frozen copy (`copy_model`: --objective policy's KL reference) is sharded too, and gathered for its own
scoring pass only; so is --objective distill's teacher (`shard_model` once loaded), gathered for the step's phase
two.

Checkpoints hold whole tensors (`full_model_state`, `full_optimizer_state`: collectives, every process calls
them), in a single process's layout: a plain run, `twophase-decode` and `--resume` on the same number of
processes all load them; `hf_final` is written once, by rank 0, from a plain copy.

What a checkpoint holds of a model (`saved_state`): every entry of its state_dict, or, where some parameters are
frozen (LoRA adapters on a `--hf-model`, `--lora-r`), only the trainable parameters: the frozen rest is the
--hf-model folder's, which the task loads again, and a checkpoint stays the adapters' size.

Letters: W processes, r this process's rank, P parameter elements.
"""
from __future__ import annotations

import contextlib
import copy
import sys

import torch

from . import distributed


# ------------------------------------------------------------------ what a checkpoint holds of a model
def saved_state(model: torch.nn.Module) -> dict:
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = model.state_dict()
    if len(trainable) == sum(1 for _ in model.parameters()):
        return state
    return {k: v for k, v in state.items() if k in trainable}


def load_saved(model: torch.nn.Module, state: dict) -> None:
    """model.load_state_dict(state), strict about every trainable parameter; a checkpoint of trainable parameters
    alone leaves the frozen ones (and buffers) as the model was built. RuntimeError as load_state_dict's."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(model.state_dict()) == set(state) or not trainable:
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    lost = sorted(trainable & set(missing))
    if lost or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict: missing trainable {lost[:3]}, unexpected "
                           f"{sorted(unexpected)[:3]}")


def first_difference(trained: dict, reloaded: dict, kind: str = "parameter") -> str | None:
    """How an export read back differs from the model it was written from, {name: tensor} each (the model's
    named_parameters, or its state_dict's tensors: `kind` names them), compared exactly on the host one at a time:
    one line naming the first entry missing, of another shape or another value (with how many differ), or None
    where every one is the model's."""
    wrong = []
    with torch.no_grad():
        for name, p in trained.items():
            r = reloaded.get(name)
            if r is None:
                wrong.append(f"its {kind} {name} is missing")
            elif r.shape != p.shape:
                wrong.append(f"its {kind} {name} has shape {tuple(r.shape)}, not the trained model's "
                             f"{tuple(p.shape)}")
            else:
                here, there = p.detach().to("cpu", r.dtype), r.detach().cpu()
                if not torch.equal(here, there):
                    gap = (here.double() - there.double()).abs().max().item()
                    wrong.append(f"its {kind} {name} differs from the trained model's (by up to {gap:.3g})")
    if not wrong:
        return None
    return wrong[0] + ("" if len(wrong) == 1 else f"; {len(wrong)} of {len(trained)} {kind}s differ")


# ------------------------------------------------------------------ sharding
def _loaded(module: str, name: str):
    """`module.name` if the module is imported, else None. torch.distributed.fsdp and .tensor are slow to
    import (much of train.py's start-up): they are imported by `shard_model` alone, and where they are not
    loaded no sharded module or DTensor exists for the tests below to find."""
    found = sys.modules.get(module)
    return None if found is None else getattr(found, name)


def _is_dtensor(t) -> bool:
    DTensor = _loaded("torch.distributed.tensor", "DTensor")
    return DTensor is not None and isinstance(t, DTensor)


def check(cfg) -> None:
    """--fsdp's refusals (ValueError, one line): it needs torchrun's processes, and some flags do not shard."""
    if not cfg.fsdp:
        return
    if not distributed.launched():
        raise ValueError("--fsdp shards the model over the processes torchrun starts (torchrun --nproc_per_node N "
                         "train.py --fsdp ...): one process has nothing to shard over; drop --fsdp")
    if cfg.amp == "fp16":
        raise ValueError("--fsdp with --amp fp16: the loss scaler does not unscale sharded gradients; --amp bf16 "
                         "needs no scaler")
    if cfg.lora_r and cfg.objective == "policy" and cfg.kl_beta != 0:
        raise ValueError("--fsdp with --lora-r and --kl-beta: not supported (the LoRA reference scores the sharded "
                         "model with its adapters disabled or swapped); use DDP (plain torchrun)")
    if cfg.export == "best":
        raise ValueError("--fsdp with --export best: not supported; checkpoint_best.pt holds the whole model "
                         "(twophase-decode reads it)")
    if cfg.eval_only:
        raise ValueError("--eval-only trains nothing: run it without --fsdp")


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """`fully_shard(model)` over all processes (one unit: see the module docstring); returns the model, whose
    parameters are now this process's shards. Build the optimizer after this, on `model.parameters()`."""
    if not distributed.active():
        raise ValueError("--fsdp shards the model over the processes torchrun starts (torchrun "
                         "--nproc_per_node N train.py --fsdp ...); one process has nothing to shard over")
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, reshard_after_forward=False)
    model._twophase_gathers = 0  # nesting depth of gathered()
    return model


def sharded_root(model):
    """The outermost `fully_shard`ed module in `model` (itself, or the model a wrapper such as `Constrained`
    holds), or None."""
    FSDPModule = _loaded("torch.distributed.fsdp", "FSDPModule")
    if FSDPModule is None:
        return None
    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


def is_sharded(model) -> bool:
    return sharded_root(model) is not None


def copy_model(model, build):
    """A copy of `model` (reference models: --kl-beta's). Plain: `copy.deepcopy`. Sharded (FSDP2 refuses
    deepcopy): `build()` (the task's fresh model, built without touching the random streams) sharded alike, each
    process's shards copied into it (no communication); a wrapper around the sharded model is deep-copied around
    the new one. Per process it then holds 1/W of the parameters (and a whole copy, as at startup, while built)."""
    root = sharded_root(model)
    if root is None:
        return copy.deepcopy(model)
    if root._twophase_gathers:
        raise RuntimeError("copy_model inside gathered(): the shards are what is copied")
    device = next(root.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        fresh = shard_model(build().to(device))
    mine, theirs = dict(root.named_parameters()), dict(fresh.named_parameters())
    if mine.keys() != theirs.keys():
        raise RuntimeError(f"copy_model: the rebuilt model's parameters differ ({sorted(mine.keys() ^ theirs.keys())[:3]})")
    with torch.no_grad():
        for name, p in mine.items():
            local(theirs[name]).copy_(local(p))
            theirs[name].requires_grad_(p.requires_grad)
        buffers = dict(fresh.named_buffers())
        for name, b in root.named_buffers():
            buffers[name].copy_(b)  # buffers stay whole on every process
    return fresh if root is model else copy.deepcopy(model, {id(root): fresh})


@contextlib.contextmanager
def gathered(model, reduce: bool = False):
    """Whole parameters on the model inside (a no-op for a model not sharded); nested calls gather once.

    reduce: on leaving the outermost one, the gathered parameters' .grad are summed over the processes and each
    process's slice becomes its shard's .grad (added to what it held). Without, gradients are dropped. Every
    process must enter and leave together (these are collectives); after an exception nothing is reduced."""
    wrapper, model = model, sharded_root(model)
    if model is None:
        yield wrapper
        return
    depth = model._twophase_gathers
    model._twophase_gathers = depth + 1
    if depth == 0:
        model.unshard()
    ok = False
    try:
        yield wrapper
        ok = True
    finally:
        model._twophase_gathers = depth
        if depth == 0:
            grads = _sum_gathered_grads(model) if reduce and ok else {}
            for p in model.parameters():
                p.grad = None
            model.reshard()
            _set_shard_grads(model, grads)


def _sum_gathered_grads(model, buckets: int = 8) -> dict:
    """{name: this process's Shard(0) slice of the summed gradient} of the gathered parameters (absent where no
    process had one, as .grad None in a single process: a flag per parameter travels along).

    The parameters are reduced in `buckets` all-reduces of a flat buffer each (a fixed number per step, whatever
    the chunking), and each gathered gradient is freed once copied in, and each summed one once its slice is
    kept: the reduction adds about 1/buckets of a whole gradient to the step's peak, not a second copy."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in named)
    out, bucket, size = {}, [], 0
    for i, (name, p) in enumerate(named):
        bucket.append((name, p))
        size += p.numel()
        if size * buckets >= total or i == len(named) - 1:
            out.update(_reduce_bucket(bucket))
            bucket, size = [], 0
    return out


def _reduce_bucket(named: list) -> dict:
    dtype, device, sizes = named[0][1].dtype, named[0][1].device, [p.numel() for _, p in named]
    flat = torch.zeros(sum(sizes) + len(named), dtype=dtype, device=device)  # (bucket's P + its parameters,)
    offset = 0
    for i, ((_, p), n) in enumerate(zip(named, sizes)):
        if p.grad is not None:
            flat[offset:offset + n] = p.grad.reshape(-1)
            flat[sum(sizes) + i] = 1
            p.grad = None
        offset += n
    torch.distributed.all_reduce(flat)
    out, offset, present = {}, 0, flat[sum(sizes):].tolist()
    W, r = distributed.world(), distributed.rank()
    for (name, p), n, has in zip(named, sizes, present):
        if has > 0:
            whole_grad = flat[offset:offset + n].view(p.shape)
            chunks = list(torch.chunk(whole_grad, W, dim=0))  # Shard(0)'s split: torch.chunk, empty past the end
            chunks += [whole_grad.new_empty((0, *p.shape[1:]))] * (W - len(chunks))
            out[name] = chunks[r].to(p.dtype, copy=True)  # its own memory: the bucket is freed
        offset += n
    return out


def _set_shard_grads(model, grads: dict) -> None:
    """Each kept slice becomes the .grad (a DTensor placed as its shard) of this process's shard."""
    from torch.distributed.tensor import DTensor
    for name, shard in model.named_parameters():
        local = grads.get(name)
        if local is None:
            continue
        if local.shape != shard.to_local().shape:
            raise RuntimeError(f"{name}: gradient slice {tuple(local.shape)} != shard {tuple(shard.to_local().shape)}")
        mine = DTensor.from_local(local, shard.device_mesh, shard.placements, shape=shard.shape,
                                  stride=shard.stride())
        shard.grad = mine if shard.grad is None else shard.grad + mine


def whole(t):
    """A DTensor's whole value (a collective), anything else as it is."""
    return t.full_tensor() if _is_dtensor(t) else t


def full_model_state(model) -> dict:
    """What a single process's checkpoint holds of the model (`saved_state`), with whole tensors."""
    return {k: whole(v) for k, v in saved_state(model).items()}


def full_optimizer_state(optimizer) -> dict:
    """optimizer.state_dict() with every sharded state tensor (Adam's moments) whole: a single process's."""
    state = optimizer.state_dict()
    return {**state, "state": {i: {k: whole(v) for k, v in s.items()} for i, s in state["state"].items()}}


def plain_copy(model, build):
    """On rank 0, a model from `build()` holding `model`'s whole parameters (hf_final's export: FSDP2 reshards
    on every state_dict(), so save_pretrained cannot run on the gathered model); None elsewhere. A collective."""
    state = full_model_state(model)
    if distributed.rank() != 0:
        return None
    device = next(model.parameters()).device
    plain = build().to(device)
    load_saved(plain, state)
    return plain


def _like(full: torch.Tensor, shard):
    """`full` distributed as `shard` is (this process's slice, no communication), or as it is."""
    if not _is_dtensor(shard) or not isinstance(full, torch.Tensor) or _is_dtensor(full) \
            or full.shape != shard.shape:
        return full  # not sharded, or already a shard (an in-memory snapshot)
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full.to(shard.device, shard.dtype), shard.device_mesh, shard.placements,
                             src_data_rank=None)


def load_model_state(model, state: dict) -> None:
    """`load_saved` of a checkpoint's whole tensors into the shards (every process has read the file)."""
    current = model.state_dict()
    load_saved(model, {k: _like(v, current[k]) if k in current else v for k, v in state.items()})


def load_optimizer_state(optimizer, state: dict) -> None:
    """A single process's optimizer state dict into an optimizer over shards: each state tensor sliced as its
    parameter (param_groups' order = optimizer.state_dict()'s parameter indices)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sliced = {i: {k: _like(v, params[int(i)]) for k, v in s.items()} for i, s in state["state"].items()}
    optimizer.load_state_dict({**state, "state": sliced})


def local(t):
    """This process's own part of a tensor: a DTensor's local shard, anything else whole."""
    return t.to_local() if _is_dtensor(t) else t


def load_model(model, state: dict) -> None:
    """`load_saved`, into the shards where the model is sharded (a file's whole tensors or a snapshot's
    shards)."""
    (load_model_state if is_sharded(model) else load_saved)(model, state)


def load_optimizer(model, optimizer, state: dict) -> None:
    if is_sharded(model):
        load_optimizer_state(optimizer, state)
    else:
        optimizer.load_state_dict(state)
