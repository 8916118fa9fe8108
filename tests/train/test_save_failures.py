"""Save-dir and checkpoint-file failures: each is one line naming the file, exit status 2, and nothing already
saved is lost (rotation never deletes a later step, a full disk mid-run keeps the last good checkpoint)."""
import errno
import tempfile
from types import SimpleNamespace

import pytest

from twophase.train import checkpoint, cli, rundir
from twophase.train.checkpoint import CheckpointError, CheckpointManager, load, save_atomic

import forks
from taskfiles import task_dir
from test_resume import _argv, _files, _one_line


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 24, 4)


def test_rotation_never_deletes_later_steps(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 5):
        save_atomic({"model": {}, "step": step}, mgr.step_path(step))
    mgr.save({"model": {}, "step": 2}, 2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint_step*")) == ["checkpoint_step00000002.pt",
                                                                         "checkpoint_step00000005.pt"]


@pytest.mark.parametrize("content", [b"hello world\n", b'{"model": 1}', b"\x80\x04\x95\x00"])
def test_a_file_that_is_not_a_checkpoint_is_named_so(tmp_path, capsys, content):
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a twophase checkpoint") as info:
        load(path)
    assert "pickled" not in str(info.value)
    assert cli.main(["--resume-from", str(path)]) == 2
    _one_line(capsys, f"{path}: not a twophase checkpoint")
    assert cli.main(["--init-from", str(tmp_path)]) == 2
    _one_line(capsys, "a directory; give a checkpoint file")


# ---- 5. --save-dir that cannot take the run
def test_a_file_in_the_way_of_the_save_dir(task, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert cli.main(_argv(task, tmp_path / "file" / "run", "--mle-steps", "1", "--rl-steps", "0")) == 2
    _one_line(capsys, f"{tmp_path / 'file'} is a file, not a directory")
    assert (tmp_path / "file").read_text() == "mine"


def test_an_unwritable_save_dir(task, tmp_path, capsys, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(rundir, "tempfile", SimpleNamespace(TemporaryFile=read_only, mkstemp=tempfile.mkstemp))
    assert cli.main(_argv(task, tmp_path / "run", "--mle-steps", "1", "--rl-steps", "0")) == 2
    _one_line(capsys, f"--save-dir {tmp_path / 'run'}: cannot write in {tmp_path}: Read-only file system")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("failure", ["oserror", "torch-zip-writer"])
def test_a_full_disk_mid_run_is_one_line_and_keeps_what_was_saved(task, tmp_path, capsys, monkeypatch, failure):
    save = tmp_path / "run"
    real = checkpoint.torch.save
    kept = {}

    def full_at_step_2(state, f, *args, **kwargs):
        if state.get("step") != 2:
            return real(state, f, *args, **kwargs)
        if not kept:
            kept.update(_files(save))
        f.write(b"PK\x03\x04 partial")
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: type("U", (), {"free": 0})())
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", full_at_step_2)
    assert cli.main(_argv(task, save, "--mle-steps", "3", "--rl-steps", "0", "--save-every", "1")) == 2
    _one_line(capsys, f"cannot write {save / 'checkpoint_step00000002.pt'}: No space left on device")
    after = _files(save)
    assert not [n for n in after if n.endswith(".tmp")]
    assert {n: v for n, v in after.items() if n.endswith(".pt")} == {n: v for n, v in kept.items()
                                                                     if n.endswith(".pt")}


def test_a_file_size_limit_during_a_save_says_file_too_large(tmp_path):
    """RLIMIT_FSIZE below a checkpoint's size (SIGXFSZ ignored, so a write past it fails with EFBIG): torch's zip
    writer reports its own 'enforce fail at inline_container.cc'; the save's line says what the OS says, and no
    temporary file is left. Both a save on its own and a run's, in a child process that takes the limit."""
    code = ("import resource, signal, sys, torch\n"
            "from twophase.train import checkpoint, cli\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))\n"
            "try:\n    checkpoint.save_atomic({'model': torch.zeros(100000)}, sys.argv[1] + '/big.pt')\n"
            "except checkpoint.SaveError as err:\n    print(err)\n"
            "sys.exit(cli.main(sys.argv[2:]))\n")
    script = tmp_path / "limited.py"
    script.write_text(code)
    task = tmp_path / "task"
    task.mkdir()
    from taskfiles import write_task
    write_task(task / "train.tsv", "reverse", 20, seed=0)
    write_task(task / "valid.tsv", "reverse", 4, seed=1)
    proc = forks.run(argv=[script, tmp_path, *_argv(task, tmp_path / "run", "--mle-steps", "2", "--rl-steps", "0",
                                                  "--no-compare-mle", "--no-picture")], timeout=60)
    assert proc.stdout.splitlines()[0] == (f"cannot write {tmp_path / 'big.pt'}: File too large (the process's "
                                           "file-size limit, 20,000 bytes)"), proc.stdout
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "File too large" in err[0] and "inline_container" not in err[0], proc.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
