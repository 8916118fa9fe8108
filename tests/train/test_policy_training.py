"""--objective policy end to end: phase one once per generation and --updates-per-generation updates on it, the
frozen reference's KL, the metrics in metrics.jsonl, resume between two updates of a generation bit-identical,
two processes equal to one, --grad-accum's batches equal to one big batch in float64, and its flags refused where
they would do nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from taskfiles import write_task
from test_cli import _fails_with_one_line
from twophase.train import cli, recipe
from twophase.config import Config

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "5", "--mle-batch-size", "8", "--beam-size", "3",
        "--rescore-chunk", "5", "--max-len", "8", "--eval-every", "100", "--save-every", "100", "--no-compare-mle",
        "--lr", "0.05", "--rl-lr", "0.01"]
POLICY = ["--objective", "policy", "--updates-per-generation", "2", "--kl-beta", "0.04", "--sampler", "sample",
          "--clip-epsilon-high", "0.28"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("policy")
    write_task(d / "train.tsv", "reverse", 200, seed=0)
    write_task(d / "valid.tsv", "reverse", 11, seed=1)
    return ["--train", str(d / "train.tsv"), "--valid", str(d / "valid.tsv")]


def _rows(save):
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def _params(save):
    return torch.load(save / "checkpoint_last.pt", weights_only=True)["model"]


def test_end_to_end_with_two_updates_per_generation_and_kl(data, tmp_path, one_thread):
    save = tmp_path / "run"
    assert cli.main([*data, *TINY, *POLICY, "--mle-steps", "4", "--rl-steps", "4", "--save-dir", str(save),
                     "--rescore-chunk", "auto", "--memory-budget", "16KiB"]) == 0
    rl = [r for r in _rows(save) if r["phase"] == "rl"]
    assert [r["update_in_generation"] for r in rl] == [1, 2, 1, 2]
    assert all(1 <= r["chunk"] < 15 for r in rl)  # --rescore-chunk auto: chunks below the 15 candidates
    for r in rl:
        for key in ("frac_reward_zero_std", "clip_ratio_low", "clip_ratio_high", "kl", "completion_length_mean",
                    "completion_length_min", "completion_length_max", "terminated", "reward_mean", "grad_norm"):
            assert key in r and r[key] is not None, key
        assert 1 <= r["completion_length_min"] <= r["completion_length_mean"] <= r["completion_length_max"] <= 8
    # the first update of a generation is at the old policy (ratio 1, nothing clipped) and at the end-of-MLE
    # reference (KL 0); the second update has moved away from both
    assert rl[0]["clip_ratio_low"] == rl[0]["clip_ratio_high"] == 0 and rl[0]["kl"] < 1e-10
    assert rl[1]["kl"] > 1e-8
    assert rl[0]["reward_mean"] == rl[1]["reward_mean"]  # one generation: the same candidates
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["policy"]["generation"]["used"] == 2 and state["policy"]["reference"] is not None


def test_resume_between_two_updates_is_bit_identical(data, tmp_path, one_thread):
    flags = [*data, *TINY, *POLICY, "--loss-type", "grpo", "--advantage-scale", "batch", "--drop-zero-std",
             "--baseline", "loo", "--mle-steps", "3", "--grad-accum", "2"]  # generations of two batches
    assert cli.main([*flags, "--rl-steps", "5", "--save-dir", str(tmp_path / "full")]) == 0
    part = tmp_path / "part"
    assert cli.main([*flags, "--rl-steps", "3", "--save-dir", str(part)]) == 0  # stops inside generation 2
    assert torch.load(part / "checkpoint_last.pt", weights_only=True)["policy"]["generation"]["used"] == 1
    assert cli.main([*flags, "--rl-steps", "5", "--save-dir", str(part), "--resume"]) == 0
    full, resumed = _params(tmp_path / "full"), _params(part)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    rl = [r for r in _rows(tmp_path / "full") if r["phase"] == "rl"]
    assert all("dropped_groups" in r for r in rl) and all(r["candidates"] == 2 * 5 * 3 for r in rl)


def test_two_processes_train_the_same_parameters_as_one(data, tmp_path):
    """Beam candidates (the same in both runs), batch-scaled advantages, grpo's and KL's global normalisers over
    5 sources split 3 + 2."""
    flags = [*data, *TINY, "--objective", "policy", "--updates-per-generation", "2", "--kl-beta", "0.04",
             "--loss-type", "grpo", "--advantage-scale", "batch", "--mle-steps", "2", "--rl-steps", "3"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            str(ROOT / "train.py"), *flags, "--save-dir", str(tmp_path / "two")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert cli.main([*flags, "--save-dir", str(tmp_path / "one")]) == 0
    _, err = two.communicate(timeout=180)
    assert two.returncode == 0, err[-3000:]
    one, both = _params(tmp_path / "one"), _params(tmp_path / "two")
    diff = sum(float((one[k] - both[k]).double().norm() ** 2) for k in one) ** 0.5
    norm = sum(float(v.double().norm() ** 2) for v in one.values()) ** 0.5
    assert diff / norm < 1e-5, diff / norm
    rows = [[r for r in _rows(tmp_path / run) if r["phase"] == "rl"] for run in ("one", "two")]
    for a, b in zip(*rows):
        for key in ("loss", "grad_norm", "kl", "clip_ratio_low", "clip_ratio_high", "reward_mean",
                    "completion_length_mean", "completion_length_min", "frac_reward_zero_std"):
            # the loss at the old policy is a sum of advantages that cancel: 0 to rounding
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6 if key == "loss" else 1e-9), (a["step"], key)


@pytest.mark.parametrize("loss_type, flags", [
    ("dapo", dict(advantage_scale="batch", drop_zero_std=True, baseline="loo")),  # tokens, batch std, drops
    ("grpo", dict(kl_importance_weighted=False)),  # rows
    ("sequence", dict(advantage_scale="none")),  # sources
    ("grpo", dict(importance_sampling_level="sequence", mask_truncated_completions=True)),  # GSPO: row sums
    ("cispo", dict(mask_truncated_completions=True, clip_epsilon_high=1.001)),  # tokens without the cut rows
    ("dapo", dict(off_policy_mask_threshold=1e-3, delta=1.02)),  # the mask's row sums
    ("grpo", dict(entropy_coef=0.05, mask_truncated_completions=True)),  # the bonus's token count
])
def test_grad_accum_equals_one_big_batch_over_several_updates(data, tmp_path, one_thread, loss_type, flags):
    """--grad-accum 2 of 3 sources trains the parameters --grad-accum 1 of 6 trains, in float64, over the two
    updates of a generation (Adam steps between them) and into the next generation: every normaliser is the
    whole generation's. Beam candidates: the same whichever batches search them."""
    first, second, third, fourth = [0, 5, 7], [2, 9, 11], [1, 4, 6], [3, 8, 10]
    params, rows = [], []
    for accum, plan in ((2, [first, second, third, fourth]), (1, [first + second, third + fourth])):
        cfg = Config(train=data[1], valid=data[3], hidden_size=8, embed_dim=4, beam_size=3, max_len=9,
                     rescore_chunk=4, save_dir=str(tmp_path / str(accum)), objective="policy", sampler="beam",
                     updates_per_generation=2, kl_beta=0.3, loss_type=loss_type, grad_accum=accum,
                     batch_size=6 // accum, compare_mle=False, lr=0.05, clip_epsilon=0.01, **flags)
        tr = recipe.setup(cfg).trainer  # its steps, taken directly
        tr.model.double()
        tr.mle.steps.grad_accum = 1  # a few MLE steps, the same in both runs: some reward for the candidates
        tr.parts.mle_batches = iter([list(range(k, len(tr.parts.pairs), 2)) for k in range(2)])
        for _ in range(2):
            tr.mle_step()
        tr.rl.steps.grad_accum, tr.parts.rl_batches = accum, iter(plan)
        tr.optimizer.param_groups[0]["lr"] = 0.05
        rows.append([tr.rl_step() for _ in range(3)])
        params.append([p.detach().clone() for p in tr.model.parameters()])
    assert all(r["grad_norm"] > 0 and r["skipped"] == 0 for r in rows[0])
    assert rows[0][1]["clip_ratio_low"] + rows[0][1]["clip_ratio_high"] > 0  # the second update clips
    assert rows[0][1]["kl"] > 0 and rows[0][0]["candidates"] == rows[1][0]["candidates"] == 18
    for a, b in zip(*rows):
        for key in ("loss", "grad_norm", "kl", "clip_ratio_low", "clip_ratio_high", "reward_mean",
                    "frac_reward_zero_std", "completion_length_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-10, abs=1e-13), key
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_a_generation_saved_before_grad_accum_loads_as_one_batch():
    from types import SimpleNamespace
    from twophase.config import Config
    from twophase.train.steps import build
    from twophase.train.steps.policy import FIELDS, PolicyStep
    part = {"idx": [0, 1], **{k: torch.arange(2) + i for i, k in enumerate(FIELDS)}, "advantages": torch.ones(2),
            "ref": None}
    step = build(PolicyStep, Config(objective="policy"), SimpleNamespace(device=torch.device("cpu")))
    step.load_state_dict({"generation": {"num_sources": 2, "used": 1, "metrics": {"reward_mean": 0.5}, **part},
                          "reference": None})
    gen = step.generation
    assert (gen["num_sources"], gen["used"], gen["metrics"], len(gen["parts"])) == (2, 1, {"reward_mean": 0.5}, 1)
    assert gen["parts"][0].keys() == part.keys() and all(
        torch.equal(gen["parts"][0][k], part[k]) for k in FIELDS) and step.reference is None


@pytest.mark.parametrize("argv,match", [
    (["--objective", "beam", "--kl-beta", "0.1"], "--kl-beta applies to --objective policy only"),
    (["--objective", "policy", "--no-prefix-sharing"], "unrecognized arguments: --no-prefix-sharing"),
    (["--objective", "policy", "--ref-checkpoint", "x.pt"], "--ref-checkpoint needs --kl-beta"),
    (["--objective", "policy", "--kl-beta", "0.1", "--ref-checkpoint", "nowhere.pt"], "no such file"),
    (["--objective", "policy", "--baseline", "greedy"], "not greedy"),
    (["--objective", "policy", "--loss-type", "ppo"], "--loss-type"),
    (["--objective", "policy", "--sapo-temperature-neg", "2"], "applies to --loss-type sapo only"),
    (["--objective", "policy", "--loss-type", "cispo", "--delta", "2"], "--delta caps the clipped"),
    (["--objective", "beam", "--importance-sampling-level", "sequence"], "applies to --objective policy only"),
    (["--objective", "policy", "--importance-sampling-level", "row"], "--importance-sampling-level"),
    (["--objective", "policy", "--top-entropy-quantile", "0.2", "--grad-accum", "2"], "does not take --grad-accum"),
    (["--objective", "policy", "--top-entropy-quantile", "1.5"], "fraction in"),
])
def test_bad_flags_exit_2_in_one_line(data, tmp_path, capsys, argv, match):
    _fails_with_one_line([*data, "--save-dir", str(tmp_path / "r"), *argv], capsys, match)


def test_the_loss_options_train_end_to_end(data, tmp_path, one_thread):
    """GSPO with the entropy bonus, the high-entropy mask, the off-policy mask and truncated rows masked: a
    run's updates are finite and move the parameters."""
    save = tmp_path / "run"
    assert cli.main([*data, *TINY, *POLICY, "--mle-steps", "2", "--rl-steps", "2", "--save-dir", str(save),
                     "--loss-type", "grpo", "--importance-sampling-level", "sequence", "--entropy-coef", "0.01",
                     "--top-entropy-quantile", "0.5", "--off-policy-mask-threshold", "0.5",
                     "--mask-truncated-completions"]) == 0
    rl = [r for r in _rows(save) if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["grad_norm"] > 0 and r["loss"] == r["loss"] for r in rl)
