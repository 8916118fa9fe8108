"""--deterministic and --tf32 set the process's modes before the model runs, and the exactness claims hold with
deterministic algorithms on (where torch raises for an op that has only a nondeterministic kernel)."""
import os

import pytest
import torch

from twophase.system import devices
from twophase.train import cli, recipe
from twophase.config import Config

import test_onephase
import test_prefixtree
import test_rescoring
from taskfiles import task_dir


@pytest.fixture
def restored(monkeypatch):
    """The process's modes as they were, after the test."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
              torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.set_float32_matmul_precision(before[1])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 20, 4)


def _build(task, tmp_path, **flags):
    return recipe.setup(Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=16,
                            embed_dim=8, batch_size=4, mle_batch_size=8, beam_size=3, max_len=8,
                            save_dir=str(tmp_path / "run"), **flags))


def test_the_flags_set_the_modes(task, tmp_path, restored):
    _build(task, tmp_path, deterministic=True, tf32=True)
    assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.allow_tf32
    _build(task, tmp_path / "b")  # without --tf32: full float32
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    assert not torch.backends.cudnn.allow_tf32


def test_a_nondeterministic_cublas_workspace_is_one_line(task, tmp_path, restored, monkeypatch, capsys):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    code = cli.main(["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--deterministic",
                     "--save-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--deterministic: CUBLAS_WORKSPACE_CONFIG=:0:0" in err, err
    devices.configure(False, False)  # a plain run leaves the workspace alone
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"


@pytest.fixture
def deterministic(restored):
    torch.use_deterministic_algorithms(True)
    yield


def test_chunked_equals_whole_with_deterministic_algorithms(deterministic, one_thread):
    """The exactness tests themselves, run with deterministic algorithms on: the LSTM's by-hand paths (rows and
    prefix tree), a step-only model's tree, the one-phase baseline."""
    test_rescoring.test_chunked_gradient_equals_one_piece_gradient("sample", "beam")
    test_rescoring.test_mixed_reference_and_candidate_rows()
    test_prefixtree.test_tree_gradient_equals_one_graph_over_rows("beam", "reinforce")
    test_onephase.test_one_phase_gradient_equals_two_phase("sample", "reinforce")
    assert torch.are_deterministic_algorithms_enabled()
