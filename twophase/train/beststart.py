"""--rl-from-best: RL starts from the best MLE validation, not from wherever the last MLE step left the model.

With --lr-decay the MLE phase ends after validations that did not improve (at least --patience of them), so its
last parameters are, by construction, not its best; Bunel et al. start RL from the best validation epoch. At the
end of the MLE phase the parameters and optimizer state of checkpoint_best.pt (written at that validation) are
loaded back; the data order and random streams go on from the last step. checkpoint_last.pt, checkpoint_mle_end.pt
(--compare-mle's branch point) and the "end of MLE" column then hold that model and its validation scores. Under
torchrun every process reads checkpoint_best.pt, so the save directory must be shared by them.
"""
from __future__ import annotations

from . import fsdp
from .checkpoint import load


class BestStart:
    """The --rl-from-best half of `Trainer` (it provides model, optimizer, scaler, checkpoints, logs)."""

    best_scores: dict | None = None  # the validation scores of checkpoint_best.pt (set by save_best)

    def restore_best_mle(self, scores: dict, bar) -> dict:
        """At the end of MLE: the best MLE validation's model and optimizer back in place; returns its scores (the
        latest validation's, `scores`, where the latest is the best)."""
        if self.best_step is None or self.best_step >= self.step:
            return scores
        state = load(self.checkpoints.best_path)  # on the CPU; load_state_dict copies it onto the device
        fsdp.load_model(self.model, state["model"])  # LoRA adapters alone, or into --fsdp's shards
        fsdp.load_optimizer(self.model, self.optimizer, state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.log({"step": self.step, "phase": "schedule", "action": "restore_best", "from_step": self.best_step})
        if self.is_main:
            bar.write(f"step {self.step} [mle] RL starts from the best MLE validation (step {self.best_step}, "
                      f"{self.best_key} {self.checkpoints.best:.4f})")
        return dict(self.best_scores) if self.best_scores is not None else scores
