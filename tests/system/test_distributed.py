"""Data-parallel training: batch sharding, the collective helpers, and 2 processes (torchrun, gloo) training the
same parameters as 1 process on the same global batches."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from twophase.system import distributed
from twophase.train import cli, recipe
from twophase.config import Config

from taskfiles import write_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("n,world", [(10, 1), (10, 2), (9, 2), (7, 3), (8, 4), (2, 3), (0, 2)])
def test_shards_are_contiguous_even_and_cover_the_batch(n, world):
    batch = [100 + i for i in range(n)]
    shares = [distributed.shard(batch, r, world) for r in range(world)]
    assert sum(shares, []) == batch  # disjoint, contiguous, in order
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # remainder to the first ranks


def test_shard_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError):
        distributed.shard([1, 2], 2, 2)


def test_without_torchrun_everything_is_single_process():
    assert not distributed.launched() and not distributed.active()
    assert (distributed.rank(), distributed.world()) == (0, 1)
    assert distributed.shard([3, 1, 2]) == [3, 1, 2]
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    distributed.all_reduce_grads([p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    assert distributed.reduce_sums({"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}
    assert distributed.agree_to_stop(None) is None and distributed.agree_to_stop(15) == 15
    assert distributed.gather_objects("x") == ["x"]


def test_gradients_are_reduced_in_bounded_buckets_without_a_copy_of_all(monkeypatch):
    """The all-reduce's extra memory is one bucket: a large gradient is reduced in its own .grad, small ones
    through a flat buffer of at most BUCKET_BYTES; the sums and the None gradients are as before. The
    collective is replaced by a stand-in for two ranks with equal gradients (it doubles what it is given)."""
    reduced = []

    def all_reduce(t):
        reduced.append(t)
        t.mul_(2)

    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(8,), (16, 16), (8,), (4, 2), (3,), (8,), (5,)]]
    for i, p in enumerate(params):
        p.grad = None if i == 4 else torch.randn(p.shape, generator=g)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    own = {p.grad.data_ptr() for p in params if p.grad is not None}
    monkeypatch.setattr(distributed, "BUCKET_BYTES", 100, raising=False)
    distributed.all_reduce_grads(params)
    for p, b in zip(params, before):
        assert (p.grad is None) if b is None else torch.equal(p.grad, 2 * b)
    flags, *buckets = reduced
    assert len(flags) == len(params)
    assert any(t.data_ptr() in own for t in buckets)  # the (16, 16) gradient, in place
    for t in buckets:
        assert t.data_ptr() in own or t.numel() * t.element_size() <= 100, t.shape


def _collectives(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    distributed._device = torch.device("cpu")
    try:
        a, b, c = (torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(3))
        a.grad = torch.full((2, 2), rank + 1.0)
        b.grad = torch.ones(2, 2) if rank == 1 else None  # rank 0 had nothing to back-propagate into b
        distributed.all_reduce_grads([a, b, c])
        assert torch.equal(a.grad, torch.full((2, 2), 3.0)) and torch.equal(b.grad, torch.ones(2, 2))
        assert c.grad is None  # no rank gave it a gradient: still None, as in one process
        assert distributed.reduce_sums({"n": rank + 1, "x": 0.5}) == {"n": 3.0, "x": 1.0}
        assert distributed.reduce_max(float(rank)) == 1.0
        assert distributed.agree_to_stop(None if rank == 0 else 15) == 15
        assert distributed.agree_to_stop(None) is None
        assert distributed.gather_objects({"r": rank}) == [{"r": 0}, {"r": 1}]
        assert distributed.shard(list(range(5))) == ([0, 1, 2] if rank == 0 else [3, 4])
    finally:
        distributed.finish()


def test_collectives_with_two_gloo_processes(tmp_path):
    # fork: the children need no fresh import of torch (seconds on a busy machine)
    ctx = mp.start_processes(_collectives, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=5) and time.monotonic() < deadline:  # join raises if a child failed
        pass
    if any(process.is_alive() for process in ctx.processes):
        for process in ctx.processes:
            process.kill()
        pytest.fail("the two processes did not finish within 60 s")


FLAGS = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "5", "--mle-batch-size", "9", "--beam-size", "3",
         "--rescore-chunk", "4", "--max-len", "8", "--dropout", "0", "--sampler", "beam", "--objective", "beam",
         "--mle-weight", "0.3", "--mle-steps", "4", "--rl-steps", "4", "--lr", "0.05", "--rl-lr", "0.01",
         "--eval-every", "100", "--save-every", "100", "--compare-mle"]


def _rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_the_same_parameters_as_one(tmp_path):
    """Odd global batches (5 sources split 3+2, 9 pairs split 5+4) so that normalising by the local batch instead of
    the global one would change the gradient's direction, which Adam would not hide."""
    write_task(tmp_path / "train.tsv", "reverse", 200, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 11, seed=1)  # 11 sources: validation shards of 6 and 5
    data = ["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "valid.tsv")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            str(ROOT / "train.py"), *data, *FLAGS, "--save-dir", str(tmp_path / "two")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert cli.main([*data, *FLAGS, "--save-dir", str(tmp_path / "one")]) == 0  # meanwhile, in this process
    out, err = two.communicate(timeout=180)
    assert two.returncode == 0, err[-3000:]
    assert out.count("end of MLE") == 1  # only rank 0 prints the table
    # --compare-mle ran in both processes in lockstep (each at its own pace: the slowest one's budget), and the
    # run still ends with the RL model, checked below against one process's
    assert out.count("MLE continued") >= 2
    assert '"phase": "mle-continued"' in (tmp_path / "two" / "metrics.jsonl").read_text()

    one = torch.load(tmp_path / "one" / "checkpoint_last.pt", weights_only=True)
    both = torch.load(tmp_path / "two" / "checkpoint_last.pt", weights_only=True)
    diff = sum(float((one["model"][k] - both["model"][k]).double().norm() ** 2) for k in one["model"]) ** 0.5
    norm = sum(float(v.double().norm() ** 2) for v in one["model"].values()) ** 0.5
    assert diff / norm < 1e-5, diff / norm
    assert both["world_size"] == 2 and len(both["rank_rngs"]) == 2
    assert not torch.equal(both["rank_rngs"][0]["sampling_rng"], both["rank_rngs"][1]["sampling_rng"])

    # the main run's rows (the comparison's length depends on each run's speed)
    rows_one, rows_two = ([r for r in _rows(tmp_path / run) if r["phase"] in ("mle", "rl") or r.get("after") in
                           ("mle", "rl")] for run in ("one", "two"))
    assert [(r["step"], r["phase"]) for r in rows_one] == [(r["step"], r["phase"]) for r in rows_two]
    for a, b in zip(rows_one, rows_two):  # statistics are reduced to the global batch's
        for key in ("loss", "grad_norm", "reward_mean", "reward_max", "candidates", "word_acc", "per", "reward", "n"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert any(r.get("reward_mean", 0) > 0 for r in rows_one)  # the RL gradient was not all zero


def test_each_rank_resumes_its_own_random_streams(tmp_path, monkeypatch):
    write_task(tmp_path / "train.tsv", "reverse", 20, seed=0)
    cfg = Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "train.tsv"), hidden_size=8,
                 embed_dim=4, batch_size=4, mle_batch_size=4, save_dir=str(tmp_path / "run"))
    trainer = recipe.setup(cfg)
    state = trainer.state_dict()
    streams = [torch.Generator().manual_seed(seed).get_state() for seed in (5, 6)]
    state["rank_rngs"] = [{"rng": state["rng"], "sampling_rng": s} for s in streams]
    monkeypatch.setattr(distributed, "world", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    trainer.load_state_dict(state)
    assert torch.equal(trainer.trainer.parts.sampling.get_state(), streams[1])
    del state["rank_rngs"]  # a single-process checkpoint resumed on 2 processes: rank 1 keeps its own stream
    trainer.load_state_dict(state)
    assert torch.equal(trainer.trainer.parts.sampling.get_state(), streams[1])
