"""The run: the steps of both phases in order, with validation, checkpoints, metrics rows and progress lines
when each is due, the test split at the end, and a clean stop on a signal or a failing reward.

`RunLoop` is the running half of `Trainer` (which provides the steps, model, data, checkpoints and logs).
"""
from __future__ import annotations

import math
import sys
import time

import torch
from tqdm import tqdm

from . import distributed, fsdp, peaks
from .. import oom
from ..protocol import ModelError
from ..rewards import RewardError
from .evaluation import test_beams, test_scores
from .interrupt import GracefulStop, Interrupted
from .profiling import StepProfiler
from .report import ProgressLines, fmt_scores, peak_memory_mb


class RunLoop:
    def log(self, row: dict) -> None:
        self.metrics.write(row)  # only the main process's log writes

    def phase_at(self, step: int) -> str:
        """Phase of the step after `step` steps have been taken."""
        return "mle" if step < self.mle_end else "rl"

    @property
    def total(self) -> int:
        """The run's last step: the end of MLE (--mle-steps, or earlier where --lr-decay stopped it) plus RL's."""
        return self.mle_end + self.cfg.rl_steps

    def train_step(self, phase: str) -> dict:
        """One step of the phase (mle, rl or mle-continued, the comparison's); a non-finite loss or gradient skips
        the update (counted, see _update)."""
        lr = self.plateau.lr if phase == "mle" else self.cfg.rl_lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.cfg.profile_memory and phase != "mle-continued":  # the profile is of the run's own steps
            self.profiler = StepProfiler(self.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        self.step_counts = {}  # phase two's decoded prefix-tree nodes and candidate token positions
        row = None  # None after an out-of-memory error
        try:
            row = self.rl_step() if phase == "rl" else self.mle_step()
        except ModelError as err:  # NaN log-probabilities, say: the model and the step, never a dropped source
            raise ModelError(f"step {self.step + 1} [{phase}]: {err}") from None
        except Exception as err:  # noqa: BLE001  (any error but out-of-memory is raised again)
            if not oom.is_out_of_memory(err) or distributed.world() > 1:
                raise  # several processes: one cannot skip alone, the others would wait for it in the all-reduce
        if row is None:  # out of the except block: the failed step's tensors, held by its traceback, are gone
            row = self.skip_out_of_memory(phase)
        if self.cfg.rescore_chunk == "auto":
            row["chunk"] = self.last_chunk
        row["lr"] = lr
        if self.step_counts.get("positions"):  # phase two decoded this many prefixes for this many positions
            row["prefix_nodes"], row["prefix_positions"] = self.step_counts["nodes"], self.step_counts["positions"]
        if self.profiler is not None:
            self.report_profile(phase)
        stats = self.stats[phase]
        stats["seconds"] += time.perf_counter() - start
        # this process's CPU time: --compare-mle's budget on CPU, which other processes on the machine do not tilt
        stats["cpu_seconds"] = stats.get("cpu_seconds", 0.0) + time.process_time() - cpu_start
        stats["steps"] += 1
        stats["skipped"] += row["skipped"]
        if row.get("reward_mean") is not None:  # None: no candidate of the step was scored
            stats["reward_sum"] += row["reward_mean"]
            stats["reward_steps"] += 1
        return row

    def skip_out_of_memory(self, phase: str) -> dict:
        """Out of memory outside phase two's chunks (those halve themselves and retry): drop this batch with a
        memory summary on stderr, count it, and go on with the next."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            summary = torch.cuda.memory_summary(self.device, abbreviated=True)
            oom.release()
        else:
            summary = f"peak memory {peak_memory_mb(self.device):.0f} MB"
        self.stats[phase]["out_of_memory"] += 1
        print(f"step {self.step + 1} [{phase}]: out of memory, batch skipped "
              f"({self.stats[phase]['out_of_memory']} so far)\n{summary}", file=sys.stderr, flush=True)
        return {"loss": None, "skipped": 1, "out_of_memory": 1}  # None: metrics.jsonl stays strict JSON

    def report_profile(self, phase: str) -> None:
        """--profile-memory: every step to memory_profile.jsonl, the first of each phase also printed."""
        if self.is_main:
            self.profiler.write(self.save_dir / "memory_profile.jsonl", self.step + 1, phase,
                                echo=self.stats[phase]["steps"] == 0)
        self.profiler = None

    def run(self) -> dict:
        cfg = self.cfg
        total = self.total
        # disable=None: a bar on a terminal, nothing in log files; only the main process draws one.
        bar = tqdm(total=total, initial=self.step, desc="train", dynamic_ncols=True, mininterval=1.0,
                   disable=None if self.is_main else True)
        # Without a bar (stdout a file or a pipe), --log-every lines show the run moving between validations.
        progress = ProgressLines(cfg.log_every, total, self.step, self.metrics.elapsed) \
            if self.is_main and bar.disable else None
        try:
            with GracefulStop(repeats_within=2.0 if distributed.world() > 1 else 0.0) as stop, bar:
                # Every process must stop after the same step, whichever got the signal first (one all-reduce).
                if self.step == self.mle_end and self.comparing and self.branch is None:
                    self.save_branch()  # no MLE steps, or a run resumed at the end of MLE (an MLE-only run's)
                while self.step < self.total and distributed.agree_to_stop(stop.received) is None:
                    phase = self.phase_at(self.step)
                    row = self.train_step(phase)
                    self.step += 1
                    self.log({"step": self.step, "phase": phase, **row})
                    bar.update(1)
                    bar.set_postfix({k: f"{v:.3g}" for k, v in row.items()
                                     if k in ("loss", "reward_mean") and isinstance(v, float)})
                    line = progress.line(self.step, phase, row, self.metrics.elapsed) if progress else None
                    if line:
                        print(line, flush=True)
                    self.after_step(phase, bar)
                    if self.total != total:  # the MLE phase stopped early
                        total = bar.total = self.total
                        if progress:
                            progress.total = total
                signum = distributed.agree_to_stop(stop.received)  # also a signal during the last step
                if signum is None and self.comparing and not self.compared:
                    self.compare(stop)
                if signum is None:
                    self.evaluate_test()
        except RewardError as err:
            raise self.saved_after(err) from None
        if signum is not None:
            self.save()
            raise Interrupted(128 + signum, f"stopped by signal {signum} after step {self.step}; "
                                            f"saved {self.save_dir / 'checkpoint_last.pt'} (--resume continues)")
        self.summary["peak_memory_mb"] = peak_memory_mb(self.device)  # CUDA's allocated, or the RSS
        self.summary.update(peaks.overall_mb(self.device))  # and on CUDA the reserved: the closing table's rows
        return self.summary

    def saved_after(self, err: RewardError) -> RewardError:
        """A reward that fails after the start-up check (during RL or a validation): save checkpoint_last.pt at
        the steps taken so far, so fixing the plug-in and --resume loses nothing, and report both in one line.
        With several processes the others wait in a collective the failing one never joins, so nothing is saved
        there (torchrun stops them)."""
        if distributed.world() > 1:
            return err
        self.restore_final()  # failed during the comparison: the RL model is the one to keep
        self.save()
        return RewardError(f"{err} (after step {self.step}; saved {self.save_dir / 'checkpoint_last.pt'}, "
                           "--resume continues once the reward is fixed)")

    def evaluate_test(self) -> None:
        """The test split, once per model: the final one (the summary's "test"), and after --compare-mle the
        end-of-MLE and continued-MLE models too; one "test" metrics row each, naming the model."""
        if self.test is None:
            return
        cfg = self.cfg
        final = "rl" if cfg.rl_steps > 0 else "mle"
        tests = {name: self.test_model(name, params) for name, params in self.compared_models().items()}
        with fsdp.gathered(self.model):
            tests[final] = test_scores(self.model, self.task, self.test, self.reward, test_beams(cfg), cfg.max_len,
                                       self.device)
        self.summary["test"], self.summary["tests"] = tests[final], tests
        steps = {"mle": self.mle_end, final: self.step,  # each row carries its model's step
                 "mle-continued": self.mle_end + self.summary.get("mle-continued", {}).get("steps", 0)}
        for name, scores in tests.items():
            self.log({"step": steps[name], "phase": "test", "model": name, **scores})
            if self.is_main:
                tqdm.write(f"step {self.step} test ({name}) " + fmt_scores(scores))

    def after_step(self, phase: str, bar) -> None:
        """Validation (and checkpoint_best.pt when it improves, and the --lr-decay schedule during MLE), phase
        summary and checkpoints, each when due."""
        cfg = self.cfg
        scores = None
        if self.step % cfg.eval_every == 0 or self.step in (self.mle_end, self.total):
            scores = self.validate()
            self.log({"step": self.step, "phase": "eval", "after": phase, **scores,
                      "train_s": round(self.stats[phase].get(self.budget_clock(), 0.0), 3)})
            if self.is_main:
                bar.write(f"step {self.step} [{phase}] valid " + fmt_scores(scores))
            self.save_best(scores)
            if phase == "mle":
                self.schedule(scores, bar)
        if self.step == self.mle_end and phase == "mle" and cfg.rl_from_best:
            scores = self.restore_best_mle(scores, bar)
        phase_end = self.step in (self.mle_end, self.total)
        if phase_end:
            st = self.stats[phase]
            self.summary[phase] = {**scores, "steps_per_s": st["steps"] / max(st["seconds"], 1e-9),
                                   "skipped": st["skipped"], "steps": st["steps"], "seconds": st["seconds"],
                                   "cpu_seconds": st.get("cpu_seconds", math.nan),
                                   "reward_mean": math.nan if phase != "rl" else  # None: no step scored anything
                                   st["reward_sum"] / st["reward_steps"] if st["reward_steps"] else None}
        if phase_end or self.step % cfg.save_every == 0:
            self.log_step = self.step
            self.save()
        if self.step == self.mle_end and self.comparing:
            self.save_branch()

    def schedule(self, scores: dict, bar) -> None:
        """--lr-decay: decay the MLE rate on a plateau, or end the MLE phase here."""
        action = self.plateau.update(scores.get(self.best_key))
        if action is None:
            return
        if action == "stop":
            self.mle_end = self.step
        self.log({"step": self.step, "phase": "schedule", "action": action, "lr": self.plateau.lr})
        if self.is_main:
            bar.write(f"step {self.step} [mle] " + (f"no better {self.best_key} in {self.cfg.patience} "
                                                     f"validations: lr {self.plateau.lr:g}" if action == "decay"
                                                     else f"MLE phase ends ({self.best_key} no better at the "
                                                          f"lowest rate)"))
