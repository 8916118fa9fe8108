"""--rl-from-best: at the end of MLE the best MLE validation's parameters come back, so RL (and the --compare-mle
branch point) start from them; without it they start from the last MLE step. On a tiny TSV task in-process."""
import pytest
import torch

from twophase.train import recipe
from twophase.train.checkpoint import load
from twophase.config import Config

from taskfiles import task_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 60, 6)


def run(task, save, **overrides):
    cfg = Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=8, embed_dim=4,
                 batch_size=4, mle_batch_size=8, beam_size=2, rescore_chunk=5, max_len=8, save_dir=str(save),
                 mle_steps=6, rl_steps=1, eval_every=2, log_every=0, lr=0.05, compare_mle=True, **overrides)
    tr = recipe.setup(cfg)
    marks = iter([0.5, 0.1, 0.2, 0.0, 0.0])  # validations at MLE steps 2, 4, 6, then RL's and the control's
    tr.validate = lambda: (lambda x: {"reward": x, "word_acc": x, "n": 6})(next(marks))
    seen = {}
    real = tr.save_best

    def save_best(scores):  # the parameters of each validation, to compare with what RL starts from
        seen[tr.state.step] = {k: v.clone() for k, v in tr.trainer.model.state_dict().items()}
        real(scores)
    tr.save_best = save_best
    summary = tr.train()
    return summary, seen, load(save / "checkpoint_mle_end.pt")["model"]


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_rl_starts_from_the_best_mle_validation(task, tmp_path):
    summary, seen, branch = run(task, tmp_path / "best", rl_from_best=True)
    assert same(branch, seen[2]) and not same(branch, seen[6])
    assert summary["mle"]["reward"] == 0.5  # the "end of MLE" column: the model RL starts from


def test_without_it_rl_starts_from_the_last_mle_step(task, tmp_path):
    summary, seen, branch = run(task, tmp_path / "last")
    assert same(branch, seen[6]) and not same(branch, seen[2])
    assert summary["mle"]["reward"] == 0.2
