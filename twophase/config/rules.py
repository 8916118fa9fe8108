"""What a `Config` may not hold, and what a resumed run may change.

`validate`: the cross-field checks the parser cannot express (a ConfigError naming the flag); flags that would do
nothing are refused too (a run that ignores what it was told is worse than one that does not start), by one rule
over the conditions the sections declare (`refuse_inert`). `warnings`: configurations that train but are probably
not meant. `check`: the resume rules each field declares (`arg(resume=...)`): on `--resume` (and `--resume-from`)
the checkpoint's resolved configuration is the default, so a forgotten flag is the run's own value; a flag given
that would change what the run means (its data, task, model, objective, sampler, K, reward, metric, seed, the
length of a phase already passed) is refused in one line naming the flag and both values, and only flags that
extend or observe the run may change. A field that declares no rule is FIXED: a flag added later is safe by
default, and becomes free only by being declared so.
"""
from __future__ import annotations

import math
import os
from dataclasses import fields
from pathlib import Path

from .documented import FIXED, FREE, GROW, MRT_ALPHA, PHASE, _flag  # noqa: F401 (the rules' names, for importers)
from .sections import FIELDS, only_conditions, section_fields
from .values import ConfigError

WITHOUT_REPLACEMENT = ("priority", "unordered-set")  # the objectives that need --sampler sbs


def refuse_inert(cfg, names, own: bool = True) -> None:
    """The one rule behind every "applies to X only": a field of `names` given (differing from its default) where
    its condition does not hold would do nothing, so it is refused with the condition's one line. `own`: the
    fields' own conditions (`arg(only=...)`); False: their section's (`Section.only`; the switch itself, a field
    of its section such as --lora-r, is exempt). Called where today's order of checks puts each, so the first
    refusal stays the same."""
    defaults = {name: f.default for name, f in FIELDS.items()}
    for name in names:
        section, field_only = only_conditions(name)
        only = field_only if own else section
        if only is None or name == only.switch:
            continue
        if getattr(cfg, name) != defaults[name] and not only.holds(cfg):
            raise ConfigError(only.message(name, cfg))


def validate(cfg) -> None:
    """Cross-field checks the parser cannot express; raises ConfigError naming the flag. Flags that would do
    nothing are refused too: a run that ignores what it was told is worse than one that does not start."""
    _finite(cfg)
    if cfg.task == "g2p" and (cfg.train or cfg.valid or cfg.test):
        raise ConfigError("--train, --valid and --test are files of --task tsv (or a task that reads them); "
                          "--task g2p has its own data")
    if cfg.preset == "g2p-long" and (cfg.train or cfg.task not in (None, "g2p")):
        raise ConfigError("--preset g2p-long is a recipe for the built-in G2P data (no --train, --task g2p)")
    if cfg.preset == "karel-paper" and cfg.task != "karel":
        raise ConfigError("--preset karel-paper is a recipe for --task karel")
    if cfg.task in (None, "tsv") and (cfg.train is None) != (cfg.valid is None):
        raise ConfigError("--train and --valid go together")
    refuse_inert(cfg, ["karel_reward_pairs"])
    if not 0 < cfg.lr_decay <= 1:
        raise ConfigError(f"--lr-decay must be in (0, 1], got {cfg.lr_decay}")
    if cfg.mle_weight > 1:
        raise ConfigError(f"--mle-weight must be in [0, 1], got {cfg.mle_weight}")
    if cfg.rescore_chunk == "auto" and cfg.memory_budget is None:
        raise ConfigError("--rescore-chunk auto needs --memory-budget (e.g. 2GiB)")
    refuse_inert(cfg, ["memory_budget"])
    if cfg.compile != "off" and cfg.fsdp:
        raise ConfigError(f"--compile {cfg.compile} does not combine with --fsdp (the compiled step would trace "
                          "FSDP2's parameter gathering); use one or the other")
    _trl(cfg)
    if cfg.hf_model is not None:
        _hf(cfg)
    if cfg.rl_steps > 0:  # a run without RL steps never reads the RL flags: nothing to refuse there
        _rl(cfg)


def check_files(cfg) -> None:
    """The checks that read the file system, made where a run starts (not when a Config is made: a record's
    file may have moved since)."""
    if cfg.objective == "policy" and cfg.rl_steps > 0 and cfg.ref_checkpoint is not None \
            and not Path(cfg.ref_checkpoint).is_file():
        raise ConfigError(f"--ref-checkpoint {cfg.ref_checkpoint}: no such file")


def check_machine(cfg, cpus: int | None) -> None:
    """The flags bounded by the machine the run starts on (not when a Config is made: a record may be resumed or
    decoded on another machine): --threads at most its CPU cores (torch's thread pool past a few thousand crashes
    the process)."""
    if cfg.threads and cpus and cfg.threads > cpus:
        raise ConfigError(f"--threads {cfg.threads}: this machine has {cpus} CPU cores (os.cpu_count()); give at "
                          f"most {cpus}, or 0 (auto)")


# Bytes a search row keeps per position: its token (int64) and the token's log-probability (up to float64), each
# twice while a step gathers the surviving rows into new tensors.
POSITION_BYTES = 2 * (8 + 8)
# Beam search's candidate scores over the vocabulary (float32, a block of sources at a time): the scores and
# their top-k's workspace.
SCORE_COPIES = 2
# A row of a graph (MLE's teacher forcing, phase two's chunk) keeps per position what a step creates (its state,
# logits, log-softmax), and backward a gradient of as much again.
GRAPH_COPIES = 2


def memory_needs(cfg, *, vocab: int, state: float, step: float, valid: int, test: int, target_len: int,
                 sources: int, pairs: int, world: int = 1) -> list[tuple[str, str, int, float]]:
    """What each part of the run holds at its largest, at least, estimated from the model's measurements per
    row (`system.memory.row_state_bytes`: `state` bytes of decoder state, `step` bytes a decode step creates)
    and its vocabulary: (what, the flags that size it, rows, bytes). An estimate from below (a cache growing
    with the prefix counted at its start), so only what surely cannot fit is refused. The search's rows hold
    their state while a step makes the next, their --max-len tokens and scores; validation decodes up to 256
    sources a batch (`valid`, `test`: the splits' sizes); MLE and phase two keep a graph over their positions
    (`target_len`: the longest reference, EOS included). A batch takes at most the training data's `sources`
    (RL) and `pairs` (MLE); each process of `world` its share."""
    L = cfg.max_len
    row = state + step + L * POSITION_BYTES + SCORE_COPIES * 4 * vocab
    graph_position = GRAPH_COPIES * step

    def search(what: str, flags: str, rows: int) -> tuple[str, str, int, float]:
        return what, flags, rows, rows * row

    needs = [search("validation's beam search", "--eval-beam, --max-len", min(256, valid) * cfg.eval_beam)]
    if test:
        needs.append(search("the test split's beam search", "--eval-beam, --test-beam, --max-len",
                            min(256, test) * max(cfg.eval_beam, cfg.test_beam)))
    if cfg.rl_steps > 0:
        rows = -(-min(cfg.batch_size, sources) // world) * cfg.beam_size  # this process's candidates of a step
        needs.append(search("phase one's search", "--batch-size, --beam-size, --max-len", rows))
        chunk = min(rows, cfg.rescore_chunk) if isinstance(cfg.rescore_chunk, int) else 0
        if chunk:  # auto: sized to --memory-budget by its own measurement
            needs.append(("phase two's chunk", "--rescore-chunk, --max-len", chunk, chunk * L * graph_position))
    if cfg.mle_steps > 0 and target_len:
        rows = -(-min(cfg.mle_batch_size, pairs) // world)
        needs.append(("an MLE step", "--mle-batch-size", rows, rows * target_len * graph_position))
    return needs


def check_memory(cfg, needs: list[tuple[str, str, int, float]], available: int | None, where: str) -> None:
    """The first part of `memory_needs` that cannot fit in the `available` bytes of `where` (the device), as
    one line naming its flags and their values; nothing where the device does not say what it has."""
    if available is None:
        return
    for what, flags, rows, need in needs:
        if need > available:
            given = ", ".join(f"{flag} {getattr(cfg, flag[2:].replace('-', '_'))}" for flag in flags.split(", "))
            raise ConfigError(f"{given}: {what} would hold about {_bytes(need)} ({rows:,} rows of "
                              f"{_bytes(need / rows)}), more than the {_bytes(available)} available on {where}; "
                              "lower " + ("it" if ", " not in flags else "one of them"))


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _finite(cfg) -> None:
    """Every number flag finite: NaN passes every range check (each comparison is False) and would skip every
    step; no flag means anything at infinity (--clip-norm 0 is "no clipping")."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{_flag(f.name)} must be a finite number, got {value}")


def _trl(cfg) -> None:
    """The flags of the block "coming from TRL"; each refuses what it cannot do."""
    if cfg.top_p > 1 or (cfg.top_p == 0):
        raise ConfigError(f"--top-p must be in (0, 1], got {cfg.top_p:g}")
    if (cfg.top_k or cfg.top_p < 1 or cfg.min_len) and cfg.sampler != "sample":
        raise ConfigError("--top-k, --top-p and --min-len apply to --sampler sample only")
    if cfg.min_len >= cfg.max_len:
        raise ConfigError(f"--min-len {cfg.min_len} leaves no room for eos within --max-len {cfg.max_len}")
    refuse_inert(cfg, section_fields("lora"), own=False)  # a LoRA flag without --lora-r
    refuse_inert(cfg, ["lora_r"])  # --lora-r without --hf-model
    if cfg.lora_dropout >= 1:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout:g}")
    if cfg.lora_target_modules is not None and not all(m.strip() for m in cfg.lora_target_modules.split(",")):
        raise ConfigError(f"--lora-target-modules {cfg.lora_target_modules!r}: an empty module name")


def _hf(cfg) -> None:
    if cfg.task not in (None, "tsv"):
        raise ConfigError(f"--hf-model trains on --train/--valid files (--task tsv), not --task {cfg.task}")
    if cfg.train is None:
        raise ConfigError("--hf-model needs --train and --valid files (--task tsv); the built-in G2P data has "
                          "no Hugging Face tokenizer")
    refuse_inert(cfg, ("embed_dim", "hidden_size", "bidirectional", "dropout"))  # the built-in LSTM's
    refuse_inert(cfg, ("char_source", "char_target"))  # the built-in vocabularies'


def _policy(cfg) -> None:
    """--objective policy's flags: refused with another objective (they would do nothing), and the
    combinations it does not support."""
    defaults = {name: f.default for name, f in FIELDS.items()}
    if cfg.objective != "policy":
        refuse_inert(cfg, section_fields("policy"), own=False)
        return
    if cfg.mle_weight != defaults["mle_weight"]:
        raise ConfigError(f"--objective policy does not take {_flag('mle_weight')} (the MLE rows have no old policy)")
    if cfg.amp == "fp16":
        raise ConfigError("--objective policy does not take --amp fp16 (its loss scale); use --amp bf16")
    if cfg.baseline == "greedy":
        raise ConfigError("--objective policy takes --baseline none, mean or loo, not greedy")
    if cfg.sampler == "sbs":
        raise ConfigError("--objective policy takes --sampler sample or beam, not sbs (its candidates are not "
                          "independent draws)")
    refuse_inert(cfg, ("sapo_temperature_pos", "sapo_temperature_neg"))
    if cfg.top_entropy_quantile > 1:
        raise ConfigError(f"--top-entropy-quantile is a fraction in (0, 1], got {cfg.top_entropy_quantile}")
    if cfg.top_entropy_quantile < 1 and cfg.grad_accum > 1:
        raise ConfigError("--top-entropy-quantile takes its threshold over one batch's positions; it does not "
                          "take --grad-accum > 1")
    _adaptive_entropy(cfg)
    if cfg.delta is not None and cfg.loss_type in ("cispo", "sapo", "vespo"):
        raise ConfigError(f"--delta caps the clipped loss types' ratio (grpo, dr_grpo, dapo, bnpo, luspo, "
                          f"sequence), not --loss-type {cfg.loss_type}'s")
    if cfg.ref_checkpoint is not None and cfg.kl_beta == 0:
        raise ConfigError("--ref-checkpoint needs --kl-beta > 0")


def _rl(cfg) -> None:
    _policy(cfg)
    refuse_inert(cfg, ("include_reference", "temperature", "teacher", "distill_beta"))
    if cfg.objective == "policy":
        if cfg.temperature != 1:
            raise ConfigError(f"--objective policy with --temperature {cfg.temperature:g}: phase two's ratios and "
                              "KL use the model's own log-probabilities, not tempered ones as TRL's GRPO does "
                              "(logits / T), so samples of p^(1/T) would be weighted as samples of p; use "
                              "--temperature 1 (docs/policy.md)")
        if cfg.beam_size < 2 and cfg.baseline != "none":
            raise ConfigError("--objective policy with --beam-size 1 has no group to compare a candidate with; "
                              "use --beam-size >= 2, or --baseline none")
        return
    refuse_inert(cfg, ["mrt_alpha"])
    if cfg.objective == "mrt" and cfg.mrt_alpha == 0:
        raise ConfigError("--mrt-alpha 0 with --objective mrt trains nothing (Q ∝ p^0 is uniform over a source's "
                          "candidates whatever the model, and MRT's coefficients are times alpha: every one is 0); "
                          f"use --mrt-alpha > 0 (default {MRT_ALPHA:g})")
    if cfg.objective == "distill":
        _distill(cfg)
        return
    if cfg.objective in WITHOUT_REPLACEMENT and cfg.sampler != "sbs":
        raise ConfigError(f"--objective {cfg.objective} needs --sampler sbs (it weights a sample without "
                          f"replacement), not --sampler {cfg.sampler}")
    if cfg.objective != "reinforce":
        if cfg.baseline is not None:
            raise ConfigError(f"--baseline applies to --objective reinforce only, not --objective "
                              f"{cfg.objective}")
        if cfg.beam_size < 2 and cfg.objective not in WITHOUT_REPLACEMENT:
            raise ConfigError(f"--beam-size 1 with --objective {cfg.objective} trains nothing (one candidate "
                              "per source has q = 1 and coefficient 0); use --beam-size >= 2")
        return
    if cfg.temperature != 1:
        raise ConfigError(f"--objective reinforce with --temperature {cfg.temperature:g} is biased (it samples "
                          "from p^(1/T) but weights grad log p without the importance ratio); use --temperature "
                          "1, or --objective beam or mrt")
    if cfg.reinforce_baseline == "loo" and cfg.beam_size < 2:
        raise ConfigError("--baseline loo needs --beam-size >= 2")
    if cfg.reinforce_baseline == "mean" and cfg.beam_size < 2:
        raise ConfigError("--beam-size 1 with --objective reinforce --baseline mean trains nothing (each sample "
                          "is its own baseline); use --beam-size >= 2, or --baseline none or greedy")


def _distill(cfg) -> None:
    """--objective distill: a teacher, and no flag whose coefficients it has none of."""
    if cfg.teacher is None:
        raise ConfigError("--objective distill needs --teacher PATH (a twophase checkpoint or a Hugging Face folder)")
    if cfg.distill_beta > 1:
        raise ConfigError(f"--distill-beta must be in [0, 1] (TRL's beta), got {cfg.distill_beta:g}")
    if cfg.baseline is not None:
        raise ConfigError("--baseline applies to --objective reinforce only, not --objective distill")
    if cfg.mle_weight:
        raise ConfigError("--objective distill does not take --mle-weight; --include-reference distils the "
                          "references beside the candidates")
    if cfg.amp == "fp16":
        raise ConfigError("--objective distill does not take --amp fp16 (its loss scale); use --amp bf16")


def warnings(cfg) -> list[str]:
    """Configurations that train, but not what the user probably means; one line each."""
    out = _sampling_warnings(cfg)
    if cfg.rl_steps > 0 and cfg.objective == "policy":
        if cfg.loss_type == "cispo" and cfg.clip_epsilon_high is None:
            out.append(f"--loss-type cispo caps each ratio at --clip-epsilon-high, which defaults to --clip-epsilon "
                       f"({cfg.clip_epsilon:g}) as in TRL: a ratio near 1 is cut to {cfg.clip_epsilon:g}, steps about "
                       f"{1 / cfg.clip_epsilon:.0f}x smaller; TRL recommends --clip-epsilon-high 5 for cispo"
                       if cfg.clip_epsilon > 0 else "--loss-type cispo with --clip-epsilon 0 and no "
                       "--clip-epsilon-high caps every ratio at 0: it trains nothing; TRL recommends "
                       "--clip-epsilon-high 5 for cispo")
        if cfg.importance_sampling_level == "sequence" and cfg.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            out.append(f"--importance-sampling-level sequence with --loss-type {cfg.loss_type}: the loss sums "
                       "per-token terms, which weights each sequence by its length instead of optimizing the "
                       "per-sequence objective (TRL warns the same); GSPO's setup is --loss-type grpo")
    return out


def _sampling_warnings(cfg) -> list[str]:
    """A sampler that biases the objective, or does not give it what it assumes."""
    if cfg.rl_steps > 0 and cfg.objective == "policy" and cfg.sampler == "beam":
        return ["--objective policy with --sampler beam: beam candidates are not samples of the old policy, so "
                "the importance ratio corrects nothing; usual: --sampler sample"]
    if cfg.rl_steps > 0 and cfg.objective == "reinforce" and cfg.sampler == "beam":
        return ["--objective reinforce with --sampler beam is biased (beam candidates are not samples of the "
                "model); unbiased: --sampler sample, or --objective beam"]
    if cfg.rl_steps > 0 and cfg.objective == "reinforce" and (cfg.top_k or cfg.top_p < 1 or cfg.min_len):
        return ["--objective reinforce with --top-k, --top-p or --min-len is biased (it samples from the "
                "truncated distribution but weighs grad log p of the full one, as TRL does); unbiased: no "
                "truncation, or --objective beam or mrt"]
    if cfg.rl_steps > 0 and cfg.objective == "reinforce" and cfg.sampler == "sbs":
        return ["--objective reinforce with --sampler sbs is biased (a sample without replacement is not K "
                "independent draws); unbiased: --objective unordered-set or priority"]
    return []


def _adaptive_entropy(cfg) -> None:
    """--use-adaptive-entropy and its bounds, step and target."""
    if not cfg.use_adaptive_entropy:
        refuse_inert(cfg, ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"))
        return
    if cfg.entropy_coef_min > cfg.entropy_coef_max:
        raise ConfigError(f"--entropy-coef-min ({cfg.entropy_coef_min}) is above --entropy-coef-max "
                          f"({cfg.entropy_coef_max})")
    if not cfg.entropy_coef_min <= cfg.entropy_coef <= cfg.entropy_coef_max:
        raise ConfigError(f"--entropy-coef ({cfg.entropy_coef}), the initial coefficient, is outside "
                          "[--entropy-coef-min, --entropy-coef-max] = "
                          f"[{cfg.entropy_coef_min}, {cfg.entropy_coef_max}]")


# ---- the resume rules
# Declared on each field (`arg(resume=...)`); a field that declares nothing is FIXED.
RULES = {name: f.metadata["resume"] for name, f in FIELDS.items() if f.metadata["resume"] != FIXED}
# this command's own: where and how this process computes (--compile with --fsdp is refused, so a --compile
# inherited from an earlier command would refuse every later --resume --fsdp)
NOT_INHERITED = tuple(name for name, f in FIELDS.items() if not f.metadata["inherited"])
PATHS = tuple(name for name, f in FIELDS.items() if f.metadata["path"])  # compared as files, not strings


def rule(name: str) -> str:
    return RULES.get(name, FIXED)


def inherited(saved: dict, known) -> dict:
    """The defaults a resumed run takes from its checkpoint's configuration (fields this version knows)."""
    return {k: v for k, v in saved.items() if k in known and k not in NOT_INHERITED}


def same(name: str, a, b) -> bool:
    if name in PATHS and isinstance(a, str) and isinstance(b, str):
        return a == b or os.path.abspath(a) == os.path.abspath(b)
    return a == b


def show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "(not set)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def check(cfg, saved: dict, state: dict, path) -> None:
    """Raise ConfigError (one line) for the first field of `cfg` that its rule forbids to differ from `saved`.
    `state`: the checkpoint (its step, the end of its MLE phase and whether the schedule ended it)."""
    step, mle_end = int(state.get("step", 0)), int(state.get("mle_end", saved.get("mle_steps", 0)))
    mle_stopped = bool(state.get("schedule", {}).get("stopped", False))
    for name in FIELDS:
        if name not in saved:  # a flag newer than the checkpoint: its default, nothing to compare
            continue
        old, new = saved[name], getattr(cfg, name)
        kind = rule(name)
        if kind == FREE or same(name, old, new):
            continue
        flag = "--" + name.replace("_", "-")
        why = None
        if kind == FIXED:
            why = "it would change what the run means; start a new run (another --save-dir, or --init-from)"
        elif kind == GROW and new < old:
            why = f"{flag} may only grow on resume"
        elif kind == PHASE and (step > mle_end or mle_stopped):
            why = (f"the MLE phase ended at step {mle_end}" + (" (--lr-decay's schedule ended it)" if mle_stopped
                   else "") + "; a run never returns to a finished phase")
        elif kind == PHASE and new < step:
            why = f"the checkpoint has taken {step} MLE steps already"
        if why is not None:
            raise ConfigError(f"{path} was trained with {flag} {show(old)}, not {show(new)}: {why}")
