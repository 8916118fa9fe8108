"""The MLE phase's controls, parts a `run.Run` holds, each given what it uses: when the phase ends (`Plateau`,
--lr-decay), where RL starts (`start_from_best`, --rl-from-best), and the control RL has to beat
(`MleContinued`, --compare-mle).

--compare-mle: after the RL phase, the run goes back to the end of the MLE phase (parameters, optimizer, data
order, random streams) and continues MLE at --rl-lr for as long as the RL phase's training steps took
(validation and checkpoints excluded), so both branches spend the same time from the same start. Its validations
and test are logged with phase "mle-continued" and reported beside RL; the run then returns to the RL model,
which stays the run's final model (checkpoint_last.pt; checkpoint_best.pt is chosen among MLE and RL
validations only). The continued model is kept in checkpoint_mle_continued.pt. The branch point is saved as
checkpoint_mle_end.pt, so a run resumed during RL still compares. The comparison itself writes no
checkpoint_last.pt: a run stopped during it resumes from the end of RL and redoes it. Under torchrun every
process runs it in lockstep: the time budget is the slowest process's, and each step continues while any
process has budget left.
"""
from __future__ import annotations

import math
import time

from ..system import distributed, fsdp
from .checkpoint import CheckpointError, host_copy, load
from .evaluation import test_beams, test_scores
from ..system.fsdp import saved_state
from .report import fmt_scores
from .runparts import Saver, take_step, validated

CONTINUED = "mle-continued"


class Plateau:
    """--lr-decay / --patience / --min-lr over the --best-metric score of each MLE validation: the rate decays
    when validation stops improving, and the warm start ends once it would decay below the floor, so RL starts
    where more MLE no longer helps.

    After `patience` validations in a row that do not beat the best so far, lr *= decay (and the count restarts);
    a decay that would take lr below `min_lr` ends the MLE phase instead. decay 1 never decays nor stops. Plain
    data (floats and ints), so it rides in the checkpoint and a resumed run decays and stops at the same
    validations as an uninterrupted one."""

    def __init__(self, lr: float, decay: float, patience: int, min_lr: float, higher_is_better: bool):
        self.lr, self.decay, self.patience, self.min_lr = lr, decay, patience, min_lr
        self.higher_is_better = higher_is_better
        self.best: float | None = None
        self.bad = 0  # validations since the last improvement (or the last decay)
        self.decays = 0
        self.stopped = False

    def _improves(self, score: float) -> bool:
        if self.best is None:
            return True
        return score > self.best if self.higher_is_better else score < self.best

    def update(self, score: float | None) -> str | None:
        """One MLE validation's score; returns "decay" or "stop" when the schedule acts, else None. A NaN score
        (a diverged model) counts as a validation without improvement."""
        if self.stopped or self.decay >= 1:
            return None
        if score is not None and not math.isnan(score) and self._improves(score):
            self.best, self.bad = float(score), 0
            return None
        self.bad += 1
        if self.bad < self.patience:
            return None
        self.bad = 0
        if self.lr * self.decay < self.min_lr * (1 - 1e-9):  # a float's rounding must not cost the last decay
            self.stopped = True
            return "stop"
        self.lr *= self.decay
        self.decays += 1
        return "decay"

    def state_dict(self) -> dict:
        return {"lr": self.lr, "best": self.best, "bad": self.bad, "decays": self.decays, "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        self.lr, self.best, self.bad = float(state["lr"]), state["best"], int(state["bad"])
        self.decays, self.stopped = int(state["decays"]), bool(state["stopped"])


def start_from_best(trainer, state, checkpoints, best_key: str, scores: dict, log, write) -> dict:
    """--rl-from-best, at the end of MLE: the best MLE validation's parameters and optimizer state (those of
    checkpoint_best.pt, written at that validation: `checkpoints.best_path`) back in `trainer`; returns its scores
    (the latest validation's, `scores`, where the latest is the best). With --lr-decay the phase ends after
    validations that did not improve, so its last parameters are, by construction, not its best (Bunel et al.
    start RL from the best validation epoch). The data order and random streams go on from the last step;
    checkpoint_last.pt, checkpoint_mle_end.pt and the "end of MLE" column then hold that model and its validation
    scores. `log`: the metrics row's writer; `write`: the progress line's (None: a process that prints nothing).
    Under torchrun every process reads checkpoint_best.pt, so the save directory must be shared by them."""
    if state.best_step is None or state.best_step >= state.step:
        return scores
    trainer.load_weights(load(checkpoints.best_path))  # on the CPU; loading copies it onto the device
    log({"step": state.step, "phase": "schedule", "action": "restore_best", "from_step": state.best_step})
    if write is not None:
        write(f"step {state.step} [mle] RL starts from the best MLE validation (step {state.best_step}, "
              f"{best_key} {checkpoints.best:.4f})")
    return dict(state.best_scores) if state.best_scores is not None else scores


def budget_clock(device) -> str:
    """The stats field --compare-mle's budget is counted in: on CPU this process's CPU time (a shared machine's
    other processes slow RL's steps and the continuation's unequally in wall time), else wall time (a GPU's work
    is not the process's CPU time)."""
    return "cpu_seconds" if device.type == "cpu" else "seconds"


class MleContinued:
    """--compare-mle's branch (see the module docstring): its branch point, the RL model kept aside while it
    runs, and the models it tested. It is given what it runs: the `trainer` it winds back and forth, the run's
    `state` (its steps, statistics and summary), the run's checkpoint (`saver`: its folder, what it composes and
    writes), the `metrics` log its rows go to; `speaks`: whether this process prints (the main one). Its steps
    and validations are the run's own functions (`runparts.take_step`, `runparts.validated`)."""

    def __init__(self, trainer, state, saver: Saver, metrics, speaks: bool):
        self.trainer, self.state, self.saver, self.metrics, self.speaks = trainer, state, saver, metrics, speaks
        self.save_dir = saver.save_dir
        self.branch: dict | None = None  # the end-of-MLE snapshot
        self.final: dict | None = None  # the RL model, set aside during the comparison
        self.test_models: dict | None = None  # name -> parameters of the compared models

    @property
    def branch_path(self):
        return self.save_dir / "checkpoint_mle_end.pt"

    @property
    def continued_path(self):
        return self.save_dir / "checkpoint_mle_continued.pt"

    def save_branch(self) -> None:
        """At the end of the MLE phase: keep the branch point in memory and in checkpoint_mle_end.pt."""
        self.branch = self.trainer.snapshot()
        self.saver.save(path=self.branch_path)

    def load_branch(self) -> dict | None:
        """The branch point saved by an earlier process of this run (resumed after it), this process's streams."""
        try:
            state = load(self.branch_path)  # on the CPU: restore copies it into the model on its device
        except CheckpointError:
            return None
        saved = state.get("rank_rngs") or [{"rng": state["rng"], "sampling_rng": state["sampling_rng"]}]
        mine = saved[distributed.rank()] if len(saved) == distributed.world() else saved[0]
        return {**state, **mine}

    def compare(self, stop) -> int | None:
        """Run the continued-MLE branch, then return to the RL model; the signal (its number) every process
        agreed to stop on during it, where one came (then the RL model stays aside, and nothing is saved)."""
        trainer, state = self.trainer, self.state
        branch = self.branch if self.branch is not None else self.load_branch()
        if branch is None:
            if self.speaks:
                print(f"note: no {self.branch_path.name} (the run began before it was saved): MLE continued is "
                      "not compared", flush=True)
            return None
        clock = budget_clock(trainer.device)
        budget = distributed.reduce_max(state.stats["rl"].get(clock, 0.0))  # the slowest process's RL time
        self.final = trainer.snapshot()
        trainer.restore(branch)
        state.stats[CONTINUED] = {"steps": 0, "seconds": 0.0, "cpu_seconds": 0.0, "skipped": 0, "out_of_memory": 0,
                                  "reward_sum": 0.0, "reward_steps": 0}
        if self.speaks:
            print(f"comparison: MLE continued from step {state.mle_end} at lr {trainer.cfg.rl_lr:g} for "
                  f"{budget:.1f} s of training steps ({'CPU' if clock == 'cpu_seconds' else 'wall'} time, the RL "
                  "phase's)", flush=True)
        scores, signum = self._continue(budget, clock, stop)
        if signum is not None:
            return signum
        st = state.stats[CONTINUED]
        state.summary[CONTINUED] = {**scores, "steps_per_s": st["steps"] / max(st["seconds"], 1e-9),
                                    "skipped": st["skipped"], "steps": st["steps"], "seconds": st["seconds"],
                                    "cpu_seconds": st["cpu_seconds"]}
        self.test_models = {"mle": branch["model"], CONTINUED: host_copy(saved_state(trainer.model))}
        self.saver.save(path=self.continued_path, phase=CONTINUED)
        trainer.restore(self.final)
        self.final, state.compared = None, True
        state.log_step = state.step + st["steps"]
        self.saver.save()  # checkpoint_last.pt: the RL model again, the comparison done
        return None

    def _continue(self, budget: float, clock: str, stop) -> tuple[dict | None, int | None]:
        """MLE steps at --rl-lr while any process has budget left; validation every --eval-every and at the end.
        Returns the last validation's scores, or the signal that stopped it."""
        state, start, k, scores = self.state, time.monotonic(), 0, None
        while True:
            signum = distributed.agree_to_stop(stop.received)
            if signum is not None:
                return None, signum
            if distributed.reduce_max(float(state.stats[CONTINUED][clock] < budget)) == 0:
                break
            stop.began(k + 1, "MLE-continued step")
            row = take_step(self.trainer, state, self.saver, CONTINUED, self.trainer.cfg.rl_lr)
            k += 1
            self.metrics.write({"step": state.mle_end + k, "phase": CONTINUED, "continued": k,  # from the branch
                                "since_branch_s": round(time.monotonic() - start, 3), **row})
            scores = None
            if k % self.trainer.cfg.eval_every == 0:
                scores = self._validate(k, start)
        return (scores if scores is not None else self._validate(k, start)), None

    def _validate(self, k: int, start: float) -> dict:
        state = self.state
        scores = validated(self.trainer, state.step)
        self.metrics.write({"step": state.mle_end + k, "phase": "eval", "after": CONTINUED, "continued": k,
                            "since_branch_s": round(time.monotonic() - start, 3), **scores,
                            "train_s": round(state.stats[CONTINUED].get(budget_clock(self.trainer.device), 0.0), 3)})
        if self.speaks:
            print(f"MLE continued +{k} steps valid " + fmt_scores(scores, self.trainer.task.metrics), flush=True)
        return scores

    def test_model(self, name: str, state_dict) -> dict:
        """Test scores of a compared model (its parameters loaded for the evaluation, then the final ones back)."""
        trainer = self.trainer
        final = host_copy(saved_state(trainer.model))
        fsdp.load_model(trainer.model, state_dict)
        try:
            with fsdp.gathered(trainer.model):
                return test_scores(trainer.model, trainer.task, trainer.task.test, trainer.reward,
                                   test_beams(trainer.cfg), trainer.cfg.max_len, trainer.device)
        finally:
            fsdp.load_model(trainer.model, final)

    def compared_models(self) -> dict:
        """name -> parameters of the models compared with the final one (none without a finished comparison);
        read back from their checkpoints when this process did not run the comparison (a resumed finished run)."""
        if not self.state.compared:
            return {}
        if self.test_models is None:
            try:
                self.test_models = {"mle": load(self.branch_path, mmap=True)["model"],
                                    CONTINUED: load(self.continued_path, mmap=True)["model"]}
            except CheckpointError:
                return {}
        return self.test_models

    def restore_final(self) -> None:
        """Before saving after a failure mid-comparison: the RL model goes back in place first."""
        if self.final is not None:
            self.trainer.restore(self.final)
            self.final = None
