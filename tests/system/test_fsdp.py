"""--fsdp (FSDP2 sharding under torchrun): 2 gloo processes train the same parameters as 1 process on the same
global batches (the LSTM with and without prefix sharing, the Karel model with --grammar on, beam-RL and
--objective policy, a tiny GPT-2 and T5, chunks smaller than a rank's rows, MLE and RL steps, --compare-mle;
--objective distill with --grad-accum 2, an LSTM and a GPT-2 pair, its teacher sharded, and on the LSTM pair
data-parallel training too), and --objective policy with sampled candidates the same as data-parallel training;
their checkpoints hold a single
process's layout (a plain process resumes one, twophase-decode reads one), --resume on 2 processes continues
bit-exactly (mid-generation too), hf_final is written once; and the one-line refusals."""
import functools
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from twophase.system import distributed, fsdp
from twophase.train import cli, decode
from twophase.config import Config
from twophase.train.steps.parts import Gradient

import hf_tiny
from taskfiles import write_task

LSTM = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "5", "--mle-batch-size", "9", "--beam-size", "3",
        "--max-len", "8", "--dropout", "0", "--sampler", "beam", "--objective", "beam", "--mle-weight", "0.3",
        "--lr", "0.05", "--rl-lr", "0.01", "--eval-every", "100", "--save-every", "100"]
# two generations of two updates each, sampled candidates, KL to the end-of-MLE reference, groups without signal
# dropped (5 sources split 3 + 2)
POLICY = ["--objective", "policy", "--updates-per-generation", "2", "--kl-beta", "0.04", "--sampler", "sample",
          "--drop-zero-std", "--mle-weight", "0", "--mle-steps", "2", "--no-compare-mle"]
HF = ["--batch-size", "3", "--mle-batch-size", "6", "--beam-size", "2", "--max-len", "6", "--max-src-len", "8",
      "--mle-steps", "2", "--rl-steps", "2", "--eval-every", "100", "--rescore-chunk", "2", "--no-compare-mle",
      "--sampler", "beam", "--objective", "beam"]


def _cases(d: Path) -> dict:
    """name -> argv, each run once on 2 processes with --fsdp and once in one process without."""
    lstm = ["--train", str(d / "train.tsv"), "--valid", str(d / "valid.tsv"), *LSTM]
    hf = ["--train", str(d / "htrain.tsv"), "--valid", str(d / "hvalid.tsv"), *HF]
    karel = ["--task", "karel", "--train-size", "8", "--valid-size", "2", "--hidden-size", "16", "--embed-dim", "8",
             "--mle-batch-size", "6", "--batch-size", "3", "--beam-size", "2", "--max-len", "31", "--rescore-chunk",
             "2", "--eval-beam", "2", "--no-compare-mle", "--eval-every", "100", "--grammar", "on"]
    # distillation of a wider teacher, each step two batches of 5 sources (split 3 + 2) whose scored tokens, all
    # batches' and all processes', are TRL's normaliser: a rank's own would change the gradient's direction
    distill = ["--objective", "distill", "--mle-weight", "0", "--distill-beta", "0.5", "--grad-accum", "2",
               "--rl-steps", "2", "--no-compare-mle"]
    return {
        # 5 sources x 3 beams + references split 3+2: a rank's 9+ rows in chunks of 4 / 2
        "tree": [*lstm, "--rescore-chunk", "4", "--mle-steps", "2", "--rl-steps", "2", "--compare-mle"],
        "rows": [*lstm, "--rescore-chunk", "2", "--mle-steps", "2", "--rl-steps", "2", "--no-compare-mle"],
        "karel": [*karel, "--mle-steps", "1", "--rl-steps", "1"],  # the model inside the grammar's wrapper
        # beam candidates (one process's), the grammar around the policy and around its sharded reference
        "karel_policy": [*karel, "--mle-steps", "1", "--rl-steps", "2", "--objective", "policy",
                         "--updates-per-generation", "2", "--kl-beta", "0.04", "--beam-size", "3"],
        "gpt2": [*hf, "--hf-model", str(d / "gpt2")],
        "t5": [*hf, "--hf-model", str(d / "t5")],
        "distill": [*lstm, *distill, "--teacher", str(d / "teacher" / "checkpoint_last.pt"), "--include-reference",
                    "--rescore-chunk", "4", "--mle-steps", "1"],
        "gpt2_distill": [*hf, "--hf-model", str(d / "gpt2"), *distill, "--teacher", str(d / "gpt2_teacher")],
    }


def _relative(a: dict, b: dict) -> float:
    diff = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a) ** 0.5
    return diff / sum(float(v.double().norm() ** 2) for v in a.values()) ** 0.5


def _load(run: Path) -> dict:
    return torch.load(run / "checkpoint_last.pt", weights_only=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two(rank: int, port: int, runs: list, out: str) -> None:
    """A torchrun worker's environment, then every command of `runs` in the one process group (a callable: a
    check run there)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    finish, distributed.finish = distributed.finish, lambda: None  # the group outlives each command
    sys.stdout = open(out % rank, "w")
    try:
        for argv in runs:
            if callable(argv):
                argv()
            else:
                assert cli.main(argv) == 0, argv
    finally:
        sys.stdout.close()
        finish()


def _two_process_runs(d: Path, cases: dict) -> list:
    """Every command the two processes run, in order, in one process group."""
    runs = [[*argv, "--fsdp", "--save-dir", str(d / f"two_{name}")] for name, argv in cases.items()]
    # --resume on 2 processes: "rows" stopped after its first RL step, then continued to the end
    rows = cases["rows"]
    runs.append([*rows[:-3], "--rl-steps", "1", "--no-compare-mle", "--fsdp", "--save-dir", str(d / "cut")])
    runs.append(["--resume", "--rl-steps", "2", "--fsdp", "--save-dir", str(d / "cut")])
    # --objective policy, sampled: --fsdp against data-parallel training (each rank samples from its own stream);
    # and --resume under --fsdp from step 3, inside the second generation
    policy = ["--train", str(d / "train.tsv"), "--valid", str(d / "valid.tsv"), *LSTM, "--rescore-chunk", "2",
              *POLICY]
    # --objective distill: data-parallel training (a whole teacher on each process); the sharded teacher
    runs += [[*cases["distill"], "--save-dir", str(d / "distill_ddp")],
             functools.partial(_teacher_is_sharded, [*cases["distill"], "--fsdp", "--save-dir", str(d / "sharded")])]
    return runs + [[*policy, "--rl-steps", "4", "--fsdp", "--save-dir", str(d / "policy_fsdp")],
                   [*policy, "--rl-steps", "4", "--save-dir", str(d / "policy_ddp")],
                   [*policy, "--rl-steps", "3", "--fsdp", "--save-dir", str(d / "policy_cut")],
                   ["--resume", "--rl-steps", "4", "--fsdp", "--save-dir", str(d / "policy_cut")]]


def _teacher_is_sharded(argv: list) -> None:
    """Under --fsdp each process keeps its half of the teacher's parameters, before and after a step and during
    its phase ones, and the whole of them for its phase twos alone; the teacher gets no gradient."""
    trainer = cli.build_from_flags(argv).trainer
    teacher, held = trainer.parts.teacher, []

    def kept():  # the teacher's parameter elements this process holds now
        return sum(fsdp.local(p).numel() for p in teacher.parameters())

    gradient = trainer.rl.gradient
    trainer.rl.gradient = Gradient(gradient.section,
                                   lambda *args: held.append(("search", kept())) or gradient.search(*args),
                                   lambda *args: held.append(("backward", kept())) or gradient.backward(*args))
    whole = sum(p.numel() for p in teacher.parameters())
    for _ in range(2):
        assert fsdp.is_sharded(teacher) and kept() < 0.6 * whole
        trainer.start_step(1, 0.01)
        assert trainer.rl_step()["grad_norm"] > 0
        assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert [part for part, _ in held] == ["search", "search", "backward", "backward"] * 2  # --grad-accum 2
    assert all((n == whole) == (part == "backward") for part, n in held), held


def test_fsdp_on_two_processes_equals_one_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_task(tmp_path / "train.tsv", "reverse", 60, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 7, seed=1)
    words = ["a b c", "d e", "f", "g h a", "b d", "c e g", "h", "a f", "e b c", "g d"]
    (tmp_path / "htrain.tsv").write_text("".join(f"{s}\t{' '.join(reversed(s.split()))}\n" for s in words))
    (tmp_path / "hvalid.tsv").write_text("b a\ta b\nc d e\te d c\n")
    hf_tiny.save(tmp_path / "gpt2", "gpt2")
    hf_tiny.save(tmp_path / "t5", "t5", seed=1)
    hf_tiny.causal("gpt2", seed=2, width=24).save_pretrained(tmp_path / "gpt2_teacher")  # its tokenizer: gpt2's
    assert cli.main(["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "valid.tsv"), *LSTM,
                     "--hidden-size", "24", "--mle-steps", "2", "--rl-steps", "0", "--no-compare-mle",
                     "--save-dir", str(tmp_path / "teacher")]) == 0  # the LSTM student's teacher, wider
    cases = _cases(tmp_path)
    runs = _two_process_runs(tmp_path, cases)
    port = _free_port()
    # fork: the children need no fresh import of torch and transformers (seconds on a busy machine)
    ctx = mp.start_processes(_two, args=(port, runs, str(tmp_path / "out%d.txt")), nprocs=2, join=False,
                             start_method="fork")
    for name, argv in cases.items():  # meanwhile, one process each
        assert cli.main([*argv, "--save-dir", str(tmp_path / f"one_{name}")]) == 0, name
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=2) and time.monotonic() < deadline:  # join raises if a child failed
        pass
    if any(process.is_alive() for process in ctx.processes):
        for process in ctx.processes:
            process.kill()
        pytest.fail("the two processes did not finish within 240 s")
    out = (tmp_path / "out0.txt").read_text() + (tmp_path / "out1.txt").read_text()

    for name in cases:
        one, both = _load(tmp_path / f"one_{name}"), _load(tmp_path / f"two_{name}")
        # the first step's loss and gradient norm to float32's portable 1e-5; the parameters after a few Adam
        # steps to 1e-4: Adam moves a coordinate by about lr whatever its gradient's size, so where a gradient is
        # near zero the rounding of a rank's shapes and of the thread count (two threads: 1.2e-5 for "tree")
        # moves it by a sizeable share of lr
        first = [_rows(tmp_path / f"{run}_{name}")[0] for run in ("one", "two")]
        assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5), name
        assert first[1]["grad_norm"] == pytest.approx(first[0]["grad_norm"], rel=1e-5), name
        assert _relative(one["model"], both["model"]) < 1e-4, name
        # a single process's layout: plain whole tensors, the same keys and shapes, optimizer state included
        assert {k: v.shape for k, v in one["model"].items()} == {k: v.shape for k, v in both["model"].items()}
        assert all(type(v) is torch.Tensor for v in both["model"].values())
        mine, theirs = one["optimizer"]["state"], both["optimizer"]["state"]
        assert mine.keys() == theirs.keys() and all(theirs[i]["exp_avg"].shape == mine[i]["exp_avg"].shape
                                                    for i in mine)
        assert both["world_size"] == 2
    for kind in ("gpt2", "t5"):  # written once, by rank 0, whole
        assert out.count(str(tmp_path / f"two_{kind}" / "hf_final")) == 1
        assert (tmp_path / f"two_{kind}" / "hf_final" / "model.safetensors").is_file()
    # bit-exact --resume with the same number of processes
    resumed, straight = _load(tmp_path / "cut"), _load(tmp_path / "two_rows")
    assert resumed["step"] == straight["step"] == 4
    for k in straight["model"]:
        assert torch.equal(resumed["model"][k], straight["model"][k]), k
    for i, s in straight["optimizer"]["state"].items():
        assert all(torch.equal(resumed["optimizer"]["state"][i][key], v) for key, v in s.items()), i
    _check_karel(tmp_path)
    _check_policy(tmp_path)
    _check_distill(tmp_path)


def _rows(run: Path, phases=("mle", "rl")) -> list:
    """The run's training steps in metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] in phases]


def _rl_rows(run: Path) -> list:
    return _rows(run, ("rl",))


def _check_karel(d: Path) -> None:
    """Karel inside the grammar's wrapper. Its masked tokens' gradient is 0 up to float32 rounding, which Adam's
    first step turns into +-lr (in one process the chunk size alone moves the parameters by 2.6e-5 here, 1.4e-7
    without the grammar): the parameters are compared to 1e-4 above, the first step's loss and gradient norm to
    float32's portable 1e-5 there too."""
    # the policy's sharded reference inside the wrapper: a plain run's keys, whole tensors; its KL one process's
    refs = [_load(d / f"{run}_karel_policy")["policy"]["reference"]["state"] for run in ("one", "two")]
    assert refs[0].keys() == refs[1].keys() == _load(d / "one_karel")["model"].keys()
    assert _relative(refs[0], refs[1]) < 1e-4 and all(type(v) is torch.Tensor for v in refs[1].values())
    kl = [_rl_rows(d / f"{run}_karel_policy")[1]["kl"] for run in ("one", "two")]
    assert kl[0] > 1e-8 and kl[1] == pytest.approx(kl[0], rel=1e-2)


def _check_distill(d: Path) -> None:
    """--objective distill: every RL step's loss (the divergence over the global batch's tokens) and gradient
    norm one process's, under --fsdp and data-parallel training; the parameters too (checked above for --fsdp)."""
    ddp = _load(d / "distill_ddp")
    assert _relative(_load(d / "one_distill")["model"], ddp["model"]) < 1e-5
    for name in ("distill", "gpt2_distill"):
        runs = [_rl_rows(d / f"{run}_{name}") for run in ("one", "two")]
        if name == "distill":
            runs.append(_rl_rows(d / "distill_ddp"))
        assert len(runs[0]) == 2 and all(r["loss"] > 0 for r in runs[0])
        for rows in runs[1:]:
            for a, b in zip(runs[0], rows, strict=True):
                assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and \
                    b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), name


def _check_policy(d: Path) -> None:
    """--objective policy under --fsdp: as data-parallel training, resumed bit-exactly mid-generation, and
    read by a plain process and by twophase-decode."""
    sharded, ddp = _load(d / "policy_fsdp"), _load(d / "policy_ddp")
    assert _relative(ddp["model"], sharded["model"]) < 1e-5
    assert sharded["policy"]["reference"]["kind"] == "copy"
    refs = [ddp["policy"]["reference"]["state"], sharded["policy"]["reference"]["state"]]
    assert _relative(*refs) < 1e-5  # the end-of-MLE model, float32 summed in another order by each layout
    assert all(type(v) is torch.Tensor for v in refs[1].values())
    gens = sharded["policy"]["rank_generations"]  # each rank's own sources (3 + 2) and candidates
    assert [g["used"] for g in gens] == [2, 2] and [len(g["parts"][0]["idx"]) for g in gens] == [3, 2]
    rl = _rl_rows(d / "policy_fsdp")
    assert [r["update_in_generation"] for r in rl] == [1, 2, 1, 2] and rl[1]["kl"] > 1e-8
    for a, b in zip(rl, _rl_rows(d / "policy_ddp")):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # stopped after step 3, inside the second generation, resumed: the same parameters and Adam state, bit for bit
    cut = _load(d / "policy_cut")
    assert cut["step"] == sharded["step"] == 6 and [r["update_in_generation"] for r in _rl_rows(d / "policy_cut")][-1] == 2
    assert all(torch.equal(cut["model"][k], v) for k, v in sharded["model"].items())
    for i, s in sharded["optimizer"]["state"].items():
        assert all(torch.equal(cut["optimizer"]["state"][i][key], v) for key, v in s.items()), i
    # one plain process continues it (another number of processes: a new generation) and decodes with it
    shutil.copytree(d / "policy_cut", d / "policy_plain")
    assert cli.main(["--resume", "--rl-steps", "5", "--save-dir", str(d / "policy_plain")]) == 0
    assert _rl_rows(d / "policy_plain")[-1]["update_in_generation"] == 1
    (d / "in.txt").write_text("a b c\nd e\n")
    assert decode.main(["--checkpoint", str(d / "policy_fsdp" / "checkpoint_last.pt"), "--input", str(d / "in.txt"),
                        "--output", str(d / "out.txt")]) == 0
    assert len((d / "out.txt").read_text().splitlines()) == 2


@pytest.mark.parametrize("flags, match", [
    ([], "--fsdp shards the model over the processes torchrun starts"),
])
def test_fsdp_without_torchrun_is_refused_in_one_line(flags, match, tmp_path, capsys):
    write_task(tmp_path / "train.tsv", "reverse", 10, seed=0)
    argv = ["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "train.tsv"), "--fsdp",
            "--save-dir", str(tmp_path / "run"), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("flags, match", [
    (dict(amp="fp16"), "--fsdp with --amp fp16"),
    (dict(export="best"), "--fsdp with --export best"),
    (dict(eval_only=True), "--eval-only trains nothing"),
    (dict(hf_model="m", train="t", valid="v", lora_r=4, objective="policy", sampler="sample", kl_beta=0.04),
     "--lora-r and --kl-beta"),
])
def test_flags_fsdp_does_not_shard_are_refused_under_torchrun(flags, match, monkeypatch):
    monkeypatch.setattr(distributed, "launched", lambda: True)
    fsdp.check(Config(fsdp=True))  # nothing to refuse
    fsdp.check(Config(**flags))  # without --fsdp: nothing to check
    with pytest.raises(ValueError, match=match):
        fsdp.check(Config(fsdp=True, **flags))


def test_without_sharding_gathered_is_a_no_op_and_whole_the_identity():
    model = torch.nn.Linear(2, 1)
    with fsdp.gathered(model, reduce=True) as inside:
        assert inside is model and not fsdp.is_sharded(model)
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None  # a plain model's gradient stays where autograd put it
    t = torch.ones(3)
    assert fsdp.whole(t) is t and fsdp.local(t) is t
