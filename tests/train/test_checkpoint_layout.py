"""The checkpoint's layout is a format: the keys, their order and their nesting that every earlier version of the
run wrote are frozen here, as a tiny run's checkpoint_last.pt held them when the trainer, the run's state and the
run each began to write their own part. A new run must write exactly that layout, and a checkpoint of that layout
must load into a run and come out again unchanged."""
import pytest
import torch

from twophase.config import Config
from twophase.train import recipe

from taskfiles import write_task

# checkpoint_last.pt of a beam run (the default objective): every top-level key, in the order written
BEAM = ["model", "optimizer", "step", "phase", "config", "task", "rng", "sampling_rng", "mle_batches", "rl_batches",
        "stats", "summary", "bad_in_a_row", "best_step", "elapsed_s", "schedule", "mle_end", "compared", "log_step",
        "best_scores", "presenting", "best_metric"]
# --objective policy's adds its generation and reference after the trainer's streams
POLICY = BEAM[:-1] + ["policy", "best_metric"]
# the nesting of the parts the run and the trainer write (the model's, the optimizer's and the Config's keys are
# theirs, not the run's)
NESTED = {
    "task": ["spec", "state", "origin"],
    "rng": ["python", "numpy", "torch"],
    "mle_batches": ["epoch", "position"],
    "rl_batches": ["epoch", "position"],
    "stats": ["mle", "rl", "mle-continued"],
    "stats/mle": ["steps", "seconds", "skipped", "out_of_memory", "reward_sum", "reward_steps", "cpu_seconds"],
    "stats/rl": ["steps", "seconds", "skipped", "out_of_memory", "reward_sum", "reward_steps", "cpu_seconds"],
    "stats/mle-continued": ["steps", "seconds", "cpu_seconds", "skipped", "out_of_memory", "reward_sum",
                            "reward_steps"],
    "summary": ["mle", "rl", "mle-continued"],
    "schedule": ["lr", "best", "bad", "decays", "stopped"],
    "presenting": ["version", "state", "gauss_next"],
    "optimizer": ["state", "param_groups"],
}
POLICY_NESTED = {
    "policy": ["generation", "reference"],
    "policy/generation": ["num_sources", "used", "metrics", "parts"],
    "policy/reference": ["kind", "state"],
}
# what a checkpoint holds that is not of its run's steps: wall-clock seconds
TIMINGS = {"elapsed_s", "seconds", "cpu_seconds", "steps_per_s"}


def _run(tmp_path, name, **extra):
    write_task(tmp_path / "train.tsv", "reverse", 16, seed=0)
    return recipe.setup(Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "train.tsv"), hidden_size=8,
                            embed_dim=4, batch_size=2, mle_batch_size=2, beam_size=2, max_len=8, mle_steps=2,
                            rl_steps=2, eval_every=2, log_every=0, compare_mle=True, save_dir=str(tmp_path / name),
                            **extra))


def _at(state: dict, path: str):
    for key in path.split("/"):
        state = state[key]
    return state


def _assert_same(a, b, where="", skip=frozenset()):
    """a == b everywhere: tensors equal in dtype, shape and every element; timings (`skip`) left out."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            if k not in skip:
                _assert_same(a[k], b[k], f"{where}/{k}", skip)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]", skip)
    else:
        assert a == b or (a != a and b != b), where  # NaN == NaN here


@pytest.mark.parametrize("objective, keys, nested", [("beam", BEAM, NESTED),
                                                     ("policy", POLICY, {**NESTED, **POLICY_NESTED})])
def test_a_run_writes_the_frozen_layout(tmp_path, objective, keys, nested):
    run = _run(tmp_path, objective, objective=objective, **({"kl_beta": 0.1} if objective == "policy" else {}))
    run.train()
    for name in ("checkpoint_last.pt", "checkpoint_step00000002.pt", "checkpoint_mle_end.pt",
                 "checkpoint_best.pt"):
        saved = torch.load(tmp_path / objective / name, weights_only=True)
        assert list(saved) == keys, name
        assert list(saved["config"]) == list(Config.__dataclass_fields__)  # asdict(cfg), the fields in order
    last = torch.load(tmp_path / objective / "checkpoint_last.pt", weights_only=True)  # every phase's figures
    for path, inner in nested.items():
        assert list(_at(last, path)) == inner, path


@pytest.mark.parametrize("objective", ["beam", "policy"])
def test_a_checkpoint_of_the_frozen_layout_loads_and_saves_unchanged(tmp_path, objective):
    """A checkpoint with the frozen keys in the frozen order, loaded into a fresh run of the same configuration,
    is what that run saves again: every key in order, every tensor and value (timings apart)."""
    extra = {"objective": objective, **({"kl_beta": 0.1} if objective == "policy" else {})}
    first = _run(tmp_path, "first", **extra)
    first.train()
    saved = torch.load(tmp_path / "first" / "checkpoint_last.pt", weights_only=True)
    frozen = {key: saved[key] for key in (POLICY if objective == "policy" else BEAM)}  # the frozen order
    again = _run(tmp_path, "again", **extra)
    again.load_state_dict(frozen)
    again.save()
    resaved = torch.load(tmp_path / "again" / "checkpoint_last.pt", weights_only=True)
    frozen["config"] = resaved["config"]  # the save dir differs, as it would for a copied run folder
    _assert_same(frozen, resaved, skip=TIMINGS)
