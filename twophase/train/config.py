"""Training configuration: one dataclass, one documented field per flag.

The command line is generated from these fields (`--rescore-chunk` for `rescore_chunk`), so a flag's help text,
type, default and valid range are written once, here.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import MISSING, dataclass, field, fields

from . import config_rules
from .config_rules import MRT_ALPHA, _flag


# --preset NAME: other defaults for a named recipe; flags given on the command line still win.
PRESETS = {
    # The long G2P recipe (docs/g2p.md): a bidirectional encoder with dropout, validation-driven MLE (the rate
    # halving at each validation without a better word accuracy, every 500 steps) of at most 16,000 steps, then RL
    # and its equal-time MLE control. Measured (seed 1): MLE stopped at 11,500 steps; 42 minutes on 2 shared cores;
    # test WER 34.0% with stress, 28.7% without.
    "g2p-long": dict(bidirectional=True, dropout=0.3, mle_steps=16000, lr_decay=0.5, patience=1, min_lr=2.5e-4,
                     eval_every=500, save_every=500, rl_steps=500, rl_lr=1e-4),
    # Bunel et al.'s Karel model and schedule, for a GPU (docs/karel.md; GandRL_for_NPS README): IOs2Seq at their
    # sizes, MLE with Adam at 1e-4 on batches of 128 for 100 epochs of the 10,000 training programs (validated every
    # 10) at a constant rate, RL from the best validation, then beam-RL with 64 candidates on batches of 16 at 1e-5
    # for 5 epochs; validation and test beam 64.
    "karel-paper": dict(karel_model="paper", hidden_size=256, embed_dim=256, karel_channels=64, karel_blocks=2,
                        karel_pair_dim=512, karel_layers=2, lr=1e-4, mle_batch_size=128, mle_steps=7800,
                        eval_every=780, save_every=780, rl_lr=1e-5, batch_size=16, beam_size=64, rl_steps=3125,
                        eval_beam=64, test_beam=0, lr_decay=1.0, rl_from_best=True, save_dir="runs/karel-paper"),
}

DEFAULT_BEAM = 5  # validation's and twophase-decode's beam width, one figure so the two agree


def arg(default, help: str, choices=None, minimum=None, parse=None):
    """A documented field; `parse` converts the flag's text where the annotation's type is not enough."""
    return field(default=default, metadata=dict(help=help, choices=choices, minimum=minimum, parse=parse))


UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB', '512MB', '1.5g', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MB, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_chunk(text: str) -> int | str:
    """A positive number of rows, or 'auto' (largest chunk within --memory-budget)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'auto', got {text}")
    return value


def check_size(text: str) -> str:
    parse_size(text)  # refuse now; the config keeps the text the user wrote
    return text


@dataclass
class Config:
    preset: str | None = arg(None, "a named recipe that sets other defaults (the flags given still win): "
                                   "g2p-long (docs/g2p.md), karel-paper (docs/karel.md)", choices=tuple(PRESETS))
    # ---- data
    task: str | None = arg(None, "what to train on: g2p (CMUdict grapheme-to-phoneme, the default without --train), "
                                 "tsv (--train/--valid files, the default with --train), an installed "
                                 "twophase.tasks entry point, or package.module:callable returning a "
                                 "twophase.tasks.Task")
    train: str | None = arg(None, "training TSV (source<TAB>target; repeated sources = several references), or a "
                                  "prompt table (.jsonl, .json, .csv, .parquet: a prompt column, optional "
                                  "completion/target references, other columns for the rewards; docs/trl.md); "
                                  "default: the CMU Pronouncing Dictionary, grapheme-to-phoneme")
    valid: str | None = arg(None, "validation TSV, same format; required with --train")
    test: str | None = arg(None, "test TSV, same format, evaluated once with the final model at the end of the run "
                                 "(the built-in data has its own test split)")
    char_source: bool = arg(False, "split TSV sources into characters instead of at spaces")
    char_target: bool = arg(False, "split TSV targets into characters instead of at spaces")
    lowercase_source: bool = arg(False, "lower-case sources, in training and decoding (always on for the built-in "
                                        "data, whose words are lower-case)")
    max_src_len: int = arg(200, "longest source accepted, in tokens (with --hf-model: the tokenizer's, its special "
                                "tokens included)", minimum=1)
    too_long: str = arg("error", "a TSV line longer than --max-src-len, or whose target does not fit in --max-len "
                                 "with its EOS: 'error' (stop, naming FILE:LINE) or 'skip' (leave out, counted)",
                        choices=("error", "skip"))
    valid_size: int = arg(0, "validate on the first N validation sources only (0: all); --task karel generates "
                             "N validation tasks and a test split of 2N instead (0: 500 and 1,000; docs/karel.md)",
                          minimum=0)
    train_size: int = arg(0, "generated tasks (karel): training programs (0: the task's default)", minimum=0)
    # ---- model
    hf_model: str | None = arg(None, "with --task tsv: train a local Hugging Face folder (save_pretrained of the "
                                     "model and its tokenizer, never downloaded) instead of the built-in LSTM: "
                                     "encoder-decoder configs as seq2seq, others as causal LMs (the source is the "
                                     "prompt); the final model is also saved to <save-dir>/hf_final (docs/hf.md)")
    embed_dim: int = arg(64, "embedding size of source and target tokens", minimum=1)
    hidden_size: int = arg(256, "LSTM hidden size of encoder and decoder", minimum=1)
    bidirectional: bool = arg(False, "bidirectional encoder")
    dropout: float = arg(0.0, "dropout during the MLE warm start (RL always runs without, so both phases score "
                              "with the same function)", minimum=0.0)
    # ---- the Karel model (--task karel; docs/karel.md): --hidden-size, --embed-dim and --dropout apply to both;
    # the defaults are CPU sizes, --preset karel-paper has the paper's
    karel_model: str = arg("pooled", "--task karel: 'pooled' (the pair embeddings max-pooled into one vector before "
                                     "one LSTM decodes) or 'paper' (Bunel et al.'s IOs2Seq: an LSTM per pair, "
                                     "max-pooled at every step; sized by the --karel-* flags)",
                           choices=("pooled", "paper"))
    karel_channels: int = arg(32, "--karel-model paper: channels of the residual CNN (even: each world's first "
                                  "convolution gives half; the paper: 64)", minimum=2)
    karel_blocks: int = arg(1, "--karel-model paper: residual blocks of three 3x3 convolutions (the paper: 2)",
                            minimum=0)
    karel_pair_dim: int = arg(128, "--karel-model paper: size of each I/O pair's embedding (the paper: 512)",
                              minimum=1)
    karel_layers: int = arg(2, "--karel-model paper: LSTM decoder layers (the paper: 2)", minimum=1)
    # ---- MLE warm start
    mle_steps: int = arg(4000, "teacher-forcing steps on the references before RL (a maximum with --lr-decay; "
                               "--task g2p: 10,000)", minimum=0)
    mle_batch_size: int = arg(64, "(source, reference) pairs per MLE step", minimum=1)
    lr: float = arg(2e-3, "Adam learning rate during MLE (its starting value with --lr-decay)", minimum=0.0)
    lr_decay: float = arg(1.0, "multiply the MLE learning rate by this after --patience validations in a row "
                               "without a better --best-metric score; a decay below --min-lr ends the MLE phase "
                               "early (--mle-steps is then a maximum); 1: constant rate, no early stop "
                               "(--task g2p: 0.5)",
                          minimum=0.0)
    patience: int = arg(1, "with --lr-decay: validations without improvement before the rate decays", minimum=1)
    min_lr: float = arg(2.5e-4, "with --lr-decay: the MLE phase ends instead of decaying below this rate",
                        minimum=0.0)
    # ---- RL fine-tuning
    rl_steps: int = arg(600, "two-phase RL steps after the warm start", minimum=0)
    batch_size: int = arg(32, "sources per RL step", minimum=1)
    rl_lr: float = arg(2e-4, "Adam learning rate during RL", minimum=0.0)
    sampler: str = arg("beam", "phase one: 'beam' search, ancestral 'sample', or 'sbs' (stochastic beam search: K "
                               "distinct samples without replacement, docs/sbs.md)", choices=("beam", "sample", "sbs"))
    beam_size: int = arg(8, "candidates per source (beam width or number of samples), K", minimum=1)
    temperature: float = arg(1.0, "sampling temperature of --sampler sample (scores stay the model's own); "
                                  "not with --objective reinforce, whose gradient it would bias", minimum=1e-6)
    objective: str = arg("beam", "reinforce, beam (expected reward renormalised over the candidates, "
                                 "Bunel et al. 2018), mrt (minimum risk training, Shen et al. 2016), policy "
                                 "(token-level clipped ratios and KL, TRL's GRPO losses: docs/policy.md), or with "
                                 "--sampler sbs: priority (importance weights p/q) or unordered-set (with its "
                                 "built-in baseline, Kool et al. 2020), both unbiased (docs/sbs.md)",
                         choices=("reinforce", "beam", "mrt", "policy", "priority", "unordered-set"))
    baseline: str | None = arg(None, "REINFORCE baseline: none, mean, loo (leave-one-out) or greedy "
                                     "(self-critical); with --objective reinforce, or policy (none, mean, loo) "
                                     "(default: mean)",
                               choices=("none", "mean", "loo", "greedy"))
    # ---- --objective policy (docs/policy.md)
    loss_type: str = arg("dapo", "--objective policy: TRL's loss types (grpo, dr_grpo, dapo, bnpo, cispo, sapo, "
                                 "luspo, vespo) or sequence (per-sequence sums, averaged per source)",
                         choices=("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo", "sequence"))
    importance_sampling_level: str = arg("token", "--objective policy: the importance ratio per token, or per "
                                                  "sequence (GSPO: exp of the row's mean log-ratio)",
                                         choices=("token", "sequence"))
    delta: float | None = arg(None, "--objective policy: two-sided clipping, the unclipped ratio capped at delta "
                                    "(clipped loss types; > 1 + --clip-epsilon-high)", minimum=0.0)
    sapo_temperature_pos: float = arg(1.0, "--objective policy --loss-type sapo: the soft gate's temperature "
                                           "where the advantage is positive", minimum=1e-6)
    sapo_temperature_neg: float = arg(1.05, "--objective policy --loss-type sapo: its temperature elsewhere",
                                      minimum=1e-6)
    off_policy_mask_threshold: float | None = arg(None, "--objective policy: DeepSeek-V3.2's off-policy sequence "
                                                        "mask: a candidate with a negative advantage whose mean "
                                                        "per-token KL from the old policy exceeds this loses its "
                                                        "policy term (TRL's flag)", minimum=0.0)
    entropy_coef: float = arg(0.0, "--objective policy: TRL's entropy bonus, the loss minus this times the mean "
                                   "entropy of the scored positions' next-token distributions (needs the "
                                   "model's by-hand output layer: the LSTM, the HF wrappers)", minimum=0.0)
    top_entropy_quantile: float = arg(1.0, "--objective policy: below 1, only the positions whose next-token "
                                           "entropy is in this top fraction of the batch's keep their policy term "
                                           "(TRL's high-entropy mask)", minimum=1e-9)
    use_adaptive_entropy: bool = arg(False, "--objective policy: TRL's adaptive entropy control: --entropy-coef is "
                                            "the initial coefficient, moved by --entropy-coef-delta after each "
                                            "update (up where the update's mean entropy is at or below "
                                            "--entropy-target, else down) and applied only while at or below it")
    entropy_coef_min: float = arg(0.0, "--use-adaptive-entropy: the coefficient's lower bound", minimum=0.0)
    entropy_coef_max: float = arg(1.0, "--use-adaptive-entropy: the coefficient's upper bound", minimum=0.0)
    entropy_coef_delta: float = arg(0.005, "--use-adaptive-entropy: the coefficient's step per update",
                                    minimum=0.0)
    entropy_target: float = arg(0.2, "--use-adaptive-entropy: the target mean entropy in nats per token (over the "
                                     "loss's tokens, or the high-entropy ones with --top-entropy-quantile)",
                                minimum=0.0)
    mask_truncated_completions: bool = arg(False, "--objective policy: candidates that end without EOS (cut at "
                                                  "--max-len) leave the loss and its token count (TRL's flag)")
    updates_per_generation: int = arg(1, "--objective policy: optimizer steps per phase one (TRL's "
                                         "num_iterations), each a phase two over the same candidates", minimum=1)
    clip_epsilon: float = arg(0.2, "--objective policy: the ratio is clipped to [1 - eps, 1 + eps_high]",
                              minimum=0.0)
    clip_epsilon_high: float | None = arg(None, "--objective policy: the upper clip (DAPO's clip-higher); "
                                                "default: --clip-epsilon", minimum=0.0)
    kl_beta: float = arg(0.0, "--objective policy: weight of the k3 KL to a frozen reference (the end-of-MLE "
                              "model, or --ref-checkpoint)", minimum=0.0)
    kl_importance_weighted: bool = arg(True, "--objective policy: the KL term times the importance ratio "
                                             "(TRL's use_bias_correction_kl)")
    ref_checkpoint: str | None = arg(None, "--objective policy with --kl-beta: the reference's parameters from "
                                           "this checkpoint file instead of the end-of-MLE model")
    advantage_scale: str = arg("group", "--objective policy: divide advantages by the source's reward std, the "
                                        "batch's, or not (TRL's scale_rewards)", choices=("group", "batch", "none"))
    drop_zero_std: bool = arg(False, "--objective policy: sources whose candidates' rewards are all equal leave "
                                     "phase two (DAPO's dynamic sampling; counted as dropped_groups)")
    mrt_alpha: float = arg(MRT_ALPHA, "MRT sharpness alpha: Q ∝ p^alpha over a source's candidates", minimum=0.0)
    compare_mle: bool = arg(True, "after RL, continue MLE from the end-of-MLE state at --rl-lr for the RL "
                                  "phase's training time (CPU time on CPU, wall time on GPU), validate (and test) "
                                  "it, and report it beside RL: the control RL must beat; adds the RL phase's time "
                                  "to the run; the final model stays RL's (--no-compare-mle: skip it)")
    mle_weight: float = arg(0.0, "lambda of the mixed objective lambda*MLE + (1-lambda)*RL", minimum=0.0)
    reward: str | None = arg(None, "registered reward plug-in (bleu, chrf, exact, edit, ...) or "
                                   "package.module:callable (TRL's reward signature works too), or a comma-separated "
                                   "list of them, summed (--reward-weights); default: the task's (edit for g2p "
                                   "and tsv)")
    max_len: int = arg(32, "longest candidate phase one may produce, EOS included (with --hf-model: in the "
                           "tokenizer's tokens)", minimum=1)
    grammar: str = arg("off", "on: every search, score and gradient uses the model renormalised over the tokens the "
                              "task's grammar allows (no syntax errors; karel: on, its DSL); twophase-decode "
                              "follows the checkpoint (docs/constraints.md)", choices=("off", "on"))
    rescore_chunk: int | str = arg(128, "phase two re-decodes at most this many candidates at a time; 'auto': "
                                        "the most whose graph fits in --memory-budget", parse=parse_chunk)
    memory_budget: str | None = arg(None, "with --rescore-chunk auto: bytes phase two's graph may use, e.g. 2GiB",
                                    parse=check_size)
    profile_memory: bool = arg(False, "report time, allocated/peak memory and autograd graph bytes of each part "
                                      "of a step (encoder, phase one, every phase-two chunk, optimizer step)")
    one_phase: bool = arg(False, "the memory-hungry baseline, for comparison: phase one keeps the graph of every "
                                 "search step and one backward replaces phase two (same gradient, far more memory)")
    no_prefix_sharing: bool = arg(False, "phase two re-decodes every candidate from its first token instead of "
                                         "each distinct (source, prefix) once: the same gradient, slower "
                                         "(for comparison)")
    # ---- coming from TRL (docs/trl.md): weighted rewards, sampler truncation, LoRA
    reward_weights: str | None = arg(None, "with --reward a,b,c (several rewards, summed): their weights, e.g. "
                                           "1,0.5,0.5 (default: 1 each); each is logged as reward/<name>/mean, /std")
    top_k: int = arg(0, "--sampler sample draws from the k most probable tokens only (0: all); scores stay the "
                        "model's own log-probabilities", minimum=0)
    top_p: float = arg(1.0, "--sampler sample draws from the smallest set of tokens whose probability reaches p "
                            "(nucleus; 1: all); scores stay the model's own", minimum=0.0)
    min_len: int = arg(0, "--sampler sample: no eos before this many tokens (scores stay the model's own)",
                       minimum=0)
    lora_r: int = arg(0, "with --hf-model: train LoRA adapters of rank R (peft) instead of every parameter; only "
                         "they are trained, checkpointed and saved to hf_final (0: no LoRA)", minimum=0)
    lora_alpha: float = arg(0.0, "with --lora-r: LoRA's alpha, the adapters' scale alpha / r (0: 2 r)", minimum=0.0)
    lora_dropout: float = arg(0.0, "with --lora-r: dropout on the adapters' input (MLE steps only: RL scores "
                                   "without dropout)", minimum=0.0)
    lora_target_modules: str | None = arg(None, "with --lora-r: comma-separated module names to adapt (default: "
                                                "peft's for the model type, e.g. q,v for T5, c_attn for GPT-2)")
    merge_lora: bool = arg(False, "with --lora-r: hf_final holds the model with the adapters merged into its "
                                  "weights (default: the adapters alone, for peft's PeftModel.from_pretrained)")
    # ---- Karel as Bunel et al.: RL from the best MLE validation, the reference among RL_beam's
    # candidates, a second test beam
    rl_from_best: bool = arg(False, "RL (and --compare-mle's control) start from the parameters and optimizer "
                                    "state of the best MLE validation (checkpoint_best.pt), not from the last MLE "
                                    "step (--task karel: on)")
    include_reference: bool = arg(False, "--objective beam: add each source's references to its candidates, q "
                                         "renormalised over candidates and references (a reference the beam already "
                                         "holds counted once), as Bunel et al.'s RL_beam")
    karel_reward_pairs: str = arg("all", "--task karel, RL on a training task shown 5 of its 6 pairs: the reward "
                                         "checks all 6 (Bunel et al.'s released RL command, environment "
                                         "BlackBoxGeneralization) or the 5 shown (their Consistency environment)",
                                  choices=("all", "shown"))
    test_beam: int = arg(0, "also decode the test split with this beam width (its scores as key@K, e.g. "
                            "generalization@64); 0: --eval-beam only (--task karel: 64, the paper's)", minimum=0)
    # ---- both phases
    clip_norm: float = arg(1.0, "clip the gradient norm to this (0: no clipping)", minimum=0.0)
    eval_every: int = arg(500, "validate every N steps (and at the end of each phase)", minimum=1)
    eval_beam: int = arg(DEFAULT_BEAM, "beam width when decoding for validation and test (1: greedy); "
                                       "twophase-decode's default is the same", minimum=1)
    best_metric: str = arg("auto", "validation score that picks checkpoint_best.pt, saved at every validation "
                                   "that improves it: one of the task's metrics (g2p: word_acc, wer, per; tsv: "
                                   "word_acc (sequence accuracy), per (token error rate)), or reward; auto: the "
                                   "task's main metric (word_acc for g2p, reward for tsv)")
    tensorboard: bool = arg(False, "also write the metrics as TensorBoard scalars to <save-dir>/tensorboard "
                                   "(needs the tensorboard package: pip install 'twophase[tb]')")
    picture: bool = arg(True, "at the end of the run draw <save-dir>/curves.png: the arms from the branch point "
                              "on (RL against MLE continued), then the whole run (needs matplotlib: pip install "
                              "'twophase[plot]'; the environment variable TWOPHASE_PICTURE=off turns it off too)")
    log_every: int = arg(100, "when stdout is not a terminal (no progress bar), print a progress line every N "
                              "steps (0: never)", minimum=0)
    seed: int = arg(1, "seed of every random number generator")
    device: str = arg("auto", "cpu, cuda, cuda:N, mps, or auto (cuda where available); under torchrun each "
                      "process takes cuda:LOCAL_RANK")
    deterministic: bool = arg(False, "CUDA's deterministic algorithms (torch.use_deterministic_algorithms, "
                                     "CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN deterministic): repeated GPU runs, "
                                     "--resume and torchrun give the same bits, at some speed; the CPU is "
                                     "deterministic without it")
    tf32: bool = arg(False, "let CUDA float32 matmuls and convolutions use TF32 tensor cores (Ampere on): faster, "
                            "~1e-3 relative rounding, so search scores match phase two's log-probabilities only "
                            "to that; default off: full float32")
    save_dir: str | None = arg(None, "where checkpoints and metrics.jsonl are written (default: runs/<task>: "
                                     "runs/g2p, runs/tsv, runs/karel, or the custom task's name); a directory that "
                                     "holds another run is refused unless --resume or --overwrite")
    save_every: int = arg(500, "write checkpoint_last.pt (and a step checkpoint) every N steps, and at the end "
                               "of each phase", minimum=1)
    keep_last: int = arg(2, "step checkpoints kept besides checkpoint_last.pt and checkpoint_best.pt", minimum=0)
    resume: bool = arg(False, "continue from <save-dir>/checkpoint_last.pt; its flags are the defaults, and a flag "
                              "that would change the run (data, model, objective, K, reward, seed, a finished "
                              "phase) is refused; --rl-steps may grow (docs/runs.md)")
    overwrite: bool = arg(False, "start afresh in a --save-dir that holds a run, deleting what that run wrote "
                                 "(checkpoints, logs, config.json, hf_final, after_step<N>/, tensorboard events), "
                                 "nothing else")
    max_bad_steps: int = arg(5, "non-finite losses/gradients skipped in a row before the run stops with a "
                                "crash checkpoint", minimum=0)
    threads: int = arg(0, "CPU threads for torch; 0 (auto): 1 below --hidden-size 512 (--hf-model: the model's "
                          "hidden size), whose small matrices gain "
                          "little from more and stall when another process is busy on the machine, else torch's "
                          "default (one per core); OMP_NUM_THREADS, where set, is left to decide", minimum=0)
    # ---- runs: resume from any checkpoint, start from one, evaluate one, export, accumulate (docs/runs.md)
    resume_from: str | None = arg(None, "continue the run from this checkpoint (checkpoint_crash.pt, a step "
                                        "checkpoint, checkpoint_best.pt) in its own directory; checkpoints of "
                                        "later steps are moved to <save-dir>/after_step<N>/, never deleted")
    init_from: str | None = arg(None, "start a new run (step 0, a fresh optimizer) from this checkpoint's model "
                                      "weights, e.g. RL from an MLE run's checkpoint_best.pt; its model-shape "
                                      "flags are the defaults, other values are refused")
    eval_only: bool = arg(False, "with --resume, --resume-from or --init-from: evaluate that checkpoint's model "
                                 "on the validation and test data, print the table, write nothing")
    export: str = arg("last", "the model a task's own export holds (--hf-model's <save-dir>/hf_final): the run's "
                              "last, or its checkpoint_best.pt", choices=("last", "best"))
    grad_accum: int = arg(1, "batches whose gradients are accumulated before one optimizer step: N batches of B "
                             "give the gradient of one batch of N*B exactly", minimum=1)
    fsdp: bool = arg(False, "under torchrun: shard parameters, gradients and Adam's moments over the processes "
                            "(PyTorch FSDP2); a step gathers the parameters once; docs/distributed.md")
    amp: str = arg("off", "automatic mixed precision of both phases and the MLE steps: matmuls in bf16 or fp16 "
                          "under torch.autocast, parameters, gradients and log-softmax in float32; fp16 (with "
                          "loss scaling) needs CUDA, bf16 runs on CPU and CUDA", choices=("off", "bf16", "fp16"))
    compile: str = arg("off", "phase one's decode step (search, validation) through torch.compile: on (inductor), "
                              "or aot_eager / eager (dynamo's tracing without code generation, to check that a "
                              "model traces); phase two stays eager; where compiling fails the run goes on "
                              "eagerly after one warning line (docs/compile.md)",
                       choices=("off", "on", "aot_eager", "eager"))

    @property
    def reinforce_baseline(self) -> str:
        """The baseline REINFORCE uses: --baseline, or mean where it was not given (None)."""
        return self.baseline or "mean"

    def validate(self) -> None:
        """Cross-field checks the parser cannot express (`config_rules.validate`); ValueError naming the flag."""
        config_rules.validate(self)

    def warnings(self) -> list[str]:
        """Configurations that train, but not what the user probably means (`config_rules.warnings`)."""
        return config_rules.warnings(self)


def _typed(f, kind):
    """argparse type that also enforces the field's minimum, so `--rescore-chunk 0` fails at parse time."""
    minimum = f.metadata["minimum"]

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if kind is float and not math.isfinite(value):  # nan passes every comparison with a minimum
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


class OneLineParser(argparse.ArgumentParser):
    """Bad flags exit with status 2 and one line (argparse would add the whole usage)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    for f in fields(Config):
        kind = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type).split(" ")[0]]
        default = f.default if f.default is not MISSING else None
        # None means "not given"; the help text says what that does where it matters.
        # %(default)s: the help shows the defaults the parser ends with (a task's recipe with --task, a preset's)
        text = f.metadata["help"].replace("%", "%%") + ("" if default is None else " (default: %(default)s)")
        if f.metadata["parse"] is not None:
            parser.add_argument(_flag(f.name), type=f.metadata["parse"], default=default, help=text)
        elif kind is bool and default:  # on unless --no-FLAG
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=True,
                                help=f.metadata["help"].replace("%", "%%"))
        elif kind is bool:
            parser.add_argument(_flag(f.name), action="store_true", help=f.metadata["help"].replace("%", "%%"))
        else:
            parser.add_argument(_flag(f.name), type=_typed(f, kind), default=default, choices=f.metadata["choices"],
                                help=text)


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(**{f.name: getattr(args, f.name) for f in fields(Config)})


def config_from_dict(saved: dict) -> Config:
    """A checkpoint's config: fields this version does not know are dropped, new ones take their defaults."""
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in saved.items() if k in known})
