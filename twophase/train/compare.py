"""--compare-mle: the control RL has to beat. After the RL phase, the run goes back to the end of the MLE phase
(parameters, optimizer, data order, random streams) and continues MLE at --rl-lr for as long as the RL phase's
training steps took (validation and checkpoints excluded), so both branches spend the same time from the same
start. Its validations and test are logged with phase "mle-continued" and reported beside RL; the run then returns
to the RL model, which stays the run's final model (checkpoint_last.pt; checkpoint_best.pt is chosen among MLE and
RL validations only). The continued model is kept in checkpoint_mle_continued.pt.

The branch point is saved as checkpoint_mle_end.pt, so a run resumed during RL still compares. The comparison
itself writes no checkpoint_last.pt: a run stopped during it resumes from the end of RL and redoes it. Under
torchrun every process runs it in lockstep: the time budget is the slowest process's, and each step continues
while any process has budget left.
"""
from __future__ import annotations

import time

from . import distributed, fsdp
from .checkpoint import CheckpointError, host_copy, load, rng_state, set_generator_state, set_rng_state
from .evaluation import test_beams, test_scores
from .interrupt import Interrupted
from .params import saved_state
from .report import fmt_scores

CONTINUED = "mle-continued"


class Comparison:
    """The comparison half of `Trainer` (it provides the steps, model, optimizer, stats, logs and save)."""

    @property
    def branch_path(self):
        return self.save_dir / "checkpoint_mle_end.pt"

    @property
    def continued_path(self):
        return self.save_dir / "checkpoint_mle_continued.pt"

    def snapshot(self) -> dict:
        """What the next training step depends on, copied into CPU memory (this process's random streams only):
        held for the whole RL phase, a copy on the device would cost it a second model and optimizer. Of the
        model, what a checkpoint holds (with LoRA the adapters alone: the frozen base does not change)."""
        state = {"model": saved_state(self.model), "optimizer": self.optimizer.state_dict(),
                 "mle_batches": self.mle_batches.state_dict(), "rl_batches": self.rl_batches.state_dict(),
                 "rng": rng_state(), "sampling_rng": self.sampling.get_state(),
                 **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}
        return host_copy(state)

    def restore(self, snap: dict) -> None:
        fsdp.load_model(self.model, snap["model"])  # a checkpoint of LoRA adapters holds them alone
        fsdp.load_optimizer(self.model, self.optimizer, snap["optimizer"])
        if self.scaler is not None and "scaler" in snap:
            self.scaler.load_state_dict(snap["scaler"])
        self.mle_batches.load_state_dict(snap["mle_batches"])
        self.rl_batches.load_state_dict(snap["rl_batches"])
        set_rng_state(snap["rng"])
        set_generator_state(self.sampling, snap["sampling_rng"])

    def save_branch(self) -> None:
        """At the end of the MLE phase: keep the branch point in memory and in checkpoint_mle_end.pt."""
        self.branch = self.snapshot()
        self.save(path=self.branch_path)

    def load_branch(self) -> dict | None:
        """The branch point saved by an earlier process of this run (resumed after it), this process's streams."""
        try:
            state = load(self.branch_path)  # on the CPU: restore copies it into the model on its device
        except CheckpointError:
            return None
        saved = state.get("rank_rngs") or [{"rng": state["rng"], "sampling_rng": state["sampling_rng"]}]
        mine = saved[distributed.rank()] if len(saved) == distributed.world() else saved[0]
        return {**state, **mine}

    def compare(self, stop) -> None:
        """Run the continued-MLE branch (see the module docstring), then return to the RL model."""
        cfg = self.cfg
        branch = self.branch if self.branch is not None else self.load_branch()
        if branch is None:
            if self.is_main:
                print(f"note: no {self.branch_path.name} (the run began before it was saved): MLE continued is "
                      "not compared", flush=True)
            return
        clock = self.budget_clock()
        budget = distributed.reduce_max(self.stats["rl"].get(clock, 0.0))  # the slowest process's RL time
        self.final = self.snapshot()
        self.restore(branch)
        self.stats[CONTINUED] = {"steps": 0, "seconds": 0.0, "cpu_seconds": 0.0, "skipped": 0, "out_of_memory": 0,
                                 "reward_sum": 0.0, "reward_steps": 0}
        if self.is_main:
            print(f"comparison: MLE continued from step {self.mle_end} at lr {cfg.rl_lr:g} for {budget:.1f} s of "
                  f"training steps ({'CPU' if clock == 'cpu_seconds' else 'wall'} time, the RL phase's)", flush=True)
        scores = self._continue(budget, clock, stop)
        st = self.stats[CONTINUED]
        self.summary[CONTINUED] = {**scores, "steps_per_s": st["steps"] / max(st["seconds"], 1e-9),
                                   "skipped": st["skipped"], "steps": st["steps"], "seconds": st["seconds"],
                                   "cpu_seconds": st["cpu_seconds"]}
        self.test_models = {"mle": branch["model"], CONTINUED: host_copy(saved_state(self.model))}
        self.save(path=self.continued_path, phase=CONTINUED)
        self.restore(self.final)
        self.final, self.compared = None, True
        self.log_step = self.step + st["steps"]
        self.save()  # checkpoint_last.pt: the RL model again, the comparison done

    def budget_clock(self) -> str:
        """The stats field the budget is counted in: on CPU this process's CPU time (a shared machine's other
        processes slowed RL's steps and the continuation's unequally by up to 2x in wall time), else wall time
        (a GPU's work is not the process's CPU time)."""
        return "cpu_seconds" if self.device.type == "cpu" else "seconds"

    def _continue(self, budget: float, clock: str, stop) -> dict:
        """MLE steps at --rl-lr while any process has budget left; validation every --eval-every and at the end."""
        cfg, start, k, scores = self.cfg, time.monotonic(), 0, None
        while True:
            signum = distributed.agree_to_stop(stop.received)
            if signum is not None:
                raise Interrupted(128 + signum, f"stopped by signal {signum} during the comparison with MLE "
                                                f"continued; {self.save_dir / 'checkpoint_last.pt'} holds the end "
                                                "of RL (--resume redoes the comparison)")
            if distributed.reduce_max(float(self.stats[CONTINUED][clock] < budget)) == 0:
                break
            row = self.train_step(CONTINUED)
            k += 1
            self.log({"step": self.mle_end + k, "phase": CONTINUED, "continued": k,  # numbered from the branch
                      "since_branch_s": round(time.monotonic() - start, 3), **row})
            scores = None
            if k % cfg.eval_every == 0:
                scores = self._validate_continued(k, start)
        return scores if scores is not None else self._validate_continued(k, start)

    def _validate_continued(self, k: int, start: float) -> dict:
        scores = self.validate()
        self.log({"step": self.mle_end + k, "phase": "eval", "after": CONTINUED, "continued": k,
                  "since_branch_s": round(time.monotonic() - start, 3), **scores,
                  "train_s": round(self.stats[CONTINUED].get(self.budget_clock(), 0.0), 3)})
        if self.is_main:
            print(f"MLE continued +{k} steps valid " + fmt_scores(scores), flush=True)
        return scores

    def test_model(self, name: str, state_dict) -> dict:
        """Test scores of a compared model (its parameters loaded for the evaluation, then the final ones back)."""
        final = host_copy(saved_state(self.model))
        fsdp.load_model(self.model, state_dict)
        try:
            with fsdp.gathered(self.model):
                return test_scores(self.model, self.task, self.test, self.reward, test_beams(self.cfg),
                                   self.cfg.max_len, self.device)
        finally:
            fsdp.load_model(self.model, final)

    def compared_models(self) -> dict:
        """name -> parameters of the models compared with the final one (none without a finished comparison);
        read back from their checkpoints when this process did not run the comparison (a resumed finished run)."""
        if not self.compared:
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
        if getattr(self, "final", None) is not None:
            self.restore(self.final)
            self.final = None

