"""A training run: the trainer's steps in order (MLE, then RL), with validation, checkpoints, metrics rows and
progress lines when each is due, the test split at the end, and a clean stop on a signal or a failing reward.

`Run` owns the `Trainer` (the steps, model, optimizer and data streams), one `RunState` (what the run has done)
and the parts it holds: the checkpoints, the metrics log, the MLE plateau schedule, --rl-from-best and the
--compare-mle control (`mlephase`). It gives each part what it uses, never itself: no part calls back into the
run. Its interface is a recipe's: `setup` (what the run continues from), `train`, `save` and `cleanup`. A
checkpoint is the trainer's `state_dict` (the model, the optimizer and its streams), the state's, the plateau
schedule's and the run's own few fields, composed in one fixed order (`runstate.KEYS`) by its `runparts.Saver`,
a part it shares with the --compare-mle control, as it shares its step (`runparts.take_step`) and validation.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from ..rewards import RewardError
from ..system import distributed, fsdp, memory
from .checkpoint import CheckpointManager
from .evaluation import test_beams, test_scores
from .mlephase import CONTINUED, MleContinued, Plateau, budget_clock, start_from_best
from .report import ProgressLines, fmt_scores, peak_memory_mb
from .rundir import MetricsLog
from .runparts import Saver, take_step, validated
from .runstate import GracefulStop, Interrupted, RunState
from .trainer import Trainer


class Run:
    """A run of `trainer`'s steps (see the module docstring); `Run.assemble` builds one from a configuration."""

    def __init__(self, trainer: Trainer):
        cfg = trainer.cfg
        self.trainer = trainer
        self.save_dir = Path(cfg.save_dir)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.best_key = cfg.best_metric  # resolved by the command (auto -> the task's main metric)
        lower = {m.key for m in trainer.task.metrics if not m.higher_is_better}
        self.checkpoints = CheckpointManager(self.save_dir, keep_last=cfg.keep_last,
                                             higher_is_better=self.best_key not in lower)
        self.state = RunState(mle_end=cfg.mle_steps)
        self.plateau = Plateau(cfg.lr, cfg.lr_decay, cfg.patience, cfg.min_lr, self.checkpoints.higher_is_better)
        self.comparing = cfg.compare_mle and cfg.rl_steps > 0
        self.is_main = distributed.rank() == 0  # the one process that logs, draws the bar and saves
        self.metrics = MetricsLog(self.save_dir / "metrics.jsonl", enabled=self.is_main)
        self.saver = Saver(trainer, self.state, self.plateau, self.metrics, self.checkpoints, self.is_main)
        self.comparison = MleContinued(trainer, self.state, self.saver, self.metrics, speaks=self.is_main)
        self.own_model = False  # twophase.fit(model=...): a model its task does not build (--export reads it back so)

    @classmethod
    def assemble(cls, cfg, task, model, reward, device: torch.device, teacher=None) -> "Run":
        """The run of this configuration; `teacher`: --objective distill's frozen teacher."""
        return cls(Trainer(cfg, task, model, reward, device, teacher))

    def setup(self, saved: dict | None = None, base_model: dict | None = None) -> None:
        """Before the first step: the frozen base the saved parameters need (--lora-r: resume.record's), recorded
        in every checkpoint, and the checkpoint the run continues from (--resume), where there is one."""
        self.saver.base_model = base_model
        if saved is not None:
            self.load_state_dict(saved)

    def cleanup(self) -> None:
        """After the run, whether it ended or failed: the metrics log's mirror (--tensorboard) closed."""
        if self.metrics.mirror is not None:
            self.metrics.mirror.close()

    def log(self, row: dict) -> None:
        self.metrics.write(row)  # only the main process's log writes

    def phase_at(self, step: int) -> str:
        """Phase of the step after `step` steps have been taken."""
        return "mle" if step < self.state.mle_end else "rl"

    @property
    def total(self) -> int:
        """The run's last step: the end of MLE (--mle-steps, or earlier where --lr-decay stopped it) plus RL's."""
        return self.state.mle_end + self.trainer.cfg.rl_steps

    def validate(self) -> dict:
        return validated(self.trainer, self.state.step)

    # ------------------------------------------------------------------ one step
    def train_step(self, phase: str) -> dict:
        """One step of the run's own (mle or rl; see `runparts.take_step`), --profile-memory's profile of it."""
        cfg = self.trainer.cfg
        return take_step(self.trainer, self.state, self.saver, phase,
                         self.plateau.lr if phase == "mle" else cfg.rl_lr, profiled=cfg.profile_memory)

    # ------------------------------------------------------------------ the run
    def train(self) -> dict:
        """The run's steps from where it stands to the end (then the comparison and the test split, each when
        asked for); the closing table's summary."""
        cfg, state = self.trainer.cfg, self.state
        total = self.total
        # disable=None: a bar on a terminal, nothing in log files; only the main process draws one.
        bar = tqdm(total=total, initial=state.step, desc="train", dynamic_ncols=True, mininterval=1.0,
                   disable=None if self.is_main else True)
        # Without a bar (stdout a file or a pipe), --log-every lines show the run moving between validations.
        progress = ProgressLines(cfg.log_every, total, state.step, self.metrics.elapsed) \
            if self.is_main and bar.disable else None
        try:
            with GracefulStop(repeats_within=2.0 if distributed.world() > 1 else 0.0) as stop, bar:
                # Every process must stop after the same step, whichever got the signal first (one all-reduce).
                if state.step == state.mle_end and self.comparing and self.comparison.branch is None:
                    self.comparison.save_branch()  # no MLE steps, or a run resumed at the end of MLE
                while state.step < self.total and distributed.agree_to_stop(stop.received) is None:
                    phase = self.phase_at(state.step)
                    stop.began(state.step + 1)
                    row = self.train_step(phase)
                    state.step += 1
                    self.log({"step": state.step, "phase": phase, **row})
                    bar.update(1)
                    bar.set_postfix({k: f"{v:.3g}" for k, v in row.items()
                                     if k in ("loss", "reward_mean") and isinstance(v, float)})
                    line = progress.line(state.step, phase, row, self.metrics.elapsed) if progress else None
                    if line:
                        print(line, flush=True)
                    self.after_step(phase, bar)
                    if self.total != total:  # the MLE phase stopped early
                        total = bar.total = self.total
                        if progress:
                            progress.total = total
                signum = distributed.agree_to_stop(stop.received)  # also a signal during the last step
                if signum is None and self.comparing and not state.compared:
                    stopped = self.comparison.compare(stop)
                    if stopped is not None:
                        raise Interrupted(128 + stopped, f"stopped by signal {stopped} during the comparison with "
                                                         f"MLE continued; {self.save_dir / 'checkpoint_last.pt'} "
                                                         "holds the end of RL (--resume redoes the comparison)")
                if signum is None:
                    self.evaluate_test()
        except RewardError as err:
            raise self.saved_after(err) from None
        if signum is not None:
            self.save()
            raise Interrupted(128 + signum, f"stopped by signal {signum} after step {state.step}; "
                                            f"saved {self.save_dir / 'checkpoint_last.pt'} (--resume continues)")
        device = self.trainer.device
        state.summary["peak_memory_mb"] = peak_memory_mb(device)  # CUDA's allocated, or the RSS
        state.summary.update(memory.overall_mb(device))  # and on CUDA the reserved: the closing table's rows
        return state.summary

    def saved_after(self, err: RewardError) -> RewardError:
        """A reward that fails after the start-up check (during RL or a validation): save checkpoint_last.pt at
        the steps taken so far, so fixing the plug-in and --resume loses nothing, and report both in one line.
        With several processes the others wait in a collective the failing one never joins, so nothing is saved
        there (torchrun stops them)."""
        if distributed.world() > 1:
            return err
        self.comparison.restore_final()  # failed during the comparison: the RL model is the one to keep
        self.save()
        return RewardError(f"{err} (after step {self.state.step}; saved {self.save_dir / 'checkpoint_last.pt'}, "
                           "--resume continues once the reward is fixed)")

    def evaluate_test(self) -> None:
        """The test split, once per model: the final one (the summary's "test"), and after --compare-mle the
        end-of-MLE and continued-MLE models too; one "test" metrics row each, naming the model."""
        t, state = self.trainer, self.state
        if not t.task.test:
            return
        cfg = t.cfg
        final = "rl" if cfg.rl_steps > 0 else "mle"
        # the end-of-MLE model is the run's starting point where no MLE step ran (--mle-steps 0): not a model
        # the run made, so it is not tested as one
        tests = {name: self.comparison.test_model(name, params)
                 for name, params in self.comparison.compared_models().items()
                 if name != "mle" or state.mle_end > 0}
        with fsdp.gathered(t.model):
            tests[final] = test_scores(t.model, t.task, t.task.test, t.reward, test_beams(cfg), cfg.max_len, t.device)
        state.summary["test"], state.summary["tests"] = tests[final], tests
        steps = {"mle": state.mle_end, final: state.step,  # each row carries its model's step
                 CONTINUED: state.mle_end + state.summary.get(CONTINUED, {}).get("steps", 0)}
        for name, scores in tests.items():
            self.log({"step": steps[name], "phase": "test", "model": name, **scores})
            if self.is_main:
                tqdm.write(f"step {state.step} test ({name}) " + fmt_scores(scores, self.trainer.task.metrics))

    def after_step(self, phase: str, bar) -> None:
        """Validation (and checkpoint_best.pt when it improves, and the --lr-decay schedule during MLE), phase
        summary and checkpoints, each when due."""
        cfg, state = self.trainer.cfg, self.state
        scores = None
        if state.step % cfg.eval_every == 0 or state.step in (state.mle_end, self.total):
            scores = self.validate()
            self.log({"step": state.step, "phase": "eval", "after": phase, **scores,
                      "train_s": round(state.stats[phase].get(budget_clock(self.trainer.device), 0.0), 3)})
            if self.is_main:
                bar.write(f"step {state.step} [{phase}] valid " + fmt_scores(scores, self.trainer.task.metrics))
            self.save_best(scores)
            if phase == "mle":
                self.schedule(scores, bar)
        if state.step == state.mle_end and phase == "mle" and cfg.rl_from_best:
            scores = start_from_best(self.trainer, state, self.checkpoints, self.best_key, scores, self.log,
                                     bar.write if self.is_main else None)
        phase_end = state.step in (state.mle_end, self.total)
        if phase_end:
            st = state.stats[phase]
            state.summary[phase] = {**scores, "steps_per_s": st["steps"] / max(st["seconds"], 1e-9),
                                    "skipped": st["skipped"], "steps": st["steps"], "seconds": st["seconds"],
                                    "cpu_seconds": st.get("cpu_seconds", math.nan),
                                    "reward_mean": math.nan if phase != "rl" else  # None: no step scored anything
                                    st["reward_sum"] / st["reward_steps"] if st["reward_steps"] else None}
        if phase_end or state.step % cfg.save_every == 0:
            state.log_step = state.step
            self.save()
        if state.step == state.mle_end and self.comparing:
            self.comparison.save_branch()

    def schedule(self, scores: dict, bar) -> None:
        """--lr-decay: decay the MLE rate on a plateau, or end the MLE phase here."""
        action = self.plateau.update(scores.get(self.best_key))
        if action is None:
            return
        step = self.state.step
        if action == "stop":
            self.state.mle_end = step
        self.log({"step": step, "phase": "schedule", "action": action, "lr": self.plateau.lr})
        if self.is_main:
            patience = self.trainer.cfg.patience
            bar.write(f"step {step} [mle] " + (f"no better {self.best_key} in {patience} validations: lr "
                                               f"{self.plateau.lr:g}" if action == "decay" else
                                               f"MLE phase ends ({self.best_key} no better at the lowest rate)"))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The run's checkpoint (`runparts.Saver.state_dict`); a collective: every process calls it."""
        return self.saver.state_dict()

    def save(self, best: bool = False, crash: bool = False, path=None, phase: str | None = None) -> None:
        """checkpoint_last.pt and a step checkpoint, or the file asked for (`runparts.Saver.save`)."""
        self.saver.save(best=best, crash=crash, path=path, phase=phase)

    def save_best(self, scores: dict) -> None:
        """checkpoint_best.pt at every validation that improves the --best-metric score. Every process calls this
        (the scores are reduced, so all take the same decision) and keeps `best` for the next comparison."""
        metric = scores.get(self.best_key)
        if self.checkpoints.improves(metric):
            self.checkpoints.best, self.state.best_step = float(metric), self.state.step
            self.state.best_scores = dict(scores)  # --rl-from-best reports them for the model it restores
            self.save(best=True)

    def load_state_dict(self, saved: dict) -> None:
        """Continue exactly where `saved` was saved: the run's state, and the trainer's parameters, optimizer,
        data order and every random stream."""
        s, cfg = self.state, self.trainer.cfg
        s.load_state_dict(saved)
        self.checkpoints.best = saved.get("best_metric")
        self.metrics.resume_at(saved.get("elapsed_s", 0.0))
        if "schedule" in saved:  # saved by a version without --lr-decay: the rate starts afresh
            self.plateau.load_state_dict(saved["schedule"])
        if cfg.lr_decay >= 1:  # a constant rate: this run's --lr, as before the schedule existed
            self.plateau.lr = cfg.lr
        if not self.plateau.stopped:  # an MLE phase the schedule ended early stays ended; else --mle-steps decides
            s.mle_end = cfg.mle_steps
        if s.step < self.total:  # more steps asked for: a comparison after the shorter run no longer applies
            s.compared, s.log_step = False, s.step
        self.trainer.load_state_dict(saved)
