"""The sections of the training configuration that say what is learned and how: the data, the model (the
built-in LSTM, Karel's, LoRA on a Hugging Face model), the MLE warm start, phase one's search, the RL objective and
reward, the policy objective; and the registry of every section (`SECTIONS`, with `runsections`' ones).

Each section is a dataclass, one documented field per flag (`arg`, with its help text in the docstring after
it, where editors show it). A section that does something only under a
condition declares it once (`only = Only(...)`); so may a single field. `config.Config` joins the sections into
one flat record.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args, get_type_hints

from .documented import FREE, GROW, MRT_ALPHA, PHASE, SET, Only, arg, plain_kinds, take_help
from .runsections import EvaluationConfig, PhaseTwoConfig, RunConfig, StepConfig, SystemConfig

# The choices of the choice fields, as types: a type checker flags Config(objective="reinforse").
TooLong = Literal["error", "skip"]
KarelModel = Literal["pooled", "paper"]
RewardPairs = Literal["all", "shown"]
Sampler = Literal["beam", "sample", "sbs"]
OnOff = Literal["off", "on"]
Objective = Literal["reinforce", "beam", "mrt", "policy", "distill", "priority", "unordered-set"]
Baseline = Literal["none", "mean", "loo", "greedy"]
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo", "sequence"]
AdvantageScale = Literal["group", "batch", "none"]
SamplingLevel = Literal["token", "sequence"]

_HF_LSTM = Only("hf_model", None, "--hf-model: {flag} sets the built-in LSTM; a Hugging Face model's size and "
                                  "dropout are its config's (dropout applies to its MLE steps)")
_SAPO = Only("loss_type", "sapo", "{flag} applies to {switch} {value} only, not {actual}")
_ADAPTIVE = Only("use_adaptive_entropy", True, "{flag} applies with {switch} only")
_HF_SPLIT = Only("hf_model", None, "--hf-model: {flag} splits text for the built-in vocabularies; the model's "
                                   "tokenizer splits it")



def parse_loss_type(text: str) -> str:
    """--loss-type's name; GSPO is not a loss type of its own (TRL's neither): it says what is."""
    if text.lower() == "gspo":
        import argparse
        raise argparse.ArgumentTypeError("GSPO is a loss type's ratio per sequence: --importance-sampling-level "
                                         "sequence (with --loss-type grpo, say; docs/policy.md)")
    return text


@dataclass
class DataConfig:
    """The data: which task, its files and how their text is split and limited."""

    task: str | None = arg(None, task_reads=False)
    """what to train on: countdown (numbers and a target to an expression, the default without --train), g2p (CMUdict
    grapheme-to-phoneme), tsv (--train/--valid files, the default with --train), an installed twophase.tasks entry
    point, or package.module:callable returning a twophase.tasks.Task"""
    train: str | None = arg(None, path=True)
    """training TSV (source<TAB>target; repeated sources = several references), or a prompt table (.jsonl, .json,
    .csv, .parquet: a prompt column, optional completion/target references, other columns for the rewards;
    docs/trl.md); default: the task's own data (countdown's generated problems, CMUdict for g2p)"""
    valid: str | None = arg(None, path=True)
    """validation TSV, same format; required with --train"""
    test: str | None = arg(None, resume=FREE, path=True)
    """test TSV, same format, evaluated once with the final model at the end of the run (the built-in data has its
    own test split)"""
    char_source: bool = arg(False, only=_HF_SPLIT)
    """split TSV sources into characters instead of at spaces"""
    char_target: bool = arg(False, only=_HF_SPLIT)
    """split TSV targets into characters instead of at spaces"""
    lowercase_source: bool = arg(False)
    """lower-case sources, in training and decoding (always on for the built-in data, whose words are lower-case)"""
    max_src_len: int = arg(200, minimum=1)
    """longest source accepted, in tokens (with --hf-model: the tokenizer's, its special tokens included)"""
    too_long: TooLong = arg("error", choices=get_args(TooLong))
    """a TSV line longer than --max-src-len, or whose target does not fit in --max-len with its EOS: 'error' (stop,
    naming FILE:LINE) or 'skip' (leave out, counted)"""
    target_vocab: str | None = arg(None, path=True, only=_HF_SPLIT)
    """the built-in LSTM's output tokens, whitespace-separated in this file, beside the references' (without
    references, in place of the prompts' tokens): a token a reward wants that no training reference holds
    (docs/tasks.md)"""
    valid_size: int = arg(0, minimum=0, task_reads=False)
    """validate on the first N validation sources only (0: all); --task karel generates N validation tasks and a test
    split of 2N instead (0: 500 and 1,000; docs/karel.md)"""
    train_size: int = arg(0, minimum=0)
    """generated tasks (karel): training programs (0: the task's default)"""


DataConfig.title, DataConfig.shapes_task = "data", True


@dataclass
class ModelConfig:
    """The model: the built-in LSTM's sizes, or a Hugging Face model in its place."""

    hf_model: str | None = arg(None, path=True)
    """a local Hugging Face folder (save_pretrained of the model and its tokenizer, never downloaded) to train
    instead of the built-in LSTM, on --task tsv's files: encoder-decoder configs as seq2seq, others as causal LMs
    (the source is the prompt); the final model is also saved to <save-dir>/hf_final (docs/hf.md)"""
    embed_dim: int = arg(64, minimum=1, only=_HF_LSTM)
    """embedding size of source and target tokens"""
    hidden_size: int = arg(256, minimum=1, only=_HF_LSTM)
    """LSTM hidden size of encoder and decoder"""
    bidirectional: bool = arg(False, only=_HF_LSTM)
    """bidirectional encoder"""
    dropout: float = arg(0.0, minimum=0.0, below=1.0, only=_HF_LSTM)
    """dropout during the MLE warm start (RL always runs without, so both phases score with the same function)"""


ModelConfig.title, ModelConfig.shapes_task = "model", True


@dataclass
class KarelConfig:
    """The Karel task's model and reward (--task karel; docs/karel.md). --hidden-size, --embed-dim and --dropout
    apply to its model too; the defaults are CPU sizes, --preset karel-paper has the paper's."""

    karel_model: KarelModel = arg("pooled", choices=get_args(KarelModel))
    """'pooled' (the pair embeddings max-pooled into one vector before one LSTM decodes) or 'paper' (Bunel et al.'s
    IOs2Seq: an LSTM per pair, max-pooled at every step; sized by the --karel-* flags)"""
    karel_channels: int = arg(32, minimum=2)
    """channels of the paper model's residual CNN (even: each world's first convolution gives half; the paper: 64)"""
    karel_blocks: int = arg(1, minimum=0)
    """residual blocks of three 3x3 convolutions in the paper model (the paper: 2)"""
    karel_pair_dim: int = arg(128, minimum=1)
    """size of each I/O pair's embedding in the paper model (the paper: 512)"""
    karel_layers: int = arg(2, minimum=1)
    """LSTM decoder layers of the paper model (the paper: 2)"""
    karel_reward_pairs: RewardPairs = arg("all", choices=get_args(RewardPairs),
                                          only=Only("task", "karel", "{flag} applies to {switch} {value} only"))
    """RL on a training task shown 5 of its 6 pairs: the reward checks all 6 (Bunel et al.'s released RL command,
    environment BlackBoxGeneralization) or the 5 shown (their Consistency environment)"""


KarelConfig.title, KarelConfig.shapes_task = "karel", True
KarelConfig.only = Only("task", "karel", "{flag} applies to {switch} {value} only")


@dataclass
class CountdownConfig:
    """The Countdown task's generated problems (--task countdown; docs/countdown.md): how many numbers, their
    range, the target's range, and the share of training problems whose solution is withheld."""

    countdown_numbers: int = arg(3, minimum=1)
    """numbers in each problem, each used exactly once"""
    countdown_max: int = arg(30, minimum=1)
    """the numbers are drawn from 1 to this"""
    countdown_target_min: int = arg(1, minimum=0)
    """smallest target"""
    countdown_target_max: int = arg(100, minimum=0)
    """largest target"""
    countdown_hidden: float = arg(0.8, minimum=0.0, below=1.0)
    """share of the training problems generated without their solution: MLE trains on the others, RL on all (the
    checker needs none)"""


CountdownConfig.title, CountdownConfig.shapes_task = "countdown", True
CountdownConfig.only = Only("task", "countdown", "{flag} applies to {switch} {value} only")


@dataclass
class LoraConfig:
    """LoRA adapters on a Hugging Face model (peft; docs/hf.md)."""

    lora_r: int = arg(0, minimum=0,
                      only=Only("hf_model", SET, "--lora-r adapts a Hugging Face model: it needs --hf-model"))
    """train LoRA adapters of rank R on the --hf-model instead of every parameter; only they are trained,
    checkpointed and saved to hf_final (0: no LoRA)"""
    lora_alpha: float = arg(0.0, minimum=0.0)
    """LoRA's alpha, the adapters' scale alpha / r (0: 2 r)"""
    lora_dropout: float = arg(0.0, minimum=0.0)
    """dropout on the adapters' input (MLE steps only: RL scores without dropout)"""
    lora_target_modules: str | None = arg(None)
    """comma-separated module names to adapt (default: peft's for the model type, e.g. q,v for T5, c_attn for GPT-2)"""
    merge_lora: bool = arg(False, resume=FREE)
    """hf_final holds the model with the adapters merged into its weights (default: the adapters alone, for peft's
    PeftModel.from_pretrained)"""


LoraConfig.title, LoraConfig.only = "LoRA", Only("lora_r", SET, "{flag} needs --lora-r")


@dataclass
class MLEConfig:
    """The MLE warm start: teacher forcing on the references before RL."""

    mle_steps: int = arg(4000, minimum=0, resume=PHASE)
    """teacher-forcing steps on the references before RL (a maximum with --lr-decay; --task g2p: 10,000)"""
    mle_batch_size: int = arg(64, minimum=1)
    """(source, reference) pairs per MLE step"""
    lr: float = arg(2e-3, minimum=0.0)
    """Adam learning rate during MLE (its starting value with --lr-decay)"""
    lr_decay: float = arg(1.0, minimum=0.0)
    """multiply the MLE learning rate by this after --patience validations in a row without a better --best-metric
    score; a decay below --min-lr ends the MLE phase early (--mle-steps is then a maximum); 1: constant rate, no
    early stop (--task g2p: 0.5)"""
    patience: int = arg(1, minimum=1)
    """validations without improvement before --lr-decay decays the rate"""
    min_lr: float = arg(2.5e-4, minimum=0.0)
    """the MLE phase ends instead of decaying below this rate (--lr-decay)"""


MLEConfig.title = "MLE warm start"


@dataclass
class SearchConfig:
    """Phase one: how the candidates are found (beam search, sampling, stochastic beam search), no graph kept."""

    sampler: Sampler = arg("beam", choices=get_args(Sampler))
    """'beam' search, ancestral 'sample', or 'sbs' (stochastic beam search: K distinct samples without replacement,
    docs/sbs.md)"""
    beam_size: int = arg(8, minimum=1)
    """candidates per source (beam width or number of samples), K"""
    temperature: float = arg(1.0, minimum=1e-6, only=Only("sampler", "sample"))
    """sampling temperature of --sampler sample (scores stay the model's own); not with --objective reinforce, whose
    gradient it would bias; with --objective distill also the divergence's (both models' logits / T, TRL's)"""
    max_len: int = arg(32, minimum=1)
    """longest candidate phase one may produce, EOS included (with --hf-model: in the tokenizer's tokens)"""
    grammar: OnOff = arg("off", choices=get_args(OnOff))
    """on: every search, score and gradient uses the model renormalised over the tokens the task's grammar allows (no
    syntax errors; karel: on, its DSL); twophase-decode follows the checkpoint (docs/constraints.md)"""
    top_k: int = arg(0, minimum=0)
    """sampling (--sampler sample) draws from the k most probable tokens only (0: all); scores stay the model's own
    log-probabilities"""
    top_p: float = arg(1.0, minimum=0.0)
    """sampling (--sampler sample) draws from the smallest set of tokens whose probability reaches p (nucleus; 1:
    all); scores stay the model's own"""
    min_len: int = arg(0, minimum=0)
    """sampling (--sampler sample) draws no eos before this many tokens (scores stay the model's own)"""


SearchConfig.title = "phase one: search"


@dataclass
class RLConfig:
    """The RL phase: its steps, the sequence-level objective and the reward."""

    rl_steps: int = arg(600, minimum=0, resume=GROW)
    """two-phase RL steps after the warm start"""
    batch_size: int = arg(32, minimum=1)
    """sources per RL step"""
    rl_lr: float = arg(2e-4, minimum=0.0)
    """Adam learning rate during RL"""
    objective: Objective = arg("beam", choices=get_args(Objective))
    """reinforce, beam (expected reward renormalised over the candidates, Bunel et al. 2018), mrt (minimum risk
    training, Shen et al. 2016), policy (token-level clipped ratios and KL, TRL's GRPO losses: docs/policy.md),
    distill (on-policy distillation from --teacher, TRL's DistillationTrainer loss: docs/distillation.md), or with
    --sampler sbs: priority (importance weights p/q) or unordered-set (with its built-in baseline, Kool et al. 2020),
    both unbiased (docs/sbs.md)"""
    baseline: Baseline | None = arg(None, choices=get_args(Baseline))
    """REINFORCE baseline: none, mean, loo (leave-one-out) or greedy (self-critical); with --objective reinforce, or
    policy (none, mean, loo) (default: mean)"""
    mrt_alpha: float = arg(MRT_ALPHA, minimum=0.0, only=Only("objective", "mrt"))
    """MRT sharpness alpha: Q ∝ p^alpha over a source's candidates"""
    compare_mle: bool = arg(False, resume=FREE)
    """after RL, continue MLE from the end-of-MLE state at --rl-lr for the RL phase's training time (CPU time on CPU,
    wall time on GPU), validate (and test) it, and report it beside RL: the control RL must beat; adds the RL phase's
    time to the run; the final model stays RL's (--task g2p and karel: on, --no-compare-mle: skip it)"""
    mle_weight: float = arg(0.0, minimum=0.0)
    """lambda of the mixed objective lambda*MLE + (1-lambda)*RL"""
    reward: str | None = arg(None)
    """registered reward plug-in (bleu, chrf, exact, edit, ...) or package.module:callable (TRL's reward signature
    works too) or hf:FOLDER (a sequence-classification reward model, docs/plugins.md), or a comma-separated list of
    them, summed (--reward-weights); default: the task's (edit for g2p and tsv)"""
    reward_weights: str | None = arg(None)
    """the weights of several rewards summed (--reward a,b,c), e.g. 1,0.5,0.5 (default: 1 each); each is logged as
    reward/<name>/mean, /std"""
    rl_from_best: bool = arg(False)
    """RL (and --compare-mle's control) start from the parameters and optimizer state of the best MLE validation
    (checkpoint_best.pt), not from the last MLE step (--task karel: on)"""
    include_reference: bool = arg(False, only=Only("objective", ("beam", "distill")))
    """add each source's references to its candidates (--objective beam), q renormalised over candidates and
    references (a reference the beam already holds counted once), as Bunel et al.'s RL_beam; with --objective distill
    the references are distilled beside the candidates (GKD's mixed data)"""
    teacher: str | None = arg(None, path=True, only=Only("objective", "distill"))
    """the teacher to distil: a twophase checkpoint (.pt, the built-in LSTM or an --hf-model run) or a Hugging Face
    model folder, sharing this run's vocabularies; frozen, in evaluation mode"""
    distill_beta: float = arg(1.0, minimum=0.0, only=Only("objective", "distill"))
    """the distillation divergence (TRL's beta): 0 forward KL(teacher || student), 1 reverse KL(student || teacher),
    between the generalized Jensen-Shannon divergence; --temperature (with --sampler sample) divides both models'
    logits"""

    @property
    def reinforce_baseline(self) -> str:
        """The baseline REINFORCE uses: --baseline, or mean where it was not given (None)."""
        return self.baseline or "mean"


RLConfig.title = "RL: objective and reward"


@dataclass
class PolicyConfig:
    """The token-level policy objective: clipped importance ratios, a KL to a frozen reference, entropy terms
    (TRL's GRPO losses; docs/policy.md)."""

    loss_type: LossType = arg("dapo", choices=get_args(LossType), parse=parse_loss_type)
    """TRL's loss types (grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo) or sequence (per-sequence sums,
    averaged per source)"""
    updates_per_generation: int = arg(1, minimum=1)
    """optimizer steps per phase one (TRL's num_iterations), each a phase two over the same candidates"""
    clip_epsilon: float = arg(0.2, minimum=0.0)
    """the ratio is clipped to [1 - eps, 1 + eps_high]"""
    clip_epsilon_high: float | None = arg(None, minimum=0.0)
    """the upper clip (DAPO's clip-higher); default: --clip-epsilon"""
    kl_beta: float = arg(0.0, minimum=0.0)
    """weight of the k3 KL to a frozen reference (the end-of-MLE model, or --ref-checkpoint)"""
    kl_importance_weighted: bool = arg(True)
    """the KL term times the importance ratio (TRL's use_bias_correction_kl)"""
    ref_checkpoint: str | None = arg(None)
    """the KL reference's parameters (with --kl-beta) from this checkpoint file instead of the end-of-MLE model"""
    advantage_scale: AdvantageScale = arg("group", choices=get_args(AdvantageScale))
    """divide advantages by the source's reward std, the batch's, or not (TRL's scale_rewards)"""
    drop_zero_std: bool = arg(False)
    """sources whose candidates' rewards are all equal leave phase two (DAPO's dynamic sampling; counted as
    dropped_groups)"""
    importance_sampling_level: SamplingLevel = arg("token", choices=get_args(SamplingLevel))
    """the importance ratio per token, or per sequence (GSPO: exp of the row's mean log-ratio)"""
    delta: float | None = arg(None, minimum=0.0)
    """two-sided clipping, the unclipped ratio capped at delta (clipped loss types; > 1 + --clip-epsilon-high)"""
    sapo_temperature_pos: float = arg(1.0, minimum=1e-6, only=_SAPO)
    """the soft gate's temperature of --loss-type sapo where the advantage is positive"""
    sapo_temperature_neg: float = arg(1.05, minimum=1e-6, only=_SAPO)
    """the soft gate's temperature of --loss-type sapo elsewhere"""
    mask_truncated_completions: bool = arg(False)
    """candidates that end without EOS (cut at --max-len) leave the loss and its token count (TRL's flag)"""
    off_policy_mask_threshold: float | None = arg(None, minimum=0.0)
    """DeepSeek-V3.2's off-policy sequence mask: a candidate with a negative advantage whose mean per-token KL from
    the old policy exceeds this loses its policy term (TRL's flag)"""
    entropy_coef: float = arg(0.0, minimum=0.0)
    """TRL's entropy bonus, the loss minus this times the mean entropy of the scored positions' next-token
    distributions (needs the model's by-hand output layer: the LSTM, the HF wrappers)"""
    top_entropy_quantile: float = arg(1.0, minimum=1e-9)
    """below 1, only the positions whose next-token entropy is in this top fraction of the batch's keep their policy
    term (TRL's high-entropy mask)"""
    use_adaptive_entropy: bool = arg(False)
    """TRL's adaptive entropy control: --entropy-coef is the initial coefficient, moved by --entropy-coef-delta after
    each update (up where the update's mean entropy is at or below --entropy-target, else down) and applied only
    while at or below it"""
    entropy_coef_min: float = arg(0.0, minimum=0.0, only=_ADAPTIVE)
    """the adaptive entropy coefficient's lower bound"""
    entropy_coef_max: float = arg(1.0, minimum=0.0, only=_ADAPTIVE)
    """the adaptive entropy coefficient's upper bound"""
    entropy_coef_delta: float = arg(0.005, minimum=0.0, only=_ADAPTIVE)
    """the adaptive entropy coefficient's step per update"""
    entropy_target: float = arg(0.2, minimum=0.0, only=_ADAPTIVE)
    """the adaptive entropy control's target mean entropy in nats per token (over the loss's tokens, or the
    high-entropy ones with --top-entropy-quantile)"""


PolicyConfig.title = "policy objective"
PolicyConfig.only = Only("objective", "policy")


# The sections, in the order --help prints them: {view name: section class}.
SECTIONS = {"data": DataConfig, "model": ModelConfig, "karel": KarelConfig, "countdown": CountdownConfig,
            "lora": LoraConfig, "mle": MLEConfig, "search": SearchConfig, "rl": RLConfig, "policy": PolicyConfig, "phase_two": PhaseTwoConfig,
            "steps": StepConfig, "evaluation": EvaluationConfig, "run": RunConfig, "system": SystemConfig}

for _section in SECTIONS.values():
    take_help(_section)  # each field's help text: its docstring
del _section
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}  # field -> its section's name
FIELDS = {f.name: f for cls in SECTIONS.values() for f in fields(cls)}
# each field's plain types, from its annotation resolved ("int", "str", "None", ...; a choice field's Literal: "str")
KINDS = {name: plain_kinds(hint) for cls in SECTIONS.values() for name, hint in get_type_hints(cls).items()}
assert len(FIELDS) == sum(len(fields(cls)) for cls in SECTIONS.values()), "a field in two sections"


def only_conditions(name: str) -> tuple[Only, Only | None]:
    """The condition of a field's section (None: it always applies) and its own (`arg(only=...)`, or None)."""
    return getattr(SECTIONS[SECTION_OF[name]], "only", None), FIELDS[name].metadata.get("only")


def section_fields(name: str) -> tuple[str, ...]:
    """The field names of section `name`, in the section's order."""
    return tuple(f.name for f in fields(SECTIONS[name]))


# What a task reads (`Task.__init__(settings)`): these sections and the longest candidate its targets must fit in.
TASK_SECTIONS = ("data", "model", "karel", "countdown", "lora")
TASK_EXTRA = ("max_len",)
# The flags that shape a task's data or its model: the fields of the sections that declare `shapes_task` (data,
# model, and each built-in task's own section), less those no task reads (the trainer's). Each task declares in
# `Task.flags` those it reads; the others, given, are refused naming the flag and the task (a flag that does
# nothing is worse than an error). Every other flag is the trainer's and never refused there, so a new trainer
# flag needs no task's consent.
SHAPING_FLAGS = frozenset(f.name for cls in SECTIONS.values() if getattr(cls, "shapes_task", False)
                          for f in fields(cls) if f.metadata["task_reads"])
