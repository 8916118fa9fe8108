"""The sections of the training configuration that say how a run computes, validates and is kept: phase two's
chunks and memory, every optimizer step, validation, the run's directory and checkpoints, and the system (device,
threads, precision, compilation, sharding). Each is a dataclass of documented fields (`arg`), as `sections`' are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .documented import DEFAULT_BEAM, FREE, PRESETS, Only, arg, check_size, parse_chunk, parse_device

SEED_MAX = 2**63 - 1  # torch's generators take [-2^63, 2^64); a process adds 1000 * rank, an epoch its number

# The choices of the choice fields, as types (a type checker reads them; --help and the checks read get_args)
Preset = Literal["g2p-long", "karel-paper"]
Export = Literal["last", "best"]
Amp = Literal["off", "bf16", "fp16"]
Compile = Literal["off", "on", "aot_eager", "eager"]
assert get_args(Preset) == tuple(PRESETS), "a preset without its name in Preset"


@dataclass
class PhaseTwoConfig:
    """Phase two: the candidates re-decoded teacher-forced in chunks over their prefix tree, each chunk's graph
    back-propagated and freed."""

    rescore_chunk: int | str = arg(128, parse=parse_chunk, resume=FREE)
    """phase two re-decodes at most this many candidates at a time; 'auto': the most whose graph (and --objective
    distill's teacher pass and states) fits in --memory-budget"""
    memory_budget: str | None = arg(None, parse=check_size, resume=FREE, only=Only("rescore_chunk", "auto"))
    """bytes a phase-two chunk may use with --rescore-chunk auto: its graph, and under --objective distill the
    teacher's decode and states, e.g. 2GiB"""
    profile_memory: bool = arg(False, resume=FREE)
    """report time, allocated/peak memory and autograd graph bytes of each part of a step (encoder, phase one, every
    phase-two chunk, optimizer step)"""


PhaseTwoConfig.title = "phase two: rescoring"


@dataclass
class StepConfig:
    """Every optimizer step, MLE's and RL's: gradient clipping, accumulation, non-finite steps."""

    clip_norm: float = arg(1.0, minimum=0.0)
    """clip the gradient norm to this (0: no clipping)"""
    grad_accum: int = arg(1, minimum=1)
    """batches whose gradients are accumulated before one optimizer step: N batches of B give the gradient of one
    batch of N*B exactly"""
    max_bad_steps: int = arg(5, minimum=0, resume=FREE)
    """non-finite losses/gradients skipped in a row before the run stops with a crash checkpoint"""


StepConfig.title = "steps (both phases)"


@dataclass
class EvaluationConfig:
    """Validation and test: when, with which beam, and the score that picks the best checkpoint."""

    test_beam: int = arg(0, minimum=0)
    """also decode the test split with this beam width (its scores as key@K, e.g. generalization@64); 0: --eval-beam
    only (--task karel: 64, the paper's)"""
    eval_every: int = arg(500, minimum=1, resume=FREE)
    """validate every N steps (and at the end of each phase)"""
    eval_beam: int = arg(DEFAULT_BEAM, minimum=1)
    """beam width when decoding for validation and test (1: greedy); twophase-decode's default is the same"""
    best_metric: str = arg("auto")
    """validation score that picks checkpoint_best.pt, saved at every validation that improves it: one of the task's
    metrics (g2p: word_acc, wer, per; tsv: word_acc (sequence accuracy), per (token error rate)), or reward, or with
    --reward bleu or chrf corpus_bleu (and corpus_chrf); auto: the task's main metric (word_acc for g2p, reward for
    tsv)"""


EvaluationConfig.title = "evaluation"


@dataclass
class RunConfig:
    """Its recipe and seed, directory, checkpoints and logs, and what this command does with the run (continue,
    start from, evaluate, export; docs/runs.md)."""

    preset: Preset | None = arg(None, choices=get_args(Preset))
    """a named recipe that sets other defaults (the flags given still win): g2p-long (docs/g2p.md), karel-paper
    (docs/karel.md)"""
    tensorboard: bool = arg(False, resume=FREE)
    """also write the metrics as TensorBoard scalars to <save-dir>/tensorboard (needs the tensorboard package: pip
    install 'twophase[tb]')"""
    picture: bool = arg(True, resume=FREE)
    """at the end of the run draw <save-dir>/curves.png: the arms from the branch point on (RL against MLE
    continued), then the whole run (needs matplotlib: pip install 'twophase[plot]'; the environment variable
    TWOPHASE_PICTURE=off turns it off too)"""
    log_every: int = arg(100, minimum=0, resume=FREE)
    """when stdout is not a terminal (no progress bar), print a progress line every N steps (0: never)"""
    seed: int = arg(1, minimum=0, maximum=SEED_MAX)
    """seed of every random number generator, in [0, 2^63 - 1] (what torch's generators take, with room for each
    process's offset)"""
    save_dir: str | None = arg(None, resume=FREE, inherited=False)
    """where checkpoints and metrics.jsonl are written (default: runs/<task>: runs/g2p, runs/tsv, runs/karel, or the
    custom task's name); a directory that holds another run is refused unless --resume or --overwrite"""
    save_every: int = arg(500, minimum=1, resume=FREE)
    """write checkpoint_last.pt (and a step checkpoint) every N steps, and at the end of each phase"""
    keep_last: int = arg(2, minimum=0, resume=FREE)
    """step checkpoints kept besides checkpoint_last.pt and checkpoint_best.pt"""
    resume: bool = arg(False, resume=FREE, inherited=False)
    """continue from <save-dir>/checkpoint_last.pt; its flags are the defaults, and a flag that would change the run
    (data, model, objective, K, reward, seed, a finished phase) is refused; --rl-steps may grow (docs/runs.md)"""
    overwrite: bool = arg(False, resume=FREE, inherited=False)
    """start afresh in a --save-dir that holds a run, deleting what that run wrote (checkpoints, logs, config.json,
    hf_final, after_step<N>/, tensorboard events), nothing else"""
    resume_from: str | None = arg(None, resume=FREE, inherited=False)
    """continue the run from this checkpoint (checkpoint_crash.pt, a step checkpoint, checkpoint_best.pt) in its own
    directory; checkpoints of later steps are moved to <save-dir>/after_step<N>/, never deleted"""
    init_from: str | None = arg(None, path=True)
    """start a new run (step 0, a fresh optimizer) from this checkpoint's model weights, e.g. RL from an MLE run's
    checkpoint_best.pt; its model-shape flags are the defaults, other values are refused"""
    eval_only: bool = arg(False, resume=FREE, inherited=False)
    """evaluate the checkpoint of --resume, --resume-from or --init-from on the validation and test data, print the
    table, write nothing"""
    export: Export | None = arg(None, choices=get_args(Export), resume=FREE)
    """export the run's last model, or its checkpoint_best.pt's, at the end: into the task's own export (--hf-model's
    <save-dir>/hf_final) or, for every other model, <save-dir>/model_final.pt, what twophase-decode reads without the
    run (default: --hf-model's hf_final of the last model; nothing else)"""


RunConfig.title = "run: directory, checkpoints, logs"


@dataclass
class SystemConfig:
    """Where and how the run computes: device, threads, precision, compilation, sharding. The same training
    whatever they are, up to rounding."""

    device: str = arg("auto", parse=parse_device, resume=FREE, inherited=False)
    """cpu, cuda, cuda:N, mps, or auto (cuda where available); under torchrun each process takes cuda:LOCAL_RANK"""
    deterministic: bool = arg(False, resume=FREE)
    """CUDA's deterministic algorithms (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN
    deterministic): repeated GPU runs, --resume and torchrun give the same bits, at some speed; the CPU is
    deterministic without it"""
    tf32: bool = arg(False, resume=FREE)
    """let CUDA float32 matmuls and convolutions use TF32 tensor cores (Ampere on): faster, ~1e-3 relative rounding,
    so search scores match phase two's log-probabilities only to that; default off: full float32"""
    threads: int = arg(0, minimum=0, resume=FREE)
    """CPU threads for torch; 0 (auto): 1 below --hidden-size 512 (--hf-model: the model's hidden size), whose small
    matrices gain little from more and stall when another process is busy on the machine, else torch's default (one
    per core); OMP_NUM_THREADS, where set, is left to decide; at most the machine's CPU cores"""
    fsdp: bool = arg(False, resume=FREE, inherited=False)
    """under torchrun: shard parameters, gradients and Adam's moments over the processes (PyTorch FSDP2); a step
    gathers the parameters once; docs/distributed.md"""
    amp: Amp = arg("off", choices=get_args(Amp), resume=FREE)
    """automatic mixed precision of both phases and the MLE steps: matmuls in bf16 or fp16 under torch.autocast,
    parameters, gradients and log-softmax in float32; fp16 (with loss scaling) needs CUDA, bf16 runs on CPU and CUDA"""
    compile: Compile = arg("off", choices=get_args(Compile), resume=FREE, inherited=False)
    """phase one's decode step (search, validation) through torch.compile: on (inductor), or aot_eager / eager
    (dynamo's tracing without code generation, to check that a model traces); phase two stays eager; where compiling
    fails the run goes on eagerly after one warning line (docs/compile.md)"""


SystemConfig.title = "system"
