"""Measure --fsdp against DDP-style training: per-process training state, tensor peak and time of an RL step.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.fsdp                # DDP-style (every rank whole)
    torchrun --standalone --nproc_per_node 2 -m benchmarks.fsdp --fsdp         # FSDP2 shards
    ... --config width=256 layers=4 vocab=8000 batch=4 samples=4 prompt=32 completion=16 chunk=4

A step is the trainer's: each process samples K completions for its share of the B prompts (the Llama-style
causal LM of `benchmarks.hf`, random weights), REINFORCE coefficients normalised by the global B,
`rescore_backward` in chunks of C rows, the gradient summed over processes (DDP-style: the whole gradient
all-reduced in place, in buckets; FSDP: inside `fsdp.gathered`, each process keeping its slice), global-norm clipping, Adam.
Reported by rank 0 for each process: `state` = bytes of the parameters and Adam's moments it holds between steps,
`peak` = that plus the peak of bytes held by tensors during a step above it (`memory.AllocationPeak`, on a step
after the first, whose Adam moments already exist), and the median wall seconds of the timed steps.
`--reference`: a frozen copy of the model (--objective policy's --kl-beta reference: whole under DDP, sharded
alike under FSDP, `fsdp.copy_model`) also scores the samples per token in chunks of C rows, no graph, between
phase one and phase two, each on its own gathered copy under FSDP, as a step that starts a policy generation
does; its parameters count in `state`.

Letters: B prompts per step (all processes), K samples per prompt, C rows per chunk, W processes.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time

import torch

from twophase.phase2.rescoring import rescore_backward
from twophase.phase1.search import sample
from twophase.system import distributed, fsdp
from twophase.system.memory import AllocationPeak
from twophase.train.klreference import Reference
from .hf import DEFAULTS, build, coefficients

SMALL = dict(DEFAULTS, batch=4, samples=4, prompt=32, completion=16, chunk=4, steps=2, model="causal",
             method="two-phase")


def held_bytes(model, optimizer) -> int:
    """Bytes of this process's parameters (its shards under FSDP) and optimizer state."""
    local = [fsdp.local(p) for p in model.parameters()]
    local += [fsdp.local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in local)


def step(cell: dict, model, optimizer, source: dict, seed: int, reference=None) -> None:
    """One RL step on this process's share of the B prompts (see the module docstring)."""
    B, K, T = cell["batch"], cell["samples"], cell["completion"]
    mine = distributed.shard(list(range(B)))
    share = {k: v[mine[0]:mine[-1] + 1] for k, v in source.items()}  # (B/W, P)
    optimizer.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(seed + distributed.rank())
    if reference is not None:  # as PolicyStep: phase one, the reference's pass, phase two, one gathered copy each
        with fsdp.gathered(model):
            samples = sample(model, share, K, T, generator=g)
        # the reference's pass of PolicyStep itself: gathered, no graph, chunks of C rows as --rescore-chunk C
        Reference("copy", reference).log_probs(model, share, samples, cell["chunk"], contextlib.nullcontext)
    with fsdp.gathered(model, reduce=True):
        if reference is None:
            samples = sample(model, share, K, T, generator=g)
        c = coefficients(samples, B, seed)  # normalised by the global B
        rescore_backward(model, share, samples, c, cell["chunk"])
    if not fsdp.is_sharded(model):
        distributed.all_reduce_grads(list(model.parameters()))
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    optimizer.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fsdp", description=__doc__.split("\n")[0])
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (twophase.system.fsdp)")
    p.add_argument("--reference", action="store_true", help="also score with a frozen copy of the model "
                   "(--kl-beta's reference)")
    p.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE", help="override a setting of SMALL")
    args = p.parse_args(argv)
    cell = dict(SMALL, **{k: int(v) for k, v in (kv.split("=", 1) for kv in args.config)})
    torch.set_num_threads(cell["threads"])
    distributed.init(torch.device("cpu"))
    try:
        model, source = build(cell)
        if args.fsdp:
            fsdp.shard_model(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        reference = None
        if args.reference:
            reference = fsdp.copy_model(model, lambda: build(cell)[0]).eval().requires_grad_(False)
        run = functools.partial(step, cell, model, optimizer, source, reference=reference)  # run(seed)
        run(0)  # warm-up: Adam's moments exist from here on
        seconds = []
        for i in range(cell["steps"]):
            start = time.perf_counter()
            run(i + 1)
            seconds.append(time.perf_counter() - start)
        optimizer.zero_grad(set_to_none=True)  # freed before the window: it records no frees of older tensors
        state = held_bytes(model, optimizer)
        if reference is not None:
            state += sum(fsdp.local(p).numel() * fsdp.local(p).element_size() for p in reference.parameters())
        with AllocationPeak() as peak:
            run(99)
        rows = distributed.gather_objects({"rank": distributed.rank(), "state_mb": state / 2**20,
                                           "peak_mb": (state + peak.peak_bytes) / 2**20,
                                           "step_s": statistics.median(seconds)})
        if distributed.rank() == 0:
            params = sum(p.numel() for p in model.parameters())
            print(json.dumps({"mode": "fsdp" if args.fsdp else "ddp", "reference": args.reference,
                              "processes": distributed.world(),
                              "parameters": params, "cell": cell, "ranks": rows}))
    finally:
        distributed.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
