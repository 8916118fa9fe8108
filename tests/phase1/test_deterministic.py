"""`--deterministic` on a GPU: CUDA refuses a floating-point cumsum (and the other ops of
torch.use_deterministic_algorithms' list) once deterministic algorithms are on. tests/guards.py refuses them on the
CPU too; under it, sampling (plain, top-k, top-p, min-len), stochastic beam search, beam search, the one-phase
searches and a training run run, and draw what they draw without it (the GPU check's dry run runs under it in
tests/bench/test_bench_gpu.py)."""
import pytest
import torch

from twophase import beam_search, sample
from twophase.phase1.onephase import one_phase_search
from twophase.phase1.sbs import stochastic_beam_search
from twophase.phase1.truncation import running_sum, truncate

import guards
from conftest import tiny_model, toy_batch


@pytest.fixture
def cuda_rules():
    """CUDA's refusals, and deterministic algorithms on, for the test; both off after."""
    with guards.cuda_deterministic_ops(), guards.deterministic_algorithms():
        yield


def test_the_guard_refuses_what_cuda_refuses_only_while_deterministic_algorithms_are_on():
    x = torch.rand(3, 5)
    with guards.cuda_deterministic_ops():
        x.cumsum(1), torch.histc(x)  # deterministic algorithms off: anything goes
        with guards.deterministic_algorithms():
            torch.arange(5).cumsum(0), torch.bincount(torch.arange(3)), x.median()  # integer sums, no indices
            for refused in (lambda: x.cumsum(1), lambda: torch.arange(5).cumsum(0, dtype=torch.float32),
                            lambda: torch.histc(x), lambda: x.median(dim=1),
                            lambda: torch.bincount(torch.arange(3), weights=torch.ones(3)),
                            lambda: torch.zeros(2).scatter_reduce(0, torch.tensor([0, 1, 1]), x[0, :3], "prod"),
                            lambda: torch.nn.functional.nll_loss(x.log_softmax(1), torch.tensor([0, 1, 2]))):
                with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
                    refused()


@pytest.mark.parametrize("M", [1, 2, 7, 64, 157, 1000])
def test_running_sum_without_cumsum_is_cumsum_and_repeats_the_sum_over_a_zero(M, cuda_rules):
    x = torch.rand(4, M, dtype=torch.float64, generator=torch.Generator().manual_seed(M))
    x[:, 1::3] = 0
    got = running_sum(x)
    torch.testing.assert_close(got, _by_hand(x), rtol=1e-13, atol=0)
    assert torch.equal(got[:, 1::3], got[:, 0::3][:, :got[:, 1::3].shape[1]])  # a zero adds exactly nothing
    # float32 as the CPU's cumsum makes it: float64 sums, each rounded
    torch.testing.assert_close(running_sum(x.float()), _by_hand(x.float().double()).float(), rtol=0, atol=0)


def _by_hand(x):
    """cumsum's own order, one column at a time (cumsum itself is refused under the rules)."""
    sums, total = [], torch.zeros(len(x), dtype=x.dtype)
    for j in range(x.shape[1]):
        total = total + x[:, j]
        sums.append(total)
    return torch.stack(sums, 1)


def _searches(model, source):
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    return {"sample": lambda: sample(model, source, 4, 6, generator=g()),
            "top-k": lambda: sample(model, source, 4, 6, generator=g(), top_k=3),
            "top-p": lambda: sample(model, source, 4, 6, generator=g(), top_p=0.8, min_len=2),
            "sbs": lambda: stochastic_beam_search(model, source, 4, 6, generator=g()),
            "beam": lambda: beam_search(model, source, 4, 6),
            "one-phase sample": lambda: one_phase_search(model, source, "sample", 4, 6, generator=g())[0],
            "one-phase sbs": lambda: one_phase_search(model, source, "sbs", 4, 6, generator=g())[0]}


def test_searches_under_cudas_deterministic_rules_draw_what_they_draw_without_them():
    model, source = tiny_model(), toy_batch()
    want = {name: run() for name, run in _searches(model, source).items()}
    with guards.cuda_deterministic_ops(), guards.deterministic_algorithms():
        got = {name: run() for name, run in _searches(model, source).items()}
    for name in want:
        assert torch.equal(got[name].tokens, want[name].tokens), name
        torch.testing.assert_close(got[name].scores, want[name].scores, rtol=1e-12, atol=0, msg=name)


def test_top_p_truncation_without_cumsum_keeps_the_same_nucleus(cuda_rules):
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    got = truncate(logits, eos_id=2, t=0, top_k=None, top_p=0.9, min_len=0)
    torch.use_deterministic_algorithms(False)
    assert torch.equal(got.isinf(), truncate(logits, eos_id=2, t=0, top_k=None, top_p=0.9, min_len=0).isinf())


@pytest.mark.parametrize("sampler", [["--sampler", "sample", "--top-p", "0.9", "--top-k", "5"],
                                     ["--sampler", "sbs"]])
def test_a_deterministic_training_run_that_samples_runs_under_cudas_rules(sampler, tmp_path, monkeypatch):
    from taskfiles import write_task
    from twophase.train import cli
    write_task(tmp_path / "train.tsv", "reverse", 40, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 6, seed=1)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:
        with guards.cuda_deterministic_ops():
            assert cli.main(["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "valid.tsv"),
                             "--save-dir", str(tmp_path / "run"), "--deterministic", "--objective", "reinforce",
                             *sampler, "--mle-steps", "2", "--rl-steps", "2", "--eval-every", "2",
                             "--hidden-size", "8", "--embed-dim", "4", "--batch-size", "2", "--mle-batch-size", "4",
                             "--beam-size", "3", "--max-len", "12", "--no-compare-mle"]) == 0
            assert torch.are_deterministic_algorithms_enabled()  # the run did switch them on
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
