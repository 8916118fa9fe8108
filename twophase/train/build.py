"""The set-up of a run from its configuration: the task, its data, the reward, the model (compiled, sharded,
constrained to the task's grammar), the run directory and the trainer, each checked before the first step
(`build`). What a user hands `twophase.fit` as Python objects (a reward function, a `Task`) is adopted here as the
plug-in its flag would load, recorded under the name that finds it again (`module:qualname`).

Bad input raises UsageError (or the part's own one-line error); train.py prints it and exits 2.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

from ..system import amp, devices, distributed, fsdp, memory
from . import report, resume, rundir, teacher
from .start import (batch_warnings, changed_fields, check_model_on_a_batch, check_references, check_reward_references,
                    check_task_flags, init_state, recipe_defaults, refuse_against_checkpoint, resume_state,
                    start_run_dir)
from .. import rewards, tasks
from ..rewards import weighted
from ..rewards.registry import corpus_kinds
from ..compiling import compiled
from ..constraints import Constrained, GrammarError, teacher_forced_allowed
from ..vocab import pad_targets
from ..config import Config
from ..config import rules as configrules
from ..errors import OneLineError
from ..rewards.calls import score
from .run import Run


PROG = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(("train.py", "twophase-train")) \
    else "train.py"  # messages name the command the user typed


class UsageError(OneLineError, ValueError):
    """A problem with what the user gave us; printed as one line, exit status 2 (twophase.fit: raised)."""


def pick_device(name: str) -> torch.device:
    """--device's device, refused in one line (a UsageError) where this machine or torchrun process lacks it."""
    try:
        return devices.for_rank(devices.pick(name))
    except devices.DeviceError as err:
        raise UsageError(str(err)) from None


def check_reward(reward, task) -> None:
    """Call the reward once before anything slow, on answers whose scores exist whatever the reward means: the
    references of the first two training sources against themselves, and an empty hypothesis. A plug-in that
    raises or returns NaN then stops the run in seconds, not at the first validation after the warm start."""
    examples = [ex for ex in task.train[:2] if ex.references]
    if not examples:  # a task without references (execution rewards, say): an empty hypothesis only
        examples = task.train[:1]
    hyps = [ex.references[0] if ex.references else "" for ex in examples] + [""]
    ids = [task.target_ids(ex)[0] if ex.references else [] for ex in examples] + [[]]  # without eos
    try:
        score(reward, hyps, examples + examples[:1], ids)
    except rewards.RewardError as err:
        refs = sum(bool(ex.references) for ex in examples)
        checked = f"{refs} training references scored against themselves and " if refs else ""
        raise rewards.RewardError(f"{err} (start-up check: {checked}an empty hypothesis)") from None


def load_task_data(task, state: dict | None) -> None:
    """The task's data, its ids restored from the checkpoint on --resume (whatever the data would build today)."""
    if state is not None and "task" in state:
        task.load_state_dict(state["task"]["state"])
    task.load_data()
    if distributed.rank() == 0:
        for note in task.notes:
            print(note)
    if not task.train or not task.valid:
        raise UsageError(f"task '{task.spec}' has no {'training' if not task.train else 'validation'} examples")


def resolve_best_metric(cfg: Config, task, reward=None) -> str:
    """--best-metric: auto means the task's main metric (its reward where it names none); anything else must be
    one of the task's metrics, reward, or a corpus score `reward` reports (corpus_bleu with bleu or chrf)."""
    if cfg.best_metric == "auto":
        return task.main_metric or "reward"
    known = [m.key for m in task.metrics] + ["reward"] + [f"corpus_{kind}" for kind in corpus_kinds(reward)]
    if cfg.best_metric not in known:
        raise UsageError(f"--best-metric {cfg.best_metric}: task '{task.spec}' reports {', '.join(known)}")
    return cfg.best_metric


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


def build(cfg: Config, start: dict | None = None, given: frozenset | None = None, *, model=None, task=None,
          reward=None, lock: rundir.RunLock | None = None) -> Run:
    """The run of this command; `start`: the checkpoint main() read already (--resume, --init-from);
    `given`: the flags set on the command line (default: the fields passed to the Config that change a default).
    `model`, `task`, `reward`: a user's own, given to `twophase.fit` (adopt_task, reward_of), in place of the
    task's model, the task --task names and the reward --reward names. `lock`: taken on the save dir before the
    run's first write (the caller releases it, whatever happens).

    `cfg` is not changed. What the run derives from it and its task (the task's name, the absolute --hf-model,
    the save dir, the reward, the best metric, whether the MLE control runs) goes into the run's own Config
    (`derived`), a new one, which the run reads and records: its checkpoints' "config" and config.json."""
    given = (changed_fields(cfg) & cfg.given()) if given is None else given
    try:
        cfg.validate()
        resume.check_flags(cfg)
    except ValueError as err:
        try:  # a flag that differs from the checkpoint's is what went wrong, rather than the combination
            refuse_against_checkpoint(cfg, start)
        except ValueError as fixed:
            raise UsageError(str(fixed)) from None
        raise UsageError(str(err)) from None
    device = pick_device(cfg.device)  # under torchrun: cuda:LOCAL_RANK
    try:
        devices.configure(cfg.deterministic, cfg.tf32)  # before any model runs: cuBLAS reads its workspace once
        amp.check_device(cfg.amp, device)
        fsdp.check(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from None
    distributed.init(device)  # a no-op without torchrun
    if distributed.rank() == 0:  # once, not once per process
        for warning in cfg.warnings():
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    # recorded as resolved: the task's name; --hf-model and --teacher as absolute paths (--resume and decoding
    # find them from anywhere)
    run_cfg = derived(cfg, task=tasks.default_name(cfg),
                      hf_model=os.path.abspath(cfg.hf_model) if cfg.hf_model is not None else None,
                      teacher=os.path.abspath(cfg.teacher) if cfg.teacher is not None else None)
    task = tasks.build(run_cfg) if task is None else adopt_task(task, run_cfg.task)  # cheap: no data yet
    check_task_flags(task, given)
    reward_spec = cfg.reward or task.default_reward
    if reward is None:  # a reward model's folder recorded as an absolute path, as --hf-model is
        reward_spec = weighted.recorded(reward_spec)
    run_cfg = derived(run_cfg, save_dir=run_dir(cfg, task), reward=reward_spec)
    try:
        resume.check_reward_names(run_cfg, reward is not None)
    except ValueError as err:
        raise UsageError(str(err)) from None
    causal = getattr(task, "causal", False)  # a reward model scores prompt + completion, else (source, hypothesis)
    reward = weighted.from_flags(reward_spec, cfg.reward_weights, device, causal) if reward is None else \
        reward_of(reward, reward_spec, cfg.reward_weights)  # before loading data: a typo fails in a second
    run_cfg = derived(run_cfg, best_metric=resolve_best_metric(cfg, task, reward))
    if cfg.tensorboard:
        try:
            report.writer_class()
        except ImportError as err:
            raise UsageError(str(err)) from None
    stale, state, init = claim_and_read(run_cfg, start, lock)
    load_task_data(task, state if state is not None else init)
    files = task.data_files() if callable(getattr(task, "data_files", None)) else {}  # a plug-in may predate it
    if files:  # generated splits (countdown's TSV files): recorded as the run's --train/--valid/--test
        run_cfg = derived(run_cfg, **{split: str(path) for split, path in files.items()})
    if not check_references(run_cfg, task, given):  # the control it runs: off without references
        run_cfg = derived(run_cfg, compare_mle=False)
    if distributed.world() > min(cfg.batch_size, cfg.mle_batch_size, len(task.train)):
        raise UsageError(f"--batch-size {cfg.batch_size} and --mle-batch-size {cfg.mle_batch_size} count the "
                         f"sources of a whole step; {distributed.world()} processes need at least one each")
    check_reward_references(run_cfg, reward, task, given)
    check_reward(reward, task)
    if distributed.rank() == 0:
        pairs = sum(len(ex.references) for ex in task.train)
        for warning in batch_warnings(cfg, len(task.train), pairs, given):
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    try:
        configrules.check_machine(cfg, os.cpu_count())
    except ValueError as err:
        raise UsageError(str(err)) from None
    torch.manual_seed(cfg.seed)
    threads = cpu_threads(cfg, getattr(task, "model_width", None))
    if threads:
        torch.set_num_threads(threads)
    own_model = model is not None  # twophase.fit(model=...): a model the task does not build
    model = (task.build_model() if model is None else model).to(device)
    base = resume.record(model, run_cfg.hf_model)  # the frozen part's base, if any
    try:  # a --lora-r checkpoint's adapters need the base they were trained on
        if state is not None:
            where = f"{'--resume-from' if cfg.resume_from else '--resume'}: {resume.resume_path(run_cfg)}"
            resume.check(state.get("base_model"), base, where, run_cfg.hf_model)
            if not own_model:
                resume.check_rebuilt(model, state, where)
        if init is not None:  # --init-from: its weights (a --lora-r run's: its adapters); step 0, a fresh optimizer
            resume.check(init.get("base_model"), base, f"--init-from {cfg.init_from}", run_cfg.hf_model)
            resume.load_init(model, init, cfg.init_from)
        resume.check_reference(run_cfg, model)  # --ref-checkpoint: now, not at the first RL step
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_model_on_a_batch(task, model, device)  # a broken model named now, not trained silently
    check_resources(run_cfg, task, model, device)  # a size the machine cannot hold named now, not at its step
    distributed.broadcast_parameters(model)  # the seed already agrees; this makes sure
    if cfg.fsdp:  # before the optimizer: it is built on the shards
        fsdp.shard_model(model)
    model = compile_step(model, cfg.compile)
    try:  # --grammar on: the task's grammar around the model, for every search, score and gradient
        model = constrain(model, task, cfg.grammar, cfg.max_len)
        check_grammar_references(model, task, device)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if distributed.rank() > 0:  # its own dropout masks; rank 0 goes on as a single process would
        torch.manual_seed(cfg.seed + 1000 * distributed.rank())
    if distributed.rank() == 0:
        rundir.remove(stale)  # --overwrite's old run; the residue of writes a killed process left
    training = Run.assemble(run_cfg, task, model, reward, device, teacher.load(run_cfg, task, model, device))
    training.setup(state, base_model=base)  # --resume's checkpoint; the frozen base every checkpoint records
    training.own_model = own_model
    if training.is_main and not cfg.eval_only:
        start_run_dir(training, state, recipe_defaults(cfg))
    if cfg.tensorboard and training.is_main and not cfg.eval_only:
        open_tensorboard(training, resumed=state is not None)
    return training


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


def derived(cfg: Config, **values) -> Config:
    """A new Config: `cfg` with the values a run derives from it (`build`'s), `cfg` itself unchanged."""
    return dataclasses.replace(cfg, **values)


def run_dir(cfg: Config, task) -> str:
    """--save-dir, or where it is not given: --init-from's own directory for --eval-only (which writes nothing),
    else runs/<task> (default_save_dir)."""
    if cfg.eval_only and cfg.init_from and not (cfg.resume or cfg.resume_from):  # no new directory: its own
        return os.path.dirname(os.path.abspath(cfg.init_from))
    return cfg.save_dir or default_save_dir(task)


def compile_step(model, flag: str):
    """--compile: the model with phase one's decode step through torch.compile (`twophase.compiled`; the grammar
    of --grammar on wraps it, eager), or the model itself (off)."""
    if flag == "off":
        return model
    return compiled(model, backend="inductor" if flag == "on" else flag)


def claim_and_read(cfg: Config, start: dict | None, lock: rundir.RunLock | None = None):
    """The save dir checked (writable, no other process writing there: `lock` taken, by the main process; holding
    no other run; the files --overwrite is to delete, once the run can start), and the checkpoint --resume
    continues (`state`) or --init-from starts from (`init`), checked."""
    stale = []
    try:
        if not cfg.eval_only:  # --eval-only writes nothing, anywhere
            rundir.check_writable(cfg.save_dir)
            take_lock(lock, cfg.save_dir)
            stale = rundir.claim(cfg.save_dir, bool(cfg.resume or cfg.resume_from), cfg.overwrite)
        return stale, resume_state(cfg, start), init_state(cfg, start)
    except ValueError as err:
        raise UsageError(str(err)) from None


def take_lock(lock: rundir.RunLock | None, save_dir: str) -> None:
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


def default_save_dir(task) -> str:
    """--save-dir when not given: runs/<task name> (a custom task without a name: its callable's)."""
    name = task.name if task.name != tasks.Task.name else task.spec.rpartition(":")[2]
    return f"runs/{name.lower()}"


def open_tensorboard(training: Run, resumed: bool) -> None:
    """--tensorboard: <save-dir>/tensorboard, its steps after the checkpoint purged on --resume (as in
    metrics.jsonl); a new run starts without the event files of the run it replaces."""
    folder = training.save_dir / "tensorboard"
    if not resumed and folder.is_dir():
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
    writer = report.writer_class()(log_dir=str(folder), purge_step=training.state.log_step + 1 if resumed else None)
    training.metrics.mirror = report.TensorBoardLog(writer, lambda: training.state.mle_end)


# ---- --grammar on: the task's grammar around the model, for every search, score and gradient
def constrain(model, task, grammar: str, max_len: int, flag: str = "--grammar"):
    """The model constrained to the task's grammar for rows of at most max_len positions, or the model itself
    (grammar 'off'); a one-line ValueError (the command's usage error) where the task has no grammar or refuses
    max_len."""
    if grammar == "off":
        return model
    try:
        g = task.grammar(max_len)
    except ValueError as err:
        raise ValueError(f"{flag} on: {err}") from None
    if g is None:
        raise ValueError(f"{flag} on: task '{getattr(task, 'spec', task.name)}' declares no grammar "
                         "(Task.grammar returns None)")
    return Constrained(model, g)


def check_grammar_references(model, task, device, batch_size: int = 4096) -> None:
    """Every training reference must be a sequence of the grammar (within --max-len): MLE would otherwise train
    on rows of probability zero (log p = -inf). A ValueError naming how many fail, with the first one."""
    if not isinstance(model, Constrained):
        return
    rows = [(i, ids) for i, ex in enumerate(task.train) for ids in task.target_ids(ex)]
    bad = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            tokens = pad_targets([ids for _, ids in part], device, model.pad_id, model.eos_id)  # (n, T)
            try:
                ok = teacher_forced_allowed(model, tokens, torch.arange(len(part), device=device)).all(1)  # (n,)
            except GrammarError as err:
                raise ValueError(f"--grammar on: {err}") from None
            bad += [part[k][0] for k in (~ok).nonzero().squeeze(1).tolist()]
    if bad:
        example = task.train[bad[0]].references[0]
        raise ValueError(f"--grammar on: {len(bad)} training references are not in the task's grammar within "
                         f"--max-len (the first: {example!r}); a longer --max-len, or --grammar off")


# ---- a user's own parts (twophase.fit)
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


def adopt_task(task, spec: str):
    """A `Task` instance as the run's task, found again by `spec` (its Config.task); TaskError where it lacks a
    method a task must have."""
    missing = [m for m in tasks.REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise tasks.TaskError(f"task {type(task).__name__} (given to fit) has no {', '.join(missing)} "
                              "(subclass twophase.tasks.Task)")
    task.spec = spec
    task.origin = tasks.origin(spec)
    return task
