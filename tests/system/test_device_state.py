"""What a run keeps and reads back, placed for an accelerator: every RNG state is set from the CPU (a generator of
any device takes a CPU ByteTensor), every checkpoint is read onto the CPU and then copied into the model on its
device (no second model, nor Adam's moments, in device memory), and --compare-mle's snapshot of the end of MLE
is held in host memory. On CPU: the trainer is told it runs on another device, states are handed over in a
stand-in that only `.cpu()` turns into a CPU tensor, and torch.load records where it was asked to load."""
import pytest
import torch

from twophase.train import checkpoint, decode, mlephase, recipe, resume, runstate
from twophase.config import Config
from twophase.train.klreference import Reference

from taskfiles import task_dir

pytestmark = [pytest.mark.usefixtures("one_thread"),  # meta stands for a device: a copy into it is a no-op
              pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 24, 4)


@pytest.fixture
def trainer(task, tmp_path):
    """A tiny run after 2 MLE steps, with a checkpoint_best.pt, the branch point and the continued model saved."""
    cfg = Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=8, embed_dim=4,
                 batch_size=3, mle_batch_size=4, beam_size=2, rescore_chunk=5, max_len=8, save_dir=str(tmp_path),
                 mle_steps=2, rl_steps=0, eval_every=1, log_every=0, compare_mle=False)
    tr = recipe.setup(cfg)
    tr.train()
    tr.save(path=tr.comparison.branch_path)
    tr.save(path=tr.comparison.continued_path)
    return tr


class OnDevice:
    """A state as a checkpoint loaded onto an accelerator holds it: usable only after `.cpu()`."""
    device = torch.device("cuda")

    def __init__(self, tensor):
        self.tensor = tensor

    def cpu(self):
        return self.tensor


class Generator:
    """Records the state set_state receives; refuses all but a CPU ByteTensor, as torch's generators do."""

    def __init__(self):
        self.got = None

    def set_state(self, state):
        assert type(state) is torch.Tensor and state.device.type == "cpu" and state.dtype == torch.uint8, state
        self.got = state


def _cpu_bytes_only(monkeypatch):
    real = torch.set_rng_state

    def set_rng_state(state):
        assert type(state) is torch.Tensor and state.device.type == "cpu", state
        real(state)
    monkeypatch.setattr(torch, "set_rng_state", set_rng_state)


@pytest.mark.parametrize("how", ["resume", "compare"])
def test_rng_states_are_set_from_the_cpu(trainer, monkeypatch, how):
    _cpu_bytes_only(monkeypatch)
    state = trainer.state_dict() if how == "resume" else trainer.trainer.snapshot()
    sampling = state["sampling_rng"].clone()
    state["sampling_rng"] = OnDevice(state["sampling_rng"])
    state["rng"]["torch"] = OnDevice(state["rng"]["torch"])
    trainer.trainer.parts.device = torch.device("cuda")  # what the trainer believes: a GPU run (nothing touches it)
    trainer.trainer.parts.sampling = Generator()
    if how == "resume":
        trainer.load_state_dict(state)
    else:
        trainer.trainer.restore(state)
    assert torch.equal(trainer.trainer.parts.sampling.got, sampling)


@pytest.fixture
def loads(monkeypatch):
    """The map_location of every torch.load (each then loads on the CPU, as the code under test should)."""
    seen = []
    real = torch.load

    def load(*args, map_location=None, **kwargs):
        seen.append(map_location)
        return real(*args, map_location="cpu", **kwargs)
    monkeypatch.setattr(torch, "load", load)
    return seen


def test_checkpoints_are_read_onto_the_cpu(trainer, loads, tmp_path):
    trainer.trainer.parts.device = torch.device("meta")  # an accelerator's stand-in: a load there would be recorded
    resume.export_model(trainer.trainer.model, "best", trainer.checkpoints.best_path)
    assert trainer.comparison.load_branch() is not None
    trainer.state.compared, trainer.comparison.test_models = True, None
    assert set(trainer.comparison.compared_models()) == {"mle", "mle-continued"}
    Reference.of(trainer.trainer.model, str(trainer.checkpoints.best_path), trainer.trainer.device)
    model, _, _ = decode.load_model(str(trainer.checkpoints.last_path), torch.device("meta"))
    assert next(model.parameters()).device.type == "meta"
    assert len(loads) == 6 and all(where == "cpu" for where in loads), loads


def test_rl_from_best_reads_the_best_checkpoint_onto_the_cpu(trainer, loads):
    class Bar:
        def write(self, line):
            pass
    trainer.trainer.parts.device = torch.device("meta")
    trainer.state.best_step, trainer.state.step = 1, 2
    mlephase.start_from_best(trainer.trainer, trainer.state, trainer.checkpoints, trainer.best_key, {}, trainer.log,
                             Bar().write)
    assert loads == ["cpu"]


def test_the_compare_snapshot_is_held_in_host_memory(trainer, monkeypatch):
    """The snapshot goes to host memory, not to the model's device: with host memory standing on another
    device (meta) than the model's (cpu), every tensor of the snapshot is there."""
    monkeypatch.setattr(checkpoint, "HOST", torch.device("meta"))
    snap = trainer.trainer.snapshot()
    tensors = [t for part in ("model", "optimizer") for t in _tensors(snap[part])]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert next(trainer.trainer.model.parameters()).device.type == "cpu"


def test_export_best_is_a_copy_in_host_memory(trainer, monkeypatch):
    """--export best's copy of the model: its trainable parameters in host memory (standing on meta), not a
    second model on the model's device."""
    monkeypatch.setattr(checkpoint, "HOST", torch.device("meta"))
    model = resume.export_model(trainer.trainer.model, "best", trainer.checkpoints.best_path)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(p.device.type == "cpu" for p in trainer.trainer.model.parameters())


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
