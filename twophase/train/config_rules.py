"""What a `Config` may not hold: the cross-field checks the parser cannot express (`validate`, a ValueError
naming the flag) and the configurations that train but are probably not meant (`warnings`). Flags that would do
nothing are refused too: a run that ignores what it was told is worse than one that does not start."""
from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

WITHOUT_REPLACEMENT = ("priority", "unordered-set")  # the objectives that need --sampler sbs
MRT_ALPHA = 0.5  # --mrt-alpha's default; another value with another objective is refused


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(cfg) -> None:
    """Cross-field checks the parser cannot express; raises ValueError naming the flag. Flags that would do
    nothing are refused too: a run that ignores what it was told is worse than one that does not start."""
    _finite(cfg)
    if cfg.task == "g2p" and (cfg.train or cfg.valid or cfg.test):
        raise ValueError("--train, --valid and --test are files of --task tsv (or a task that reads them); "
                         "--task g2p has its own data")
    if cfg.preset == "g2p-long" and (cfg.train or cfg.task not in (None, "g2p")):
        raise ValueError("--preset g2p-long is a recipe for the built-in G2P data (no --train, --task g2p)")
    if cfg.preset == "karel-paper" and cfg.task != "karel":
        raise ValueError("--preset karel-paper is a recipe for --task karel")
    if cfg.task in (None, "tsv") and (cfg.train is None) != (cfg.valid is None):
        raise ValueError("--train and --valid go together")
    if cfg.karel_reward_pairs != "all" and cfg.task != "karel":
        raise ValueError("--karel-reward-pairs applies to --task karel only")
    if not 0 < cfg.lr_decay <= 1:
        raise ValueError(f"--lr-decay must be in (0, 1], got {cfg.lr_decay}")
    if cfg.mle_weight > 1:
        raise ValueError(f"--mle-weight must be in [0, 1], got {cfg.mle_weight}")
    if cfg.rescore_chunk == "auto" and cfg.memory_budget is None:
        raise ValueError("--rescore-chunk auto needs --memory-budget (e.g. 2GiB)")
    if cfg.memory_budget is not None and cfg.rescore_chunk != "auto":
        raise ValueError(f"--memory-budget applies to --rescore-chunk auto only, not --rescore-chunk "
                         f"{cfg.rescore_chunk}")
    if cfg.compile != "off" and cfg.fsdp:
        raise ValueError(f"--compile {cfg.compile} does not combine with --fsdp (the compiled step would trace "
                         "FSDP2's parameter gathering); use one or the other")
    _trl(cfg)
    if cfg.hf_model is not None:
        _hf(cfg)
    if cfg.rl_steps > 0:  # a run without RL steps never reads the RL flags: nothing to refuse there
        _rl(cfg)


def _finite(cfg) -> None:
    """Every number flag finite: NaN passes every range check (each comparison is False) and would skip every
    step; no flag means anything at infinity (--clip-norm 0 is "no clipping")."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_flag(f.name)} must be a finite number, got {value}")


def _trl(cfg) -> None:
    """The flags of the block "coming from TRL"; each refuses what it cannot do."""
    if cfg.top_p > 1 or (cfg.top_p == 0):
        raise ValueError(f"--top-p must be in (0, 1], got {cfg.top_p:g}")
    if (cfg.top_k or cfg.top_p < 1 or cfg.min_len) and cfg.sampler != "sample":
        raise ValueError("--top-k, --top-p and --min-len apply to --sampler sample only")
    if (cfg.top_k or cfg.top_p < 1 or cfg.min_len) and cfg.one_phase:
        raise ValueError("--top-k, --top-p and --min-len are two-phase sampling's; --one-phase samples without them")
    if cfg.min_len >= cfg.max_len:
        raise ValueError(f"--min-len {cfg.min_len} leaves no room for eos within --max-len {cfg.max_len}")
    defaults = {f.name: f.default for f in fields(cfg)}
    lora = ("lora_alpha", "lora_dropout", "lora_target_modules", "merge_lora")
    if not cfg.lora_r:
        given = [n for n in lora if getattr(cfg, n) != defaults[n]]
        if given:
            raise ValueError(f"{_flag(given[0])} needs --lora-r")
    elif cfg.hf_model is None:
        raise ValueError("--lora-r adapts a Hugging Face model: it needs --hf-model")
    if cfg.lora_dropout >= 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout:g}")
    if cfg.lora_target_modules is not None and not all(m.strip() for m in cfg.lora_target_modules.split(",")):
        raise ValueError(f"--lora-target-modules {cfg.lora_target_modules!r}: an empty module name")


def _hf(cfg) -> None:
    if cfg.task not in (None, "tsv"):
        raise ValueError(f"--hf-model trains on --train/--valid files (--task tsv), not --task {cfg.task}")
    if cfg.train is None:
        raise ValueError("--hf-model needs --train and --valid files (--task tsv); the built-in G2P data has "
                         "no Hugging Face tokenizer")
    defaults = {f.name: f.default for f in fields(cfg)}
    for name in ("embed_dim", "hidden_size", "bidirectional", "dropout"):
        if getattr(cfg, name) != defaults[name]:
            raise ValueError(f"--hf-model: {_flag(name)} sets the built-in LSTM; a Hugging Face model's size and "
                             "dropout are its config's (dropout applies to its MLE steps)")
    for name in ("char_source", "char_target"):
        if getattr(cfg, name):
            raise ValueError(f"--hf-model: {_flag(name)} splits text for the built-in vocabularies; the "
                             "model's tokenizer splits it")


def _policy(cfg) -> None:
    """--objective policy's flags: refused with another objective (they would do nothing), and the
    combinations it does not support."""
    defaults = {f.name: f.default for f in fields(cfg)}
    names = ("loss_type", "updates_per_generation", "clip_epsilon", "clip_epsilon_high", "kl_beta",
             "kl_importance_weighted", "ref_checkpoint", "advantage_scale", "drop_zero_std",
             "importance_sampling_level", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
             "mask_truncated_completions", "off_policy_mask_threshold", "entropy_coef", "top_entropy_quantile",
             "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
    if cfg.objective != "policy":
        for name in names:
            if getattr(cfg, name) != defaults[name]:
                raise ValueError(f"{_flag(name)} applies to --objective policy only, not --objective "
                                 f"{cfg.objective}")
        return
    for name, why in (("one_phase", "phase one keeps no graph for several updates"),
                      ("mle_weight", "the MLE rows have no old policy")):
        if getattr(cfg, name) != defaults[name]:
            raise ValueError(f"--objective policy does not take {_flag(name)} ({why})")
    if cfg.amp == "fp16":
        raise ValueError("--objective policy does not take --amp fp16 (its loss scale); use --amp bf16")
    if cfg.baseline == "greedy":
        raise ValueError("--objective policy takes --baseline none, mean or loo, not greedy")
    if cfg.sampler == "sbs":
        raise ValueError("--objective policy takes --sampler sample or beam, not sbs (its candidates are not "
                         "independent draws)")
    if cfg.loss_type != "sapo":
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(cfg, name) != defaults[name]:
                raise ValueError(f"{_flag(name)} applies to --loss-type sapo only, not {cfg.loss_type}")
    if cfg.top_entropy_quantile > 1:
        raise ValueError(f"--top-entropy-quantile is a fraction in (0, 1], got {cfg.top_entropy_quantile}")
    if cfg.top_entropy_quantile < 1 and cfg.grad_accum > 1:
        raise ValueError("--top-entropy-quantile takes its threshold over one batch's positions; it does not "
                         "take --grad-accum > 1")
    _adaptive_entropy(cfg, defaults)
    if cfg.delta is not None and cfg.loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(f"--delta caps the clipped loss types' ratio (grpo, dr_grpo, dapo, bnpo, luspo, "
                         f"sequence), not --loss-type {cfg.loss_type}'s")
    if cfg.ref_checkpoint is not None and cfg.kl_beta == 0:
        raise ValueError("--ref-checkpoint needs --kl-beta > 0")
    if cfg.ref_checkpoint is not None and not Path(cfg.ref_checkpoint).is_file():
        raise ValueError(f"--ref-checkpoint {cfg.ref_checkpoint}: no such file")


def _rl(cfg) -> None:
    _policy(cfg)
    if cfg.include_reference and cfg.objective != "beam":
        raise ValueError(f"--include-reference applies to --objective beam only, not --objective {cfg.objective}")
    if cfg.temperature != 1 and cfg.sampler != "sample":
        raise ValueError(f"--temperature applies to --sampler sample only, not --sampler {cfg.sampler}")
    if cfg.objective == "policy":
        if cfg.temperature != 1:
            raise ValueError(f"--objective policy with --temperature {cfg.temperature:g}: phase two's ratios and "
                             "KL use the model's own log-probabilities, not tempered ones as TRL's GRPO does "
                             "(logits / T), so samples of p^(1/T) would be weighted as samples of p; use "
                             "--temperature 1 (docs/policy.md)")
        if cfg.beam_size < 2 and cfg.baseline != "none":
            raise ValueError("--objective policy with --beam-size 1 has no group to compare a candidate with; "
                             "use --beam-size >= 2, or --baseline none")
        return
    if cfg.mrt_alpha != MRT_ALPHA and cfg.objective != "mrt":
        raise ValueError(f"--mrt-alpha applies to --objective mrt only, not --objective {cfg.objective}")
    if cfg.objective in WITHOUT_REPLACEMENT and cfg.sampler != "sbs":
        raise ValueError(f"--objective {cfg.objective} needs --sampler sbs (it weights a sample without "
                         f"replacement), not --sampler {cfg.sampler}")
    if cfg.objective != "reinforce":
        if cfg.baseline is not None:
            raise ValueError(f"--baseline applies to --objective reinforce only, not --objective "
                             f"{cfg.objective}")
        if cfg.beam_size < 2 and cfg.objective not in WITHOUT_REPLACEMENT:
            raise ValueError(f"--beam-size 1 with --objective {cfg.objective} trains nothing (one candidate "
                             "per source has q = 1 and coefficient 0); use --beam-size >= 2")
        return
    if cfg.temperature != 1:
        raise ValueError(f"--objective reinforce with --temperature {cfg.temperature:g} is biased (it samples "
                         "from p^(1/T) but weights grad log p without the importance ratio); use --temperature "
                         "1, or --objective beam or mrt")
    if cfg.reinforce_baseline == "loo" and cfg.beam_size < 2:
        raise ValueError("--baseline loo needs --beam-size >= 2")
    if cfg.reinforce_baseline == "mean" and cfg.beam_size < 2:
        raise ValueError("--beam-size 1 with --objective reinforce --baseline mean trains nothing (each sample "
                         "is its own baseline); use --beam-size >= 2, or --baseline none or greedy")


def warnings(cfg) -> list[str]:
    """Configurations that train, but not what the user probably means; one line each."""
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


def _adaptive_entropy(cfg, defaults: dict) -> None:
    """--use-adaptive-entropy and its bounds, step and target."""
    if not cfg.use_adaptive_entropy:
        for name in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"):
            if getattr(cfg, name) != defaults[name]:
                raise ValueError(f"{_flag(name)} applies with --use-adaptive-entropy only")
        return
    if cfg.entropy_coef_min > cfg.entropy_coef_max:
        raise ValueError(f"--entropy-coef-min ({cfg.entropy_coef_min}) is above --entropy-coef-max "
                         f"({cfg.entropy_coef_max})")
    if not cfg.entropy_coef_min <= cfg.entropy_coef <= cfg.entropy_coef_max:
        raise ValueError(f"--entropy-coef ({cfg.entropy_coef}), the initial coefficient, is outside "
                         f"[--entropy-coef-min, --entropy-coef-max] = [{cfg.entropy_coef_min}, {cfg.entropy_coef_max}]")
