"""The parts every training step uses, as plain data (`Parts`), and the plain functions that serve every step.

Each step family (`steps.mle`, `steps.sequence`, `steps.policy`, `steps.distill`) is given the parts and the
sections of the configuration it reads, and calls these functions, each given the one section it reads (phase
one's `SearchConfig`, phase two's `PhaseTwoConfig`, the update's `StepConfig`); none of them is given its owner or
the whole Config. The functions, in the algorithm's order:
    rollout    - `sources` (the batch as the model reads it), `search` (phase one: K candidates per source, no
                 graph) and `rewards_of` (every candidate scored against the references of its source);
    phase two  - `phase_two`: rescore_backward, chunked teacher-forced re-decoding, the exact gradient of
                 sum_i c_i log p_i (with fp16 the coefficients carry the loss scale);
    update     - `update`: the gradients summed over processes, clipped, and the optimizer's step (or a skip).
`Gradient` is phase one and phase two as one value (`PHASE_TWO`): a step's search and backward, which a benchmark
may replace with a baseline's (`benchmarks.baselines`). A step's parts (phase one, rewards, phase two, the
update) are `section`s, reported to the parts' `profiler` where one is set (--profile-memory's, or a benchmark's
timer, `benchmarks.steptimes`). Letters: B sources per step, K candidates per source, N rows, T length.
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...config import Config, PhaseTwoConfig, SearchConfig, StepConfig, parse_size
from ...phase1.sbs import stochastic_beam_search
from ...phase1.search import beam_search, sample
from ...phase2.rescoring import rescore_backward
from ...rewards.calls import completion_ids, score
from ...samples import Samples
from ...system import amp, distributed, fsdp
from ...system.profiling import ChunkPlanner
from ...tasks.base import Example, Task
from ...tasks.data import BatchSampler
from ...vocab import pad_targets
from ..report import RewardLog


@dataclass
class Parts:
    """What a step runs on: the model and its optimizer, fp16's scaler (None otherwise) and --amp's autocast (every
    model run of a training step; validation runs in full precision), the device, the task and its training
    targets, the reward and its log, both phases' batch samplers, the sampling generator, Task.present's stream and
    --rescore-chunk auto's planner, --objective distill's frozen teacher (`train.teacher.load`; None otherwise);
    then what the current step records (set by `start`)."""

    task: Task
    model: Any
    reward: Any
    device: torch.device
    optimizer: torch.optim.Optimizer
    scaler: Any
    autocast: Callable
    ref_ids: list  # per training example: its references' target ids, no EOS
    pairs: list  # (example, reference) index pairs: the MLE step's data
    mle_batches: BatchSampler | None  # None without references (prompt-only data trains RL alone)
    rl_batches: BatchSampler
    sampling: torch.Generator
    presenting: random.Random
    chunk_planner: ChunkPlanner | None
    reward_log: RewardLog
    teacher: Any = None
    last_chunk: Any = None  # the chunk size phase two last used (--rescore-chunk auto: the planner's)
    # What the step's sections report to: profiler.section(name, part) -> a context manager (--profile-memory's
    # `StepProfiler` for a profiled step, a benchmark's timer; None: nothing). Also phase two's, for its chunks.
    profiler: Any = None
    # The current step's: its number (1-based, for messages), learning rate, phase two's counts (decoded
    # prefix-tree nodes, candidate positions), the update's outcome.
    number: int = 1
    lr: float = 0.0
    counts: dict = field(default_factory=dict)
    outcome: str | None = None

    @classmethod
    def build(cls, cfg: Config, task: Task, model, reward, device: torch.device, teacher=None) -> "Parts":
        ref_ids = [task.target_ids(ex) for ex in task.train]  # (source, reference) -> target ids, no EOS
        pairs = [(i, j) for i, refs in enumerate(ref_ids) for j in range(len(refs))]
        return cls(
            task=task, model=model, reward=reward, device=device,
            optimizer=torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr),  # LoRA: adapters
            scaler=amp.grad_scaler(cfg.amp, device), autocast=functools.partial(amp.autocast, cfg.amp, device),
            ref_ids=ref_ids, pairs=pairs,
            mle_batches=BatchSampler(len(pairs), cfg.mle_batch_size, cfg.seed) if pairs else None,
            rl_batches=BatchSampler(len(task.train), cfg.batch_size, cfg.seed + 1),
            # Each process samples candidates for its own sources, from its own stream (rank 0's is a single
            # process's); Task.present's draws are one stream, the same on every process.
            sampling=torch.Generator(device=device).manual_seed(cfg.seed + 1000 * distributed.rank()),
            presenting=random.Random(f"present {cfg.seed}"),
            chunk_planner=ChunkPlanner(parse_size(cfg.memory_budget)) if cfg.rescore_chunk == "auto" else None,
            reward_log=RewardLog(reward), teacher=teacher, last_chunk=cfg.rescore_chunk, lr=cfg.lr)

    def start(self, number: int, lr: float) -> None:
        """Before step `number`: its learning rate, fresh counts."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.number, self.lr, self.counts, self.outcome = number, lr, {}, None


# ------------------------------------------------------------------ sections
def section(p: Parts, name: str | None, part: str | None = None):
    """A section of the step, reported to the parts' profiler (a no-op without one): `name`, its --profile-memory
    section (None: none of its own), and `part`, the part of the step it belongs to (phase one, rewards,
    references, phase two, update; None: none)."""
    return p.profiler.section(name, part) if p.profiler is not None else contextlib.nullcontext()


# ------------------------------------------------------------------ rollout: sources, phase one, rewards
def sources(p: Parts, idx: list[int]):
    """The training examples idx as the model reads them, unpresented (--objective policy: its several updates
    of a generation must see one source, so Karel's shows all six pairs)."""
    return p.task.collate([p.task.train[i] for i in idx], p.device)


def presented(p: Parts, batch: list[int]) -> list[Example]:
    """This process's share of the global batch's training examples as this step shows them (Task.present: Karel
    draws 5 of 6 pairs): every process presents the whole global batch from the same stream, so the examples
    shown do not depend on the number of processes."""
    return distributed.shard(p.task.present([p.task.train[i] for i in batch], p.presenting))


def search(p: Parts, settings: SearchConfig, source) -> Samples:
    """Phase one without a graph: K candidates per source by --sampler (beam, sample, sbs)."""
    s = settings
    if s.sampler == "beam":
        return beam_search(p.model, source, s.beam_size, s.max_len)
    if s.sampler == "sbs":
        return stochastic_beam_search(p.model, source, s.beam_size, s.max_len, p.sampling)
    return sample(p.model, source, s.beam_size, s.max_len, s.temperature, p.sampling,
                  top_k=s.top_k or None, top_p=s.top_p if s.top_p < 1 else None, min_len=s.min_len)


def rewards_of(p: Parts, tokens: torch.Tensor, owner: list[int], examples: list[Example]) -> torch.Tensor:
    """(N,) float64 rewards of candidate rows tokens (N, T), row i from examples[owner[i]]: the reward called
    with the strings it sees (the task's detokenisation) and the examples' context (`rewards.calls.score`)."""
    hyps = [p.task.detokenize(row) for row in tokens.tolist()]
    ids = completion_ids(tokens, p.model.pad_id, p.model.eos_id)
    return torch.tensor(score(p.reward, hyps, [examples[o] for o in owner], ids), dtype=torch.float64,
                        device=p.device)


@dataclass
class Rollout:
    """One batch after phase one and its rewards: its size (`batch_size`, every process's), this process's share
    of it (`idx`, the examples as shown, the source), the candidates, what the gradient's backward needs of the
    search (phase two's: nothing), the (N,) rewards and, with several rewards, each one's values."""

    batch_size: int
    idx: list[int]
    examples: list[Example]
    source: object
    cand: Samples
    search: object
    rewards: torch.Tensor
    parts: dict | None


@dataclass(frozen=True)
class Gradient:
    """Phase one and the gradient as one value: `search(parts, search_settings, source) -> (candidates, what
    backward needs)` under the --profile-memory section `section`, and `backward(parts, phase_two_settings, source,
    rows, coef, that) -> loss` (`SearchConfig`, `PhaseTwoConfig`)."""

    section: str
    search: Callable
    backward: Callable


def rollout(p: Parts, settings: SearchConfig, batch: list[int], gradient: Gradient) -> Rollout:
    """Steps 1-2 of the algorithm on one global batch: this process's share of it, its candidates, their rewards."""
    idx = distributed.shard(batch)  # this process's share
    examples = presented(p, batch)
    source = p.task.collate(examples, p.device)
    p.model.eval()  # phase one and phase two must score with the same function: no dropout in either

    # 1. Phase one: K candidates per source and their log-probabilities (and what step 4 needs of the search).
    with section(p, gradient.section, "phase one"), p.autocast():
        cand, graph = gradient.search(p, settings, source)
    # 2. Rewards of every candidate against all references of its source (and what else the reward asks).
    with section(p, "rewards", "rewards"):
        rewards = rewards_of(p, cand.tokens, cand.owner.tolist(), examples)  # (N,)
        parts = getattr(p.reward, "last", None)  # several rewards: each one's values, for the log
    return Rollout(len(batch), idx, examples, source, cand, graph, rewards, parts)


def target_rows(p: Parts, ids: list[list[int]], owner: list[int]) -> Samples:
    """Target ids (no EOS) as rows in the model's layout (tokens, eos_id, pad_id), which no search scored."""
    pad, eos = p.model.pad_id, p.model.eos_id
    tgt = pad_targets(ids, p.device, pad, eos)  # (R, T)
    return Samples.of_targets(tgt, torch.tensor(owner, dtype=torch.long, device=p.device), pad, eos)


def reference_rows(p: Parts, idx: list[int]) -> Samples:
    """Every reference of the sources idx, row owner = the source's position in idx."""
    owner = [b for b, i in enumerate(idx) for _ in p.ref_ids[i]]
    return target_rows(p, [r for i in idx for r in p.ref_ids[i]], owner)  # (R, T)


# ------------------------------------------------------------------ phase two
def phase_two(p: Parts, settings: PhaseTwoConfig, source, rows: Samples, coef, keep_mode: bool = False,
              stats: dict | None = None, prefix_sharing: bool = True) -> float:
    """rescore_backward with the configured chunk size, or the largest within --memory-budget, under the autocast
    phase one ran in; with fp16 the coefficients carry the loss scale (the returned loss does not). prefix_sharing
    False: every row decoded from its first token (a benchmark's baseline, `benchmarks.baselines`)."""
    coef, scale = amp.scale_coefficients(coef, p.scaler)
    with section(p, None, "phase two"), p.autocast():  # its --profile-memory sections: rescore_backward's
        chunk = settings.rescore_chunk
        if chunk == "auto":
            chunk = p.chunk_planner.chunk_size(p.model, source, rows, coef)  # a teacher's states too
            p.last_chunk = chunk
        stats = {} if stats is None else stats
        loss = rescore_backward(p.model, source, rows, coef, chunk, profiler=p.profiler, keep_mode=keep_mode,
                                prefix_sharing=prefix_sharing, stats=stats)
        for key in ("positions", "nodes"):  # phase_two may run twice a step (a baseline's MLE rows)
            p.counts[key] = p.counts.get(key, 0) + stats.get(key, 0)
        return loss / scale


PHASE_TWO = Gradient("phase 1: search", lambda p, settings, source: (search(p, settings, source), None),
                     lambda p, settings, source, rows, coef, graph: phase_two(p, settings, source, rows, coef))


# ------------------------------------------------------------------ update
def update(p: Parts, settings: StepConfig, loss: float) -> dict:
    """Clip and step, unless the loss or the gradient norm is not finite: then the parameters stay as they were and
    the step is skipped; p.outcome says which ("taken", "skipped", or "bad": a skip that counts towards
    --max-bad-steps, which the run enforces)."""
    # Sum over processes first: clipping and the skip decision then see the global gradient, so every process
    # takes the same decision and the parameters stay identical.
    with section(p, "gradient all-reduce and clipping", "update"):
        if not fsdp.is_sharded(p.model):  # --fsdp: summed into the shards' .grad already
            distributed.all_reduce_grads(list(p.model.parameters()))
        params = [q for q in p.model.parameters() if q.grad is not None]
        amp.unscale(p.scaler, p.optimizer, params)  # clipping and the check below see true gradients
        clip = settings.clip_norm if settings.clip_norm > 0 else math.inf
        norm = float(fsdp.whole(torch.nn.utils.clip_grad_norm_(params, clip))) if params else 0.0
    scale = amp.update(p.scaler, params)  # backs the scale off after inf/nan gradients, else may grow it
    if math.isfinite(loss) and math.isfinite(norm):
        with section(p, "optimizer step", "update"):
            p.optimizer.step()
        p.outcome = "taken"
        return {"grad_norm": norm, "skipped": 0}
    p.optimizer.zero_grad(set_to_none=True)
    p.outcome = "bad" if amp.counts_as_bad(loss, scale) else "skipped"
    return {"grad_norm": norm, "skipped": 1}


def rl_update(p: Parts, settings: StepConfig, losses: list[float], rewards: list[torch.Tensor],
              reward_parts: list[dict | None]) -> dict:
    """Step 5 of a step whose batches left these losses, (N,) rewards and, with several rewards, each one's
    values: the loss summed over processes, the rewards' figures, then `update`."""
    parts: dict = {}
    for batch_parts in reward_parts:
        for name, values in (batch_parts or {}).items():  # several rewards: each one's values, for the log
            parts.setdefault(name, []).extend(values)
    total = distributed.reduce_sums({"loss": sum(losses, 0.0)})
    return {"loss": total["loss"], **p.reward_log.row(torch.cat(rewards), parts, p.number),
            **update(p, settings, total["loss"])}
