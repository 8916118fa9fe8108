"""The training loop: an MLE warm start, then two-phase sequence-level RL.

One RL step reads like the algorithm:
    1. phase one  - search K candidates per source with no graph (beam_search / sample);
    2. rewards    - score the detokenised candidates against every reference of their source;
    3. objective  - turn rewards and search scores into one coefficient per candidate;
    4. phase two  - rescore_backward: chunked teacher-forced re-decoding, exact gradient of sum c_i log p_i;
    5. update     - clip and take the optimizer step.

Letters: B sources per step, K candidates per source, N rows, S source length, T target length.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from . import objectives
from .checkpoint import CheckpointManager
from .config import Config
from .data import BatchSampler, Dataset, pad_batch, pad_targets
from .metrics import evaluate
from .model import Seq2Seq
from .rescoring import rescore_backward
from .search import Samples, beam_search, greedy, sample
from .vocab import Vocab


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA's allocator where training runs on a GPU, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # POSIX only; Linux reports kilobytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Trainer:
    def __init__(self, cfg: Config, model: Seq2Seq, src_vocab: Vocab, tgt_vocab: Vocab, train: Dataset,
                 valid: Dataset, reward, device: torch.device):
        self.cfg, self.model, self.device = cfg, model, device
        self.src_vocab, self.tgt_vocab, self.train, self.valid = src_vocab, tgt_vocab, train, valid
        self.reward = reward
        self.src_ids = [src_vocab.encode(s) for s in train.sources]
        self.ref_ids = [[tgt_vocab.encode(r) for r in refs] for refs in train.references]
        self.pairs = train.pairs()
        self.mle_batches = BatchSampler(len(self.pairs), cfg.mle_batch_size, cfg.seed)
        self.rl_batches = BatchSampler(len(train), cfg.batch_size, cfg.seed + 1)
        self.sampling = torch.Generator(device=device).manual_seed(cfg.seed)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.step = 0
        self.save_dir = Path(cfg.save_dir)
        self.checkpoints = CheckpointManager(self.save_dir, keep_last=2)
        self.summary: dict[str, dict] = {}

    # ------------------------------------------------------------------ batches
    def _sources(self, idx: list[int]):
        return pad_batch([self.src_ids[i] for i in idx], self.device)  # (B, S), (B,)

    def detokenize(self, tokens: torch.Tensor) -> list[str]:
        """Rows (N, T) -> space-joined target tokens, what reward plug-ins see."""
        return [" ".join(self.tgt_vocab.decode(row)) for row in tokens.tolist()]

    # ------------------------------------------------------------------ steps
    def mle_step(self) -> dict:
        pairs = [self.pairs[k] for k in next(self.mle_batches)]
        src, src_len = self._sources([i for i, _ in pairs])
        tgt = pad_targets([self.ref_ids[i][j] for i, j in pairs], self.device)  # (B, T)
        owner = torch.arange(len(pairs), device=self.device)
        refs = Samples(tgt, (tgt != 0).sum(1), owner, torch.zeros(len(pairs), device=self.device))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = rescore_backward(self.model, src, src_len, refs, objectives.mle(owner, len(pairs)),
                                self.cfg.rescore_chunk)
        return {"loss": loss, **self._update()}

    def rl_step(self) -> dict:
        cfg, idx = self.cfg, next(self.rl_batches)
        B = len(idx)
        src, src_len = self._sources(idx)
        references = [[" ".join(r) for r in self.train.references[i]] for i in idx]
        self.model.eval()  # phase one and phase two must score with the same function: no dropout in either

        # 1. Phase one: K candidates per source and their log-probabilities, no graph.
        if cfg.sampler == "beam":
            cand = beam_search(self.model, src, src_len, cfg.beam_size, cfg.max_len)
        else:
            cand = sample(self.model, src, src_len, cfg.beam_size, cfg.max_len, cfg.temperature, self.sampling)
        # 2. Rewards of every candidate against all references of its source.
        rewards = torch.tensor(self.reward(self.detokenize(cand.tokens), [references[o] for o in cand.owner]),
                               dtype=torch.float64, device=self.device)  # (N,)
        # 3. Coefficients: the objective's weight on each log p(candidate).
        coef = self.coefficients(cand, rewards, src, src_len, references)
        rows = cand
        if cfg.mle_weight > 0:  # the MLE term rides along as extra rows, chunked like the candidates
            refs = self._reference_rows(idx)
            rows = Samples.cat([cand, refs])
            coef = objectives.mix(coef, objectives.mle(refs.owner, B), cfg.mle_weight)
        # 4. Phase two: chunked teacher-forced re-decoding; .grad = d/dtheta sum_i c_i log p_i, exactly.
        self.optimizer.zero_grad(set_to_none=True)
        loss = rescore_backward(self.model, src, src_len, rows, coef, cfg.rescore_chunk)
        # 5. Update.
        return {"loss": loss, "reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()),
                "candidates": len(cand), **self._update()}

    def coefficients(self, cand: Samples, rewards, src, src_len, references) -> torch.Tensor:
        cfg, B = self.cfg, src.shape[0]
        if cfg.objective == "beam":
            return objectives.beam(rewards, cand.scores, cand.owner, B)
        if cfg.objective == "mrt":
            return objectives.mrt(rewards, cand.scores, cand.owner, B, cfg.mrt_alpha)
        greedy_rewards = None
        if cfg.baseline == "greedy":  # self-critical: the greedy decode's reward is the baseline
            best = greedy(self.model, src, src_len, cfg.max_len)
            greedy_rewards = torch.tensor(self.reward(self.detokenize(best.tokens), references),
                                          dtype=torch.float64, device=self.device)  # (B,)
        return objectives.reinforce(rewards, cand.owner, B, cfg.baseline, greedy_rewards)

    def _reference_rows(self, idx: list[int]) -> Samples:
        owner = [b for b, i in enumerate(idx) for _ in self.ref_ids[i]]
        tgt = pad_targets([r for i in idx for r in self.ref_ids[i]], self.device)  # (R, T)
        owner = torch.tensor(owner, device=self.device)
        return Samples(tgt, (tgt != 0).sum(1), owner, torch.zeros(len(owner), device=self.device))

    def _update(self) -> dict:
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.clip_norm if self.cfg.clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
        self.optimizer.step()
        return {"grad_norm": norm}

    # ------------------------------------------------------------------ validation
    @torch.inference_mode()
    def validate(self, data: Dataset | None = None, batch_size: int = 256) -> dict:
        data = data or self.valid
        n = len(data) if not self.cfg.valid_size else min(self.cfg.valid_size, len(data))
        self.model.eval()
        hyps = []
        for start in range(0, n, batch_size):
            src, src_len = pad_batch([self.src_vocab.encode(s) for s in data.sources[start:min(n, start + batch_size)]],
                                     self.device)
            s = beam_search(self.model, src, src_len, self.cfg.eval_beam, self.cfg.max_len)
            first = torch.ones(len(s), dtype=torch.bool)
            first[1:] = s.owner[1:] != s.owner[:-1]  # beam rows come best first per source
            hyps += [self.tgt_vocab.decode(r) for r in s.tokens[first].tolist()]
        refs = data.references[:n]
        scores = evaluate(hyps, refs)
        scores["reward"] = sum(self.reward([" ".join(h) for h in hyps], [[" ".join(r) for r in rs] for rs in refs])) / n
        return scores

    # ------------------------------------------------------------------ the run
    def log(self, row: dict) -> None:
        with open(self.save_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def eval_and_log(self, phase: str) -> dict:
        scores = self.validate()
        self.log({"step": self.step, "phase": "eval", "after": phase, **scores})
        return scores

    def run(self) -> dict:
        cfg = self.cfg
        self.save_dir.mkdir(parents=True, exist_ok=True)
        total = cfg.mle_steps + cfg.rl_steps
        bar = tqdm(total=total, initial=self.step, desc="train", dynamic_ncols=True, mininterval=1.0)
        for phase, steps, lr, fn in (("mle", cfg.mle_steps, cfg.lr, self.mle_step),
                                     ("rl", cfg.rl_steps, cfg.rl_lr, self.rl_step)):
            if steps == 0:
                continue
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            start, rewards, scores = time.perf_counter(), [], None
            for _ in range(steps):
                self.step += 1
                row = fn()
                rewards += [row["reward_mean"]] if "reward_mean" in row else []
                self.log({"step": self.step, "phase": phase, **row})
                bar.update(1)
                bar.set_postfix({k: f"{v:.3g}" for k, v in row.items() if k in ("loss", "reward_mean")})
                if self.step % cfg.eval_every == 0:
                    scores = self.eval_and_log(phase)
                    bar.write(f"step {self.step} [{phase}] valid " + _fmt(scores))
            elapsed = time.perf_counter() - start
            if scores is None or self.step % cfg.eval_every != 0:
                scores = self.eval_and_log(phase)
            self.summary[phase] = {**scores, "steps_per_s": steps / elapsed,
                                   "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan")}
            self.save(phase, scores)
        bar.close()
        self.summary["peak_memory_mb"] = peak_memory_mb(self.device)
        return self.summary

    def save(self, phase: str, scores: dict) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "phase": phase, "config": asdict(self.cfg), "model_config": dict(self.model.config),
                 "src_vocab": self.src_vocab.itos, "tgt_vocab": self.tgt_vocab.itos}
        self.checkpoints.save(state, self.step, metric=scores.get("word_acc"))


def _fmt(scores: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in scores.items() if isinstance(v, float))


def summary_table(summary: dict) -> str:
    """The closing table: validation after the warm start and after RL, side by side."""
    cols = [p for p in ("mle", "rl") if p in summary]
    rows = [("word accuracy", "word_acc", "{:.2%}"), ("word error rate", "wer", "{:.2%}"),
            ("phoneme error rate", "per", "{:.2%}"), ("valid reward", "reward", "{:.4f}"),
            ("train reward (mean)", "reward_mean", "{:.4f}"), ("steps/s", "steps_per_s", "{:.2f}")]
    lines = [f"{'':22}" + "".join(f"{'end of ' + c.upper():>16}" for c in cols)]
    for label, key, fmt in rows:
        cells = []
        for c in cols:
            v = summary[c].get(key, float("nan"))
            cells.append(f"{'-' if v != v else fmt.format(v):>16}")
        lines.append(f"{label:22}" + "".join(cells))
    lines.append(f"{'peak memory':22}{summary['peak_memory_mb']:>15.0f}M")
    return "\n".join(lines)
