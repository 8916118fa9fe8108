"""The run's set-up, in the order the run needs its parts (a recipe's `setup`, as torchtune's):

    1. system      the device, determinism, mixed precision, processes; what the machine lacks for the flags
    2. task        the task the flags name (no data yet), the flags it does not read, the run's directory
    3. reward      the reward (a typo fails in a second), the metric that picks the best checkpoint
    4. checkpoint  the run directory claimed, the checkpoint the command starts from read and checked
                   (`startpoint`: what it fixes), the task's data as that checkpoint recorded it, and the checks
                   that need the data (MLE without references, the reward called once and against the rows)
    5. model       built (or a user's), --init-from's weights, checked on a batch and against the machine's
                   memory, sharded, compiled, constrained to the task's grammar
    6. step        the trainer (the --objective's step family) and the run around it, at the checkpoint
    7. run dir     the old run --overwrite replaces removed, later checkpoints set aside, config.json, TensorBoard

then the command trains (`Run.train`), saves its final model and cleans up (`cli.run`). Each check lives with
what it checks (`tasks.check_flags`, `rewards.checks`, `modelcheck.check_model_on`, `constraints`,
`startpoint.check`, `startpoint.check_reference`); this module calls them in order. What a user hands
`twophase.fit` as Python objects (a reward function, a `Task`, a model) is adopted here as the plug-in its flag
would load, recorded under the name that finds it again (`module:qualname`).

`cfg` is never changed: what the run derives from it (the task's name, the absolute --hf-model, the save dir, the
reward, the best metric, whether the MLE control runs) goes into the run's own Config (`derived`), which the run
reads and records (its checkpoints' "config" and config.json). Bad input raises a one-line error; train.py prints
it and exits 2.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import fields

import torch

from .. import rewards, tasks
from ..compiling import compiled
from ..config import Config
from ..config import rules as configrules
from ..constraints import check_references as check_grammar_references
from ..constraints import constrain
from ..errors import UsageError
from ..modelcheck import check_model_on
from ..rewards import checks as reward_checks
from ..rewards import weighted
from ..rewards.registry import corpus_kinds
from ..system import amp, devices, distributed, fsdp, memory
from . import report, resume, rundir, startpoint, teacher
from .run import Run
from .startpoint import Start

PROG = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(("train.py", "twophase-train")) \
    else "train.py"  # messages name the command the user typed


def setup(cfg: Config, start: Start | None = None, given: frozenset | None = None, *, model=None, task=None,
          reward=None, lock: rundir.RunLock | None = None) -> Run:
    """The run of this command, ready for its first step. `start`: the checkpoint the command line's resolution
    read already (--resume, --init-from; read here where it was not); `given`: the flags set on the command line
    (default: the fields passed to the Config that change a default). `model`, `task`, `reward`: a user's own,
    given to `twophase.fit`, in place of the task's model, the task --task names and the reward --reward names.
    `lock`: taken on the save dir before the run's first write (the caller releases it, whatever happens)."""
    given = (changed_fields(cfg) & cfg.given()) if given is None else given
    check_flags(cfg, start)
    device = system(cfg)                                                         # 1. system
    run_cfg, task = task_of(cfg, given, task)                                    # 2. task
    run_cfg, reward = reward_of_run(run_cfg, task, reward, device)               # 3. reward
    stale, start = claimed(run_cfg, start, lock)                                 # 4. checkpoint
    resumed, init = startpoint.continued(run_cfg, start), startpoint.initial(run_cfg, start)
    run_cfg = with_data(run_cfg, task, reward, resumed or init, given)
    own_model = model is not None  # twophase.fit(model=...): a model the task does not build
    model, base = model_of(run_cfg, task, model, start, device)                  # 5. model
    training = Run.assemble(run_cfg, task, model, reward, device,                # 6. step
                            teacher.load(run_cfg, task, model, device))
    training.setup(resumed, base_model=base)  # --resume's checkpoint; the frozen base every checkpoint records
    training.own_model = own_model  # --export reads it back so
    start_run_dir(training, stale, resumed, startpoint.recipe_defaults(cfg))      # 7. run directory
    return training


def check_flags(cfg: Config, start: Start | None) -> None:
    """The flags alone, before anything is built: each field, the checks across fields and the start flags. Where
    the command starts from a checkpoint, a flag that differs from it is what went wrong rather than the
    combination (--resume --hf-model on an LSTM run inherits the run's --embed-dim, which --hf-model refuses; the
    flag at fault is --hf-model), so that is reported."""
    try:
        cfg.validate()
        startpoint.check_flags(cfg)
    except ValueError as err:
        startpoint.check(cfg, start)
        raise UsageError(str(err)) from None


# ------------------------------------------------------------------ 1. system
def system(cfg: Config) -> torch.device:
    """--device's device (under torchrun cuda:LOCAL_RANK), set up before any model runs (determinism, TF32:
    cuBLAS reads its workspace once), checked against --amp, --fsdp, --threads and --tensorboard; the processes
    joined; the flags' warnings printed once."""
    device = pick_device(cfg.device)
    try:
        devices.configure(cfg.deterministic, cfg.tf32)
        amp.check_device(cfg.amp, device)
        fsdp.check(cfg)
        configrules.check_machine(cfg, os.cpu_count())
    except ValueError as err:
        raise UsageError(str(err)) from None
    if cfg.tensorboard:
        try:
            report.writer_class()
        except ImportError as err:
            raise UsageError(str(err)) from None
    distributed.init(device)  # a no-op without torchrun
    if distributed.rank() == 0:  # once, not once per process
        for warning in cfg.warnings():
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    return device


def pick_device(name: str) -> torch.device:
    """--device's device, refused in one line (a UsageError) where this machine or torchrun process lacks it."""
    try:
        return devices.for_rank(devices.pick(name))
    except devices.DeviceError as err:
        raise UsageError(str(err)) from None


# ------------------------------------------------------------------ 2. task
def task_of(cfg: Config, given: frozenset, task=None):
    """The run's Config with the task's name and the absolute paths it records (--hf-model, --teacher: --resume
    and decoding find them from anywhere), and the task: built from the flags (cheap: no data yet), or a user's
    adopted; refused where it is given a shaping flag it does not read. The save dir follows from the task."""
    name = tasks.default_name(cfg)
    run_cfg = derived(cfg, task=name,
                      hf_model=os.path.abspath(cfg.hf_model) if cfg.hf_model is not None else None,
                      teacher=os.path.abspath(cfg.teacher) if cfg.teacher is not None else None)
    task = tasks.build(run_cfg) if task is None else tasks.adopt(task, name)
    tasks.check_flags(task, given)
    return derived(run_cfg, save_dir=save_dir_of(cfg, task)), task


def save_dir_of(cfg: Config, task) -> str:
    """--save-dir, or where it is not given: --init-from's own directory for --eval-only (which writes nothing),
    else runs/<task name> (a custom task without a name: its callable's)."""
    if cfg.eval_only and cfg.init_from and not (cfg.resume or cfg.resume_from):  # no new directory: its own
        return os.path.dirname(os.path.abspath(cfg.init_from))
    return cfg.save_dir or default_save_dir(task)


def default_save_dir(task) -> str:
    """--save-dir when not given: runs/<task name> (a custom task without a name: its callable's)."""
    name = task.name if task.name != tasks.Task.name else task.spec.rpartition(":")[2]
    return f"runs/{name.lower()}"


# ------------------------------------------------------------------ 3. reward
def reward_of_run(run_cfg: Config, task, reward=None, device=None):
    """The run's Config with the reward it records, and the reward: --reward's (the task's default where not
    given; a reward model's folder recorded as an absolute path, as --hf-model is), or a user's function(s)
    adopted; then the metric that picks the best checkpoint, which may be a score the reward reports."""
    spec = run_cfg.reward or task.default_reward
    if reward is None:
        spec = weighted.recorded(spec)
    run_cfg = derived(run_cfg, reward=spec)
    resume.check_reward_names(run_cfg, reward is not None)
    causal = getattr(task, "causal", False)  # a reward model scores prompt + completion, else (source, hypothesis)
    reward = weighted.from_flags(spec, run_cfg.reward_weights, device, causal) if reward is None else \
        reward_of(reward, spec, run_cfg.reward_weights)
    return derived(run_cfg, best_metric=resolve_best_metric(run_cfg, task, reward)), reward


def resolve_best_metric(cfg: Config, task, reward=None) -> str:
    """--best-metric: auto means the task's main metric (its reward where it names none); anything else must be
    one of the task's metrics, reward, or a corpus score `reward` reports (corpus_bleu with bleu or chrf)."""
    if cfg.best_metric == "auto":
        return task.main_metric or "reward"
    known = [m.key for m in task.metrics] + ["reward"] + [f"corpus_{kind}" for kind in corpus_kinds(reward)]
    if cfg.best_metric not in known:
        raise UsageError(f"--best-metric {cfg.best_metric}: task '{task.spec}' reports {', '.join(known)}")
    return cfg.best_metric


# ------------------------------------------------------------------ 4. checkpoint, and the data it fixes
def claimed(cfg: Config, start: Start | None, lock: rundir.RunLock | None = None):
    """The save dir checked (writable, no other process writing there: `lock` taken, by the main process; holding
    no other run; the files --overwrite is to delete, once the run can start: `stale`), and the checkpoint the
    command starts from, read where the command line's resolution did not, and checked against the flags."""
    stale = []
    try:
        if not cfg.eval_only:  # --eval-only writes nothing, anywhere
            rundir.check_writable(cfg.save_dir)
            take_lock(lock, cfg.save_dir)
            stale = rundir.claim(cfg.save_dir, bool(cfg.resume or cfg.resume_from), cfg.overwrite)
    except ValueError as err:
        raise UsageError(str(err)) from None
    start = start if start is not None else startpoint.read(cfg)
    startpoint.check(cfg, start)
    return stale, start


def take_lock(lock: rundir.RunLock | None, save_dir: str | None) -> None:
    """The main process takes the save dir's lock; under torchrun every process learns whether it could (one
    gather), so a refusal stops them all with the same line."""
    refused = None
    if lock is not None and distributed.rank() == 0:
        try:
            lock.acquire(save_dir)
        except rundir.Busy as err:
            refused = str(err)
    refused = distributed.gather_objects(refused)[0] if lock is not None else refused
    if refused is not None:
        raise UsageError(refused)


def with_data(run_cfg: Config, task, reward, state: dict | None, given: frozenset) -> Config:
    """The task's data, its ids restored from the checkpoint (whatever the data would build today), and the
    checks that need it: MLE and its control need references; enough sources for every process; the reward
    called once, and refused on rows it cannot score; a batch the data cannot fill. The run's Config records
    generated splits (countdown's TSV files) as its --train/--valid/--test, and the MLE control it runs."""
    if state is not None and "task" in state:
        task.load_state_dict(state["task"]["state"])
    task.load_data()
    if distributed.rank() == 0:
        for note in task.notes:
            print(note)
    if not task.train or not task.valid:
        raise UsageError(f"task '{task.spec}' has no {'training' if not task.train else 'validation'} examples")
    files = task.data_files() if callable(getattr(task, "data_files", None)) else {}  # a plug-in may predate it
    if files:
        run_cfg = derived(run_cfg, **{split: str(path) for split, path in files.items()})
    if not mle_possible(run_cfg, task, given):  # the control it runs: off without references
        run_cfg = derived(run_cfg, compare_mle=False)
    if distributed.world() > min(run_cfg.batch_size, run_cfg.mle_batch_size, len(task.train)):
        raise UsageError(f"--batch-size {run_cfg.batch_size} and --mle-batch-size {run_cfg.mle_batch_size} count "
                         f"the sources of a whole step; {distributed.world()} processes need at least one each")
    default = "reward" not in given and run_cfg.reward == getattr(task, "default_reward", None)
    reward_checks.check_references(reward, run_cfg.reward, default, run_cfg.train, task)
    reward_checks.check_calls(reward, task)
    if distributed.rank() == 0:
        pairs = sum(len(ex.references) for ex in task.train)
        for warning in batch_warnings(run_cfg, len(task.train), pairs, given):
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    return run_cfg


def mle_possible(cfg: Config, task, given: frozenset[str]) -> bool:
    """A task whose training examples have no references (a verifier's reward reads the source) trains RL
    only: MLE steps, --mle-weight and an explicit --compare-mle are refused. Whether the MLE control runs: the
    default comparison is off there (the Config is left as it is; the run records the control it ran)."""
    if any(ex.references for ex in task.train):
        return cfg.compare_mle
    where = f"task '{task.spec}' has no references to train MLE on"
    if cfg.mle_steps > 0:
        default = "" if "mle_steps" in given else " (the default)"
        raise UsageError(f"--mle-steps {cfg.mle_steps}{default}: {where}; train RL only with --mle-steps 0")
    if cfg.mle_weight > 0:
        raise UsageError(f"--mle-weight {cfg.mle_weight:g}: {where}; leave it at 0")
    if cfg.compare_mle and cfg.rl_steps > 0:
        if "compare_mle" in given:
            raise UsageError(f"--compare-mle: {where}, so there is no MLE to continue; drop the flag")
        if distributed.rank() == 0:  # the default control needs references: off, as --no-compare-mle
            print("note: --compare-mle cannot run: the training data has no references to continue MLE on; "
                  "skipped", flush=True)
        return False
    return cfg.compare_mle


def batch_warnings(cfg, sources: int, pairs: int, given: frozenset) -> list[str]:
    """A batch size given on the command line that the training data cannot fill: each step then takes all of
    it, fewer than asked (one line each; the recipe's and the defaults' sizes are capped without a word)."""
    out = []
    for name, phase, steps, n, what in (("batch_size", "RL", cfg.rl_steps, sources, "sources"),
                                         ("mle_batch_size", "MLE", cfg.mle_steps, pairs, "(source, reference) pairs")):
        size = getattr(cfg, name)
        if name in given and steps > 0 and 0 < n < size:
            out.append(f"--{name.replace('_', '-')} {size}: the training data has {n} {what}, so each {phase} "
                       f"step takes all {n}")
    return out


# ------------------------------------------------------------------ 5. model
def model_of(cfg: Config, task, model, start: Start | None, device: torch.device):
    """The model the run trains, and the frozen base its saved parameters need (--lora-r: `resume.record`'s):
    seeded, built by the task (or a user's, `twophase.fit(model=...)`), on the device; the checkpoint's
    parameters checked against it (--resume: the task rebuilds its own model) or loaded into it (--init-from);
    --ref-checkpoint checked; checked against the protocol on a batch and against the machine's memory; the same
    on every process; sharded (--fsdp, before the optimizer: it is built on the shards); compiled (--compile); the
    task's grammar around it (--grammar on)."""
    torch.manual_seed(cfg.seed)
    threads = cpu_threads(cfg, getattr(task, "model_width", None))
    if threads:
        torch.set_num_threads(threads)
    own = model is not None
    model = (task.build_model() if model is None else model).to(device)
    base = resume.record(model, cfg.hf_model)  # the frozen part's base, if any
    resumed, init = startpoint.continued(cfg, start), startpoint.initial(cfg, start)
    where = start.where if start is not None else ""
    if resumed is not None:  # a --lora-r checkpoint's adapters need the base they were trained on
        resume.check(resumed.get("base_model"), base, where, cfg.hf_model)
        if not own:
            resume.check_rebuilt(model, resumed, where)
    if init is not None:  # --init-from: its weights (a --lora-r run's: its adapters); step 0, a fresh optimizer
        resume.check(init.get("base_model"), base, where, cfg.hf_model)
        resume.load_init(model, init, cfg.init_from)
    startpoint.check_reference(cfg, model)  # --ref-checkpoint: now, not at the first RL step
    check_model_on(model, task, device)  # a broken model named now, not trained silently
    check_resources(cfg, task, model, device)  # a size the machine cannot hold named now, not at its step
    distributed.broadcast_parameters(model)  # the seed already agrees; this makes sure
    if cfg.fsdp:
        fsdp.shard_model(model)
    model = compile_step(model, cfg.compile)
    model = constrain(model, task, cfg.grammar, cfg.max_len)
    check_grammar_references(model, task, device)
    if distributed.rank() > 0:  # its own dropout masks; rank 0 goes on as a single process would
        torch.manual_seed(cfg.seed + 1000 * distributed.rank())
    return model, base


def cpu_threads(cfg: Config, width: int | None = None) -> int | None:
    """--threads, or for 0 (auto) the count to set (None: leave torch's default). A small model's matmuls are
    too small to share out, and torch's threads wait for one another at every op, which stalls them all while
    another process is busy on the machine. `width`: the model's hidden size where the task's model is not the
    LSTM of --hidden-size (--hf-model)."""
    if cfg.threads:
        return cfg.threads
    if "OMP_NUM_THREADS" in os.environ or (width or cfg.hidden_size) >= 512:
        return None  # the user's (or torchrun's) choice; large matmuls do gain from every core
    return 1


def check_resources(cfg: Config, task, model, device) -> None:
    """Every search, MLE step and phase-two chunk the flags size, estimated from the model's measured decoder
    state and vocabulary (`config.rules.memory_needs`), against the memory `device` has available: the first
    that cannot fit is refused in one line naming its flags, before any step (rather than a run that allocates
    for minutes, or dies at its first validation)."""
    if cfg.eval_only:
        return
    try:
        state, step, vocab = memory.row_state_bytes(model, task.collate(task.train[:1], device))
    except Exception:  # noqa: BLE001 - a model of the user's this probe cannot drive: nothing to estimate from
        return
    rows = [row for ex in task.train for row in task.target_ids(ex)]
    longest = min(max(map(len, rows), default=0) + 1, cfg.max_len)  # EOS included
    needs = configrules.memory_needs(cfg, vocab=vocab, state=state, step=step, valid=len(task.valid),
                                     test=len(task.test or ()), target_len=longest, sources=len(task.train),
                                     pairs=len(rows), world=distributed.world())
    try:
        configrules.check_memory(cfg, needs, memory.available_bytes(device), str(device))
    except ValueError as err:
        raise UsageError(str(err)) from None


def compile_step(model, flag: str):
    """--compile: the model with phase one's decode step through torch.compile (`twophase.compiled`; the grammar
    of --grammar on wraps it, eager), or the model itself (off)."""
    if flag == "off":
        return model
    return compiled(model, backend="inductor" if flag == "on" else flag)


# ------------------------------------------------------------------ 7. run directory
def start_run_dir(training: Run, stale: list, resumed: dict | None, recipe: dict) -> None:
    """The main process's, where the command writes (not --eval-only): --overwrite's old run and the residue of
    writes a killed process left removed (only now: a typo in a flag costs the old run nothing); a resumed run
    sets aside the checkpoints of later steps (never deleted) and cuts its logs back to the checkpoint (one run,
    one log: rows of steps after it were lost with it); every run writes config.json; --tensorboard's folder."""
    if distributed.rank() == 0:
        rundir.remove(stale)
    cfg = training.trainer.cfg
    if not training.is_main or cfg.eval_only:
        return
    path = resume.resume_path(cfg)
    step = training.state.step
    if cfg.resume and path is not None and path.name != "checkpoint_last.pt":
        print(f"note: {path.name} (step {step}) is newer than checkpoint_last.pt, whose write was cut "
              f"short: continuing from it", flush=True)
    if resumed is not None:
        aside = rundir.set_aside(training.save_dir, step)
        if aside is not None:
            print(f"note: continuing from step {step}: the checkpoints of later steps were moved to {aside} "
                  "(with a copy of metrics.jsonl); nothing was deleted", flush=True)
        for log in rundir.LOGS:
            rundir.cut_back(training.save_dir / log, step, training.state.compared)
    rundir.write_config(training.save_dir, cfg, recipe, path or cfg.init_from)
    if cfg.tensorboard:
        open_tensorboard(training, resumed=resumed is not None)


def open_tensorboard(training: Run, resumed: bool) -> None:
    """--tensorboard: <save-dir>/tensorboard, its steps after the checkpoint purged on --resume (as in
    metrics.jsonl); a new run starts without the event files of the run it replaces."""
    folder = training.save_dir / "tensorboard"
    if not resumed and folder.is_dir():
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
    writer = report.writer_class()(log_dir=str(folder), purge_step=training.state.log_step + 1 if resumed else None)
    training.metrics.mirror = report.TensorBoardLog(writer, lambda: training.state.mle_end)


# ------------------------------------------------------------------ the run's own Config
def derived(cfg: Config, **values) -> Config:
    """A new Config: `cfg` with the values a run derives from it (`setup`'s), `cfg` itself unchanged."""
    return dataclasses.replace(cfg, **values)


def changed_fields(cfg: Config) -> frozenset[str]:
    """Without a command line (a Config built in Python): the fields that differ from their defaults."""
    return frozenset(f.name for f in fields(cfg) if getattr(cfg, f.name) != f.default)


# ------------------------------------------------------------------ a user's own parts (twophase.fit)
def spec_of(obj) -> str:
    """`module:qualname` of a function or of an object's class: what --reward / --task would load it by (a
    function defined in a script or notebook is `__main__:name`, found again only from that program)."""
    target = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', None) or '__main__'}:{target.__qualname__}"


def reward_specs(reward) -> list[str]:
    """The names a reward function (or a list of them, summed) is recorded by in Config.reward."""
    return [spec_of(fn) for fn in (reward if isinstance(reward, (list, tuple)) else [reward])]


def reward_of(reward, spec: str, weights: str | None):
    """A callable in either reward signature (`(hypotheses, references, **context)`, or TRL's `(prompts,
    completions, ...)`), or a list of them summed with --reward-weights, validated as a plug-in of that name:
    a RewardError (one line) names it where it fails."""
    fns = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    names = weighted.names(spec)
    for fn in fns:
        if not callable(fn):
            raise rewards.RewardError(f"reward {fn!r}: {type(fn).__name__} object is not callable")
    if len(names) != len(fns):
        raise rewards.RewardError(f"reward: {len(fns)} functions recorded as {len(names)} names ({spec})")
    checked = [rewards.validated(fn, name) for fn, name in zip(fns, names)]
    if weights is None and len(checked) == 1:
        return checked[0]
    values = weighted.parse_weights(weights, len(checked), "reward_weights", "reward function")
    return weighted.WeightedSum(checked, values, weighted.display_names(names, checked))
