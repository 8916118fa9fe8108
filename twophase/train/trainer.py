"""The training steps: an MLE step, and a two-phase sequence-level RL step (`run.Run` takes them in order).

One RL step reads like the algorithm:
    1. phase one  - search K candidates per source with no graph (beam_search / sample / stochastic_beam_search);
    2. rewards    - score the detokenised candidates against every reference of their source (and the source);
    3. objective  - turn rewards and search scores into one coefficient per candidate;
    4. phase two  - rescore_backward: chunked teacher-forced re-decoding, exact gradient of sum c_i log p_i;
    5. update     - clip and take the optimizer step.
With --grad-accum, steps 1-4 run for each batch in turn; --objective distill runs steps 1-3 of every batch first,
as TRL generates once per accumulation: its normaliser is the whole step's scored tokens (`distill_batches`).

Steps 1 and 4 are the trainer's `gradient` part: `PhaseTwo` here, or a baseline a benchmark puts in its place
(`onephase.OnePhase`, --one-phase). The task (twophase.tasks) supplies the data, the model's sources, target ids
and detokenisation; the trainer knows nothing else about it, nor about the run (its step count, checkpoints,
logs: `run.Run`). Letters: B sources per step, K candidates per source, N rows, T target length.
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
from dataclasses import asdict, dataclass

import torch

from .. import objectives
from ..config import Config, parse_size
from ..objectives import estimators
from ..phase1.sbs import stochastic_beam_search
from ..phase1.search import beam_search, greedy, sample
from ..phase2.rescoring import rescore_backward
from ..samples import Samples
from ..system import amp, distributed, fsdp
from ..system.profiling import ChunkPlanner
from ..tasks.base import Example, Task
from ..tasks.data import BatchSampler
from ..vocab import pad_targets
from . import teacher
from .checkpoint import (host_copy, python_rng_state, rng_state, set_generator_state, set_python_rng_state,
                         set_rng_state)
from .evaluation import completion_ids, score, validate, with_references
from .policy_step import PolicyStep
from .report import RewardLog


@dataclass
class BatchRows:
    """One batch after steps 1-3 (`Trainer.rl_rows`): its sources, the rows phase two re-decodes and their
    coefficients (None: --objective distill's, the step's), what the search leaves step 4 (`PhaseTwo`: nothing),
    the (N,) rewards of its candidates and, with several rewards, each one's values."""

    source: object
    rows: Samples
    coef: object
    search: object
    rewards: torch.Tensor
    parts: dict | None


class PhaseTwo:
    """The step's gradient: phase one searches without a graph, phase two re-decodes the rows in chunks."""

    section = "phase 1: search"  # its --profile-memory name

    def search(self, trainer: "Trainer", source) -> tuple[Samples, None]:
        return trainer.search(source), None

    def backward(self, trainer: "Trainer", source, rows: Samples, coef, graph: None) -> float:
        return trainer.phase_two(source, rows, coef)


class Trainer:
    """The steps for one model, task and reward: it holds the model, optimizer, fp16's scaler, both phases' batch
    samplers and the sampling generator; `gradient`: steps 1 and 4 of the RL step (`PhaseTwo`, or `OnePhase`
    under --one-phase)."""

    def __init__(self, cfg: Config, task: Task, model, reward, device: torch.device, gradient, teacher=None):
        self.cfg, self.task, self.model, self.device, self.reward = cfg, task, model, device, reward
        self.teacher = teacher  # --objective distill's frozen teacher (train.teacher.load), else None
        self.gradient = gradient  # PhaseTwo, or OnePhase under --one-phase (Run.assemble chooses)
        self.train, self.valid, self.test = task.train, task.valid, task.test or None
        self.ref_ids = [task.target_ids(ex) for ex in self.train]  # (source, reference) -> target ids, no EOS
        self.pairs = [(i, j) for i, refs in enumerate(self.ref_ids) for j in range(len(refs))]
        # None without references (prompt-only data trains RL alone: cli.check_references)
        self.mle_batches = BatchSampler(len(self.pairs), cfg.mle_batch_size, cfg.seed) if self.pairs else None
        self.rl_batches = BatchSampler(len(self.train), cfg.batch_size, cfg.seed + 1)
        # Each process samples candidates for its own sources, from its own stream (rank 0's is a single process's).
        self.sampling = torch.Generator(device=device).manual_seed(cfg.seed + 1000 * distributed.rank())
        self.presenting = random.Random(f"present {cfg.seed}")  # Task.present's draws: one stream, on every process
        self.optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)  # LoRA: adapters
        # --amp: autocast around every model run of a training step (validation runs in full precision), and
        # fp16's loss scale (None otherwise)
        self.autocast = functools.partial(amp.autocast, cfg.amp, device)
        self.scaler = amp.grad_scaler(cfg.amp, device)
        self.chunk_planner = ChunkPlanner(parse_size(cfg.memory_budget)) if cfg.rescore_chunk == "auto" else None
        self.last_chunk = cfg.rescore_chunk
        self.reward_log = RewardLog(reward)  # the RL rows' reward figures, and the warning of a step scoring nothing
        # What start_step sets for each step: its number (1-based, for messages), learning rate, --profile-memory's
        # profiler, phase two's counts (decoded prefix-tree nodes, candidate positions) and the update's outcome.
        self.number, self.lr, self.profiler, self.step_counts, self.update_outcome = 1, cfg.lr, None, {}, None
        # A caller's hook around each timed part of a step: timer(part) -> a context manager (bench.steptimes)
        self.timer = None
        # --objective policy's generations: given the trainer's parts its step runs, not the trainer
        self.policy = PolicyStep(cfg, model, task, device, self.rl_batches, self.optimizer, reward, self.reward_log,
                                 sources=self._sources, search=self.search, rewards_of=self.rewards_of,
                                 phase_two=self.phase_two, update=self.update, section=self.section,
                                 autocast=self.autocast) if cfg.objective == "policy" else None

    def start_step(self, number: int, lr: float, profiler=None) -> None:
        """Before step `number`: its learning rate, --profile-memory's profiler (None: not profiled), fresh counts."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.number, self.lr, self.profiler, self.step_counts, self.update_outcome = number, lr, profiler, {}, None

    def step_figures(self) -> dict:
        """What the step's metrics row adds about the trainer: the auto chunk size, the rate, phase two's counts."""
        row = {"chunk": self.last_chunk} if self.cfg.rescore_chunk == "auto" else {}
        row["lr"] = self.lr
        if self.step_counts.get("positions"):  # phase two decoded this many prefixes for this many positions
            row["prefix_nodes"], row["prefix_positions"] = self.step_counts["nodes"], self.step_counts["positions"]
        return row

    # ------------------------------------------------------------------ batches
    def _sources(self, idx: list[int]):
        """The training examples idx as the model reads them, unpresented (--objective policy: its several
        updates of a generation must see one source, so Karel's shows all six pairs)."""
        return self.task.collate([self.train[i] for i in idx], self.device)

    def _presented(self, batch: list[int]) -> list[Example]:
        """This process's share of the global batch's training examples as this step shows them (Task.present:
        Karel draws 5 of 6 pairs): every process presents the whole global batch from the same stream, so the
        examples shown do not depend on the number of processes."""
        return distributed.shard(self.task.present([self.train[i] for i in batch], self.presenting))

    def detokenize(self, tokens: torch.Tensor) -> list[str]:
        """Rows (N, T) -> the strings reward plug-ins see."""
        return [self.task.detokenize(row) for row in tokens.tolist()]

    def rewards_of(self, tokens: torch.Tensor, owner: list[int], examples: list[Example]) -> torch.Tensor:
        """(N,) float64 rewards of candidate rows tokens (N, T), row i from examples[owner[i]]."""
        hyps = self.detokenize(tokens)
        ids = completion_ids(tokens, self.model.pad_id, self.model.eos_id)
        return torch.tensor(score(self.reward, hyps, [examples[o] for o in owner], ids), dtype=torch.float64,
                            device=self.device)

    # ------------------------------------------------------------------ steps
    def mle_step(self) -> dict:
        """One update from --grad-accum batches, each weighted 1/(N*B): the gradient of one batch of N*B."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        with fsdp.gathered(self.model, reduce=True):  # --fsdp: whole parameters for the step, one reduction after
            for _ in range(self.cfg.grad_accum):
                batch = next(self.mle_batches)  # the global batch: every process draws it, then takes its share
                shown = self._presented([self.pairs[k][0] for k in batch])
                pairs = [self.pairs[k] for k in distributed.shard(batch)]
                source = self.task.collate(shown, self.device)
                refs = self._target_rows([self.ref_ids[i][j] for i, j in pairs], list(range(len(pairs))))  # (B, T)
                coef = objectives.mle(refs.owner, len(batch) * self.cfg.grad_accum)
                loss += self.phase_two(source, refs, coef, keep_mode=True)
        loss = distributed.reduce_sums({"loss": loss})["loss"]
        return {"loss": loss, **self.update(loss)}

    def rl_step(self) -> dict:
        """One update from --grad-accum batches of B sources, every loss averaged over all N*B of them
        (--objective distill: over the scored tokens of all of them, `distill_batches`)."""
        if self.policy is not None:  # token-level objective, several updates per generation (policy_step)
            return self.policy.step(self.number)
        self.optimizer.zero_grad(set_to_none=True)
        with fsdp.gathered(self.model, reduce=True):  # --fsdp: whole parameters for the step, one reduction after
            if self.teacher is None:  # each batch's phase two right after its phase one
                done = [self.rl_batch(next(self.rl_batches)) for _ in range(self.cfg.grad_accum)]
            else:
                done = self.distill_batches()
        loss, rewards, parts = 0.0, [], {}
        for part, batch_rewards, batch_parts in done:
            loss += part
            rewards.append(batch_rewards)
            for name, values in (batch_parts or {}).items():  # several rewards: each one's values, for the log
                parts.setdefault(name, []).extend(values)
        # 5. Update (several processes: statistics summed here, gradients in update).
        total = distributed.reduce_sums({"loss": loss})
        return {"loss": total["loss"], **self.reward_log.row(torch.cat(rewards), parts, self.number),
                **self.update(total["loss"])}

    def rl_batch(self, batch: list[int]):
        """Steps 1-4 of the algorithm on one batch: .grad += its share of the step's loss gradient; returns the
        loss, the (N,) rewards of its candidates and, with several rewards, each one's values."""
        found = self.rl_rows(batch)
        # 4. Phase two: chunked teacher-forced re-decoding; .grad = d/dtheta sum_i c_i log p_i, exactly.
        loss = self.gradient.backward(self, found.source, found.rows, found.coef, found.search)
        return loss, found.rewards, found.parts

    def distill_batches(self) -> list:
        """--objective distill's --grad-accum batches in TRL's order, which generates once per accumulation:
        steps 1-3 of every batch (the step's whole generation), then TRL's normaliser (the generation's scored
        tokens, every process's: its num_items_in_batch), then step 4 of each batch with that one objective,
        the teacher gathered for them all (--fsdp: sharded otherwise). rl_batch's returns, one per batch."""
        found = [self.rl_rows(next(self.rl_batches)) for _ in range(self.cfg.grad_accum)]
        objective = teacher.objective(self.teacher, self.cfg, [f.rows for f in found])
        with fsdp.gathered(self.teacher):
            return [(self.gradient.backward(self, f.source, f.rows, objective, f.search), f.rewards, f.parts)
                    for f in found]

    def rl_rows(self, batch: list[int]) -> BatchRows:
        """Steps 1-3 of the algorithm on one batch: what its phase two re-decodes, with which coefficients
        (--objective distill: none, its objective is the step's, `distill_batches`)."""
        cfg = self.cfg
        B = len(batch) * cfg.grad_accum  # B counts every source of the update, across processes and batches
        idx = distributed.shard(batch)  # this process's share
        examples = self._presented(batch)
        source = self.task.collate(examples, self.device)
        self.model.eval()  # phase one and phase two must score with the same function: no dropout in either

        # 1. Phase one: K candidates per source and their log-probabilities (and what step 4 needs of the search).
        with self.section(self.gradient.section, "phase one"), self.autocast():
            cand, search = self.gradient.search(self, source)
        # 2. Rewards of every candidate against all references of its source (and what else the reward asks).
        with self.section("rewards", "rewards"):
            rewards = self.rewards_of(cand.tokens, cand.owner.tolist(), examples)  # (N,)
            parts = getattr(self.reward, "last", None)  # several rewards: each one's values, for the log
        # 3. Coefficients: the objective's weight on each log p(candidate).
        rows, row_rewards = cand, rewards
        if cfg.include_reference:  # RL_beam over candidates and references (the objective dedups the two)
            refs = self._reference_rows(idx)
            with self.section("references: score and reward", "references"), self.autocast():
                rows, row_rewards = with_references(self.model, source, cand, rewards, refs,
                                                    self.rewards_of(refs.tokens, refs.owner.tolist(), examples))
        if self.teacher is not None:  # the teacher's distributions are the signal, not the rewards
            return BatchRows(source, rows, None, search, rewards, parts)
        coef = self.coefficients(rows, row_rewards, source, examples, B)
        if cfg.mle_weight > 0:  # the MLE term rides along as extra rows, chunked like the candidates
            refs = self._reference_rows(idx)
            rows = Samples.cat([rows, refs], self.model.pad_id)
            coef = objectives.mix(coef, objectives.mle(refs.owner, B), cfg.mle_weight)
        return BatchRows(source, rows, coef, search, rewards, parts)

    def search(self, source) -> Samples:
        """Phase one without a graph: K candidates per source by --sampler (beam, sample, sbs)."""
        cfg = self.cfg
        if cfg.sampler == "beam":
            return beam_search(self.model, source, cfg.beam_size, cfg.max_len)
        if cfg.sampler == "sbs":
            return stochastic_beam_search(self.model, source, cfg.beam_size, cfg.max_len, self.sampling)
        return sample(self.model, source, cfg.beam_size, cfg.max_len, cfg.temperature, self.sampling,
                      top_k=cfg.top_k or None, top_p=cfg.top_p if cfg.top_p < 1 else None, min_len=cfg.min_len)

    def phase_two(self, source, rows: Samples, coef, keep_mode: bool = False, stats: dict | None = None) -> float:
        """rescore_backward with the configured chunk size, or the largest within --memory-budget, under the
        autocast phase one ran in; with fp16 the coefficients carry the loss scale (the returned loss does not)."""
        coef, scale = self.scale_coefficients(coef)
        with self.timed(self.autocast(), "phase two"):
            chunk = self.cfg.rescore_chunk
            if chunk == "auto":
                chunk = self.chunk_planner.chunk_size(self.model, source, rows, coef)  # a teacher's states too
                self.last_chunk = chunk
            stats = {} if stats is None else stats
            loss = rescore_backward(self.model, source, rows, coef, chunk, profiler=self.profiler,
                                    keep_mode=keep_mode, prefix_sharing=not self.cfg.no_prefix_sharing, stats=stats)
            for key in ("positions", "nodes"):  # phase_two may run twice a step (--one-phase's MLE rows)
                self.step_counts[key] = self.step_counts.get(key, 0) + stats.get(key, 0)
            return loss / scale

    def scale_coefficients(self, coef):
        """(coefficients times fp16's loss scale, that scale); (coef, 1.0) without a scaler."""
        return amp.scale_coefficients(coef, self.scaler)

    def section(self, name: str, part: str | None = None):
        """A --profile-memory section of the step (a no-op otherwise), inside the caller's timer of `part`."""
        return self.timed(self.profiler.section(name) if self.profiler is not None else contextlib.nullcontext(),
                          part)

    def timed(self, inner, part: str | None):
        """The context manager `inner`, inside timer(part) where a caller set a timer (and part names one)."""
        if self.timer is None or part is None:
            return inner
        return _within(self.timer(part), inner)

    def coefficients(self, cand: Samples, rewards, source, examples: list[Example], num_sources: int) -> torch.Tensor:
        """num_sources: the global batch size, which every loss is averaged over (cand.owner indexes src)."""
        cfg, B = self.cfg, num_sources
        if cfg.objective == "beam":
            return objectives.beam(rewards, cand.scores, cand.owner, B, tokens=cand.tokens)
        if cfg.objective == "mrt":
            return objectives.mrt(rewards, cand.scores, cand.owner, B, cfg.mrt_alpha, tokens=cand.tokens)
        if cfg.objective == "priority":
            return estimators.priority(rewards, cand.scores, cand.threshold, cand.owner, B)
        if cfg.objective == "unordered-set":
            return estimators.unordered_set(rewards, cand.scores, cand.owner, B)
        greedy_rewards = None
        if cfg.reinforce_baseline == "greedy":  # self-critical: the greedy decode's reward is the baseline
            with self.autocast():
                best = greedy(self.model, source, cfg.max_len)
            greedy_rewards = self.rewards_of(best.tokens, best.owner.tolist(), examples)  # (B,)
        return objectives.reinforce(rewards, cand.owner, B, cfg.reinforce_baseline, greedy_rewards)

    def _reference_rows(self, idx: list[int]) -> Samples:
        """Every reference of the sources idx, row owner = the source's position in idx."""
        owner = [b for b, i in enumerate(idx) for _ in self.ref_ids[i]]
        return self._target_rows([r for i in idx for r in self.ref_ids[i]], owner)  # (R, T)

    def _target_rows(self, ids: list[list[int]], owner: list[int]) -> Samples:
        """Target ids (no EOS) as rows in the model's layout (tokens, eos_id, pad_id), which no search scored."""
        pad, eos = self.model.pad_id, self.model.eos_id
        tgt = pad_targets(ids, self.device, pad, eos)  # (R, T)
        return Samples.of_targets(tgt, torch.tensor(owner, dtype=torch.long, device=self.device), pad, eos)

    def update(self, loss: float) -> dict:
        """Clip and step, unless the loss or the gradient norm is not finite: then the parameters stay as they
        were and the step is skipped; update_outcome says which ("taken", "skipped", or "bad": a skip that counts
        towards --max-bad-steps, which the run enforces)."""
        # Sum over processes first: clipping and the skip decision then see the global gradient, so every
        # process takes the same decision and the parameters stay identical.
        with self.section("gradient all-reduce and clipping", "update"):
            if not fsdp.is_sharded(self.model):  # --fsdp: summed into the shards' .grad already
                distributed.all_reduce_grads(list(self.model.parameters()))
            params = [p for p in self.model.parameters() if p.grad is not None]
            amp.unscale(self.scaler, self.optimizer, params)  # clipping and the check below see true gradients
            clip = self.cfg.clip_norm if self.cfg.clip_norm > 0 else math.inf
            norm = float(fsdp.whole(torch.nn.utils.clip_grad_norm_(params, clip))) if params else 0.0
        scale = amp.update(self.scaler, params)  # backs the scale off after inf/nan gradients, else may grow it
        if math.isfinite(loss) and math.isfinite(norm):
            with self.section("optimizer step", "update"):
                self.optimizer.step()
            self.update_outcome = "taken"
            return {"grad_norm": norm, "skipped": 0}
        self.optimizer.zero_grad(set_to_none=True)
        self.update_outcome = "bad" if amp.counts_as_bad(loss, scale) else "skipped"
        return {"grad_norm": norm, "skipped": 1}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """The trainer's part of a checkpoint: the parameters (LoRA: the adapters alone), the optimizer, the
        configuration and task it trains, the data order of both phases, every random stream (several processes:
        each one's, in "rank_rngs"), --objective policy's generation and fp16's loss scale. A collective: every
        process calls it (--fsdp gathers whole tensors, the policy and the streams are gathered too)."""
        rank_rngs = distributed.gather_objects({"rng": rng_state(), "sampling_rng": self.sampling.get_state()})
        if fsdp.is_sharded(self.model):  # a single process's layout, gathered by every process
            model, optimizer = fsdp.full_model_state(self.model), fsdp.full_optimizer_state(self.optimizer)
        else:
            model, optimizer = fsdp.saved_state(self.model), self.optimizer.state_dict()
        policy = self.policy.state_dict() if self.policy is not None else None
        task = self.task
        return {"model": model, "optimizer": optimizer, "config": asdict(self.cfg),
                "task": {"spec": task.spec, "state": task.state_dict(),
                         "origin": getattr(task, "origin", None)},  # where a plug-in was imported from
                "rng": rng_state(), "sampling_rng": self.sampling.get_state(),
                "mle_batches": self.mle_batches.state_dict() if self.mle_batches else None,
                "rl_batches": self.rl_batches.state_dict(), "presenting": python_rng_state(self.presenting),
                **({"policy": policy} if policy is not None else {}),
                **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),  # floats and ints
                **({"world_size": len(rank_rngs), "rank_rngs": rank_rngs} if len(rank_rngs) > 1 else {})}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's parameters, optimizer, data order, --objective policy's generation and every random
        stream (rank r's where the checkpoint has as many processes' as run now)."""
        self.load_weights(state)
        if self.mle_batches is not None and state["mle_batches"] is not None:
            self.mle_batches.load_state_dict(state["mle_batches"])
        self.rl_batches.load_state_dict(state["rl_batches"])
        if self.policy is not None and "policy" in state:  # mid-generation: its candidates
            self.policy.load_state_dict(state["policy"])
        if "presenting" in state:  # the same on every process (Task.present's stream)
            set_python_rng_state(state["presenting"], self.presenting)
        saved = state.get("rank_rngs") or [{"rng": state["rng"], "sampling_rng": state["sampling_rng"]}]
        if len(saved) != distributed.world() and distributed.rank() > 0:
            return  # resumed on another number of processes: continues, though not bit-identically
        mine = saved[distributed.rank()] if len(saved) == distributed.world() else saved[0]
        set_rng_state(mine["rng"])
        set_generator_state(self.sampling, mine["sampling_rng"])

    def load_weights(self, state: dict) -> None:
        """Parameters (LoRA: the adapters alone; --fsdp: into each process's shards), optimizer and fp16's scale."""
        fsdp.load_model(self.model, state["model"])
        fsdp.load_optimizer(self.model, self.optimizer, state["optimizer"])
        if self.scaler is not None and "scaler" in state:  # a run saved without --amp fp16 starts a fresh scale
            self.scaler.load_state_dict(state["scaler"])

    def snapshot(self) -> dict:
        """What the next step depends on, copied into CPU memory (this process's random streams only): held for
        a whole phase (--compare-mle's branch point), a copy on the device would cost it a second model and
        optimizer. Of the model, what a checkpoint holds (with LoRA the adapters alone: the base does not
        change)."""
        state = {"model": fsdp.saved_state(self.model), "optimizer": self.optimizer.state_dict(),
                 "mle_batches": self.mle_batches.state_dict(), "rl_batches": self.rl_batches.state_dict(),
                 "rng": rng_state(), "sampling_rng": self.sampling.get_state(),
                 **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}
        return host_copy(state)

    def restore(self, snap: dict) -> None:
        """Back to a snapshot (or a checkpoint's fields of the same names, this process's streams)."""
        self.load_weights(snap)
        self.mle_batches.load_state_dict(snap["mle_batches"])
        self.rl_batches.load_state_dict(snap["rl_batches"])
        set_rng_state(snap["rng"])
        set_generator_state(self.sampling, snap["sampling_rng"])

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict:
        cfg = self.cfg
        with fsdp.gathered(self.model):
            return validate(self.model, self.task, self.valid, self.reward, cfg.eval_beam, cfg.max_len, self.device,
                            limit=cfg.valid_size)


@contextlib.contextmanager
def _within(outer, inner):
    with outer, inner:
        yield
