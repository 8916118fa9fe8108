"""The training steps: an MLE warm start, then two-phase sequence-level RL (`loop.RunLoop` runs them in order).

One RL step reads like the algorithm:
    1. phase one  - search K candidates per source with no graph (beam_search / sample / stochastic_beam_search);
    2. rewards    - score the detokenised candidates against every reference of their source (and the source);
    3. objective  - turn rewards and search scores into one coefficient per candidate;
    4. phase two  - rescore_backward: chunked teacher-forced re-decoding, exact gradient of sum c_i log p_i;
    5. update     - clip and take the optimizer step.

The task (twophase.tasks) supplies the data, the model's sources, target ids and detokenisation; the trainer
knows nothing else about it. Letters: B sources per step, K candidates per source, N rows, T target length.
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
from pathlib import Path

import torch

from . import amp, distributed, fsdp
from .. import estimators, objectives
from .checkpoint import CheckpointManager
from .config import Config, parse_size
from ..tasks.base import Example, Task
from ..tasks.data import BatchSampler
from .interrupt import Interrupted
from .evaluation import completion_ids, score, validate
from .rewardlog import RewardLog
from .beststart import BestStart
from .compare import Comparison
from .loop import RunLoop
from ..onephase import one_phase_backward, one_phase_search
from ..protocol import ModelError
from .policy_step import PolicyStep
from .profiling import ChunkPlanner, StepProfiler
from .resumable import Resumable
from .rundir import MetricsLog
from .schedule import Plateau
from .steptimes import timed
from ..rescoring import rescore_backward
from ..samples import Samples
from ..sbs import stochastic_beam_search
from .references import with_references
from ..search import beam_search, greedy, sample
from ..vocab import pad_targets


class Trainer(Resumable, RunLoop, Comparison, BestStart):
    def __init__(self, cfg: Config, task: Task, model, reward, device: torch.device):
        self.cfg, self.task, self.model, self.device, self.reward = cfg, task, model, device, reward
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
        self.step = 0
        self.save_dir = Path(cfg.save_dir)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.best_key = cfg.best_metric  # resolved by the command (auto -> the task's main metric)
        lower = {m.key for m in task.metrics if not m.higher_is_better}
        self.checkpoints = CheckpointManager(self.save_dir, keep_last=cfg.keep_last,
                                             higher_is_better=self.best_key not in lower)
        self.best_step: int | None = None
        self.summary: dict[str, dict] = {}
        self.stats = {p: {"steps": 0, "seconds": 0.0, "skipped": 0, "out_of_memory": 0, "reward_sum": 0.0,
                          "reward_steps": 0} for p in ("mle", "rl", "mle-continued")}
        self.bad_in_a_row = 0
        self.plateau = Plateau(cfg.lr, cfg.lr_decay, cfg.patience, cfg.min_lr, self.checkpoints.higher_is_better)
        self.mle_end = cfg.mle_steps  # earlier once --lr-decay ends the MLE phase
        # --compare-mle: the end-of-MLE branch point, whether the comparison is done, the models it tested, the
        # RL model kept aside during it, and the last step number in metrics.jsonl (beyond RL's with it)
        self.comparing = cfg.compare_mle and cfg.rl_steps > 0
        self.branch: dict | None = None
        self.compared = False
        self.test_models: dict | None = None
        self.final: dict | None = None
        self.log_step = 0
        self.profiler: StepProfiler | None = None  # set per step under --profile-memory
        self.part_times: dict | None = None  # a caller's dict: CPU seconds of the step's parts (steptimes)
        self.chunk_planner = ChunkPlanner(parse_size(cfg.memory_budget)) if cfg.rescore_chunk == "auto" else None
        self.last_chunk = cfg.rescore_chunk
        self.is_main = distributed.rank() == 0  # the one process that logs, draws the bar and saves
        self.metrics = MetricsLog(self.save_dir / "metrics.jsonl", enabled=self.is_main)
        self.policy = PolicyStep(self) if cfg.objective == "policy" else None  # --objective policy's generations
        self.reward_log = RewardLog(reward)  # the RL rows' reward figures, and the warning of a step scoring nothing

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
        return {"loss": loss, **self._update(loss)}

    def rl_step(self) -> dict:
        """One update from --grad-accum batches of B sources, every loss averaged over all N*B of them."""
        if self.policy is not None:  # token-level objective, several updates per generation (policy_step)
            return self.policy.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss, rewards, parts = 0.0, [], {}
        with fsdp.gathered(self.model, reduce=True):  # --fsdp: whole parameters for the step, one reduction after
            for _ in range(self.cfg.grad_accum):
                part, batch_rewards, batch_parts = self.rl_batch(next(self.rl_batches))
                loss += part
                rewards.append(batch_rewards)
                for name, values in (batch_parts or {}).items():  # several rewards: each one's values, for the log
                    parts.setdefault(name, []).extend(values)
        # 5. Update (several processes: statistics summed here, gradients in _update).
        total = distributed.reduce_sums({"loss": loss})
        return {"loss": total["loss"], **self.reward_log.row(torch.cat(rewards), parts, self.step + 1),
                **self._update(total["loss"])}

    def rl_batch(self, batch: list[int]):
        """Steps 1-4 of the algorithm on one batch: .grad += its share of the step's loss gradient; returns the
        loss, the (N,) rewards of its candidates and, with several rewards, each one's values."""
        cfg = self.cfg
        B = len(batch) * cfg.grad_accum  # B counts every source of the update, across processes and batches
        idx = distributed.shard(batch)  # this process's share
        examples = self._presented(batch)
        source = self.task.collate(examples, self.device)
        self.model.eval()  # phase one and phase two must score with the same function: no dropout in either

        # 1. Phase one: K candidates per source and their log-probabilities, no graph.
        log_p = None  # under --one-phase: the log-probabilities with the search's graph, and no phase two
        with self.section("phase 1: search" + (" with graph (--one-phase)" if cfg.one_phase else ""), "phase one"), \
                self.autocast():
            if cfg.one_phase:
                cand, log_p = one_phase_search(self.model, source, cfg.sampler, cfg.beam_size, cfg.max_len,
                                               cfg.temperature, self.sampling)
            else:
                cand = self.search(source)
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
        coef = self.coefficients(rows, row_rewards, source, examples, B)
        if cfg.mle_weight > 0:  # the MLE term rides along as extra rows, chunked like the candidates
            refs = self._reference_rows(idx)
            rows = Samples.cat([rows, refs], self.model.pad_id)
            coef = objectives.mix(coef, objectives.mle(refs.owner, B), cfg.mle_weight)
        # 4. Phase two: chunked teacher-forced re-decoding; .grad = d/dtheta sum_i c_i log p_i, exactly.
        if log_p is None:
            loss = self.phase_two(source, rows, coef)
        else:
            loss = self.one_phase_backward(log_p, source, rows, coef)
        return loss, rewards, parts

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
        coef, scale = amp.scale_coefficients(coef, self.scaler)
        with timed(self.autocast(), self.part_times, "phase two"):
            chunk = self.cfg.rescore_chunk
            if chunk == "auto":
                chunk = self.chunk_planner.chunk_size(self.model, source, rows)
                self.last_chunk = chunk
            stats = {} if stats is None else stats
            loss = rescore_backward(self.model, source, rows, coef, chunk, profiler=self.profiler,
                                    keep_mode=keep_mode, prefix_sharing=not self.cfg.no_prefix_sharing, stats=stats)
            for key in ("positions", "nodes"):  # phase_two may run twice a step (--one-phase's MLE rows)
                self.step_counts[key] = self.step_counts.get(key, 0) + stats.get(key, 0)
            return loss / scale

    def section(self, name: str, part: str | None = None):
        """A --profile-memory section of the step (a no-op otherwise), its CPU seconds added to self.part_times[part]
        when a caller set that dict (steptimes)."""
        profiled = self.profiler.section(name) if self.profiler is not None else contextlib.nullcontext()
        return timed(profiled, self.part_times, part)

    def one_phase_backward(self, log_p, source, rows: Samples, coef) -> float:
        """--one-phase: one backward through the search graph of the candidates (the first len(log_p) rows);
        reference rows of --mle-weight have no search graph, so phase two scores those."""
        n = len(log_p)
        scaled, scale = amp.scale_coefficients(coef[:n], self.scaler)
        loss = one_phase_backward(log_p, scaled) / scale
        if len(rows) > n:
            refs = rows.select(torch.arange(n, len(rows), device=coef.device))
            loss += self.phase_two(source, refs, coef[n:])
        return loss

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

    def _update(self, loss: float) -> dict:
        """Clip and step, unless the loss or the gradient norm is not finite: then the parameters stay as they
        were, the step is counted as skipped, and too many in a row stop the run with a crash checkpoint."""
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
            self.bad_in_a_row = 0
            return {"grad_norm": norm, "skipped": 0}
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_in_a_row += amp.counts_as_bad(loss, scale)
        if self.bad_in_a_row > self.cfg.max_bad_steps:
            self.save(crash=True)
            raise Interrupted(3, f"{self.bad_in_a_row} non-finite steps in a row at step {self.step + 1}; saved "
                                 f"{self.save_dir / 'checkpoint_crash.pt'} (parameters from before them)")
        return {"grad_norm": norm, "skipped": 1}

    def validate(self) -> dict:
        cfg = self.cfg
        try:
            with fsdp.gathered(self.model):
                return validate(self.model, self.task, self.valid, self.reward, cfg.eval_beam, cfg.max_len,
                                self.device, limit=cfg.valid_size)
        except ModelError as err:
            raise ModelError(f"validation after step {self.step}: {err}") from None
