"""--device names a device this machine has, or is refused in one line (exit status 2); under torchrun every
process takes its own GPU. CUDA is faked (`torch.cuda.is_available` / `device_count` monkeypatched): the checks
run before any tensor is moved."""
import pytest
import torch

from twophase.system import devices
from twophase.train import cli


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_devices_that_exist_are_given(two_gpus):
    assert devices.pick("cuda:1") == torch.device("cuda", 1)
    assert devices.pick("cuda") == torch.device("cuda")
    assert devices.pick("auto") == torch.device("cuda")
    assert devices.pick("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name,match", [
    ("cuda:3", r"^--device cuda:3: this machine has 2 CUDA devices \(cuda:0 to cuda:1\)$"),
    ("tpu", r"^--device: unknown device 'tpu'"),
    ("meta", r"^--device meta: twophase runs on cpu, cuda, mps, not meta$"),
])
def test_impossible_devices_are_refused(two_gpus, name, match):
    with pytest.raises(devices.DeviceError, match=match):
        devices.pick(name)


def test_mps_where_there_is_none(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(devices.DeviceError, match=r"^--device mps: MPS \(Apple's GPU\) is not available"):
        devices.pick("mps")


@pytest.mark.parametrize("name", ["cuda:3", "mps"])
def test_train_py_refuses_them_in_one_line_exit_2(two_gpus, monkeypatch, name, capsys, tmp_path):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    code = cli.main(["--device", name, "--save-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"--device {name}:" in err, err


def test_each_torchrun_process_takes_its_own_gpu(two_gpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.for_rank(devices.pick("cuda")) == torch.device("cuda", 1)
    assert devices.for_rank(devices.pick("auto")) == torch.device("cuda", 1)
    assert devices.for_rank(devices.pick("cuda:1")) == torch.device("cuda", 1)
    assert devices.for_rank(torch.device("cpu")) == torch.device("cpu")  # gloo on the CPU: nothing to split
    with pytest.raises(devices.DeviceError, match=r"^--device cuda:0 under torchrun: this process \(LOCAL_RANK 1\)"):
        devices.for_rank(devices.pick("cuda:0"))
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(devices.DeviceError, match=r"LOCAL_RANK 2, but this machine has 2 CUDA devices"):
        devices.for_rank(devices.pick("cuda"))


def test_torchrun_with_cuda_0_on_every_rank_is_one_line(two_gpus, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    code = cli.main(["--device", "cuda:0", "--save-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "LOCAL_RANK 1" in err, err
