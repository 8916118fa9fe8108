"""--objective distill's teacher: loaded from --teacher, frozen, and the objective of a step's rows.

--teacher names a twophase checkpoint (a run of the built-in LSTM, or of --hf-model without LoRA: the model its
config describes, with the checkpoint's parameters) or a Hugging Face model folder (loaded as the run's
--hf-model is, of the same kind). Either way the teacher must read this run's sources and write its targets: a
checkpoint's vocabularies must be the run's, a folder's vocabulary size the model's (checked again on the first
batch by `objectives.distill.check_compatible`). The teacher is in evaluation mode, its parameters frozen, on
the run's device; under --fsdp it is sharded as the model is (each process keeps 1/W of its parameters) and
gathered for the step's phase two alone (`train.steps.distill`), as the KL reference is for its scoring
pass. The divergence (`objectives.distill`) is TRL's DistillationTrainer loss with --distill-beta as its beta
and --temperature (with --sampler sample, else 1) as its temperature, normalised as TRL's: by the scored tokens
of the step's whole generation, all --grad-accum batches of all processes.
"""
from __future__ import annotations

import os

from .. import hffolder
from ..models.seq2seq import Seq2Seq
from ..objectives.distill import check_compatible, distillation
from ..system import distributed, fsdp
from . import checkpoint
from ..errors import UsageError


def load(cfg, task, student, device):
    """The frozen teacher of --teacher for this run's task and model (None without --objective distill)."""
    if cfg.objective != "distill":
        return None
    path = cfg.teacher
    if os.path.isdir(path):
        teacher = _hugging_face(path, student, task)
    elif os.path.isfile(path):
        teacher = _checkpoint(path, task, student)
    else:
        raise UsageError(f"--teacher {path}: no such file or folder")
    teacher = teacher.to(device).eval().requires_grad_(False)
    try:
        check_compatible(student, teacher)
    except ValueError as err:
        raise UsageError(f"--teacher {path}: {err}") from None
    return fsdp.shard_model(teacher) if cfg.fsdp else teacher


def objective(teacher, rl, search, rows: list):
    """The distillation objective of a step whose --grad-accum batches' rows (this process's) are `rows`, with
    the RL section's --distill-beta and the search's temperature (--sampler sample's, else 1): TRL's normaliser,
    the scored tokens of the step's whole generation (every batch's, every process's: TRL's num_items_in_batch,
    gathered over its generation batch), the same for each batch's phase two."""
    tokens = distributed.reduce_sums({"tokens": float(sum(r.lengths.sum() for r in rows))})["tokens"]
    temperature = search.temperature if search.sampler == "sample" else 1.0
    return distillation(teacher, rl.distill_beta, temperature, num_items=tokens)


# The pairs that work: a teacher teaches a student of its own kind, which reads the same sources and writes the
# same targets by the same functions (its size, depth and width may differ).
PAIRS = ("a built-in LSTM checkpoint teaches a built-in LSTM student; a Hugging Face encoder-decoder (a folder, or "
         "the checkpoint of a --hf-model run) an encoder-decoder --hf-model; a causal LM a causal LM --hf-model")
LSTM, ENCODER_DECODER, CAUSAL = "a built-in LSTM", "a Hugging Face encoder-decoder", "a Hugging Face causal LM"


def student_kind(student) -> str:
    from ..models.hf import HFCausalLM, HFSeq2Seq

    if isinstance(student, Seq2Seq):
        return LSTM
    if isinstance(student, HFSeq2Seq):
        return ENCODER_DECODER
    return CAUSAL if isinstance(student, HFCausalLM) else type(student).__name__


def _refuse_pair(path: str, teacher: str, student) -> None:
    """The one line for a teacher of another kind than the student, naming both and the pairs that work."""
    ours = student_kind(student)
    if teacher != ours:
        raise UsageError(f"--teacher {path}: {teacher} cannot teach this run's model, {ours}: {PAIRS} "
                           "(docs/distillation.md)")


def _hugging_face(path: str, student, task):
    from ..models.hf import HFCausalLM, HFSeq2Seq

    wrong = hffolder.problem(path, tokenizer=False)  # the run's tokenizer is the teacher's
    if wrong is not None:
        raise UsageError(f"--teacher {path}: {wrong}")
    _refuse_pair(path, ENCODER_DECODER if _is_encoder_decoder(path) else CAUSAL, student)
    causal = isinstance(student, HFCausalLM)
    import transformers as T

    kind = T.AutoModelForCausalLM if causal else T.AutoModelForSeq2SeqLM
    try:
        with hffolder.quiet_progress_bars():
            model = kind.from_pretrained(path, **hffolder.offline_float32())
    except Exception as exc:  # noqa: BLE001 - whatever from_pretrained raises, the folder is not a model
        raise UsageError(f"--teacher {path}: cannot load the model ({hffolder.load_failure(exc)})") from None
    return HFCausalLM(model, getattr(task, "tokenizer", None)) if causal else HFSeq2Seq(model)


def _checkpoint(path: str, task, student):
    try:  # the run's own loader: a file torch.save did not write, or one carrying pickled code, in its words
        state = checkpoint.load(path)
    except checkpoint.CheckpointError as err:
        raise UsageError(f"--teacher {err}") from None
    if not isinstance(state.get("config"), dict):
        raise UsageError(f"--teacher {path}: not a twophase checkpoint (no config and model)")
    config, saved = state["config"], (state.get("task") or {}).get("state") or {}
    ours = task.state_dict() if callable(getattr(task, "state_dict", None)) else {}
    for key, what in (("tgt_vocab", "target"), ("src_vocab", "source")):
        if key in ours and saved.get(key) != ours[key]:
            theirs = len(saved[key]) if isinstance(saved.get(key), list) else "no"
            raise UsageError(f"--teacher {path}: its {what} vocabulary ({theirs} tokens) is not this run's "
                               f"({len(ours[key])} tokens); distillation needs one vocabulary")
    if config.get("lora_r"):
        raise UsageError(f"--teacher {path}: a --lora-r checkpoint holds adapters only; merge them "
                           "(--merge-lora) and give the folder")
    if config.get("hf_model"):
        if os.path.isdir(config["hf_model"]):  # the run's folder, where it still is: its kind named from here
            _refuse_pair(path, ENCODER_DECODER if _is_encoder_decoder(config["hf_model"]) else CAUSAL, student)
        teacher = _hugging_face(config["hf_model"], student, task)
    elif config.get("task") != "karel":  # Karel's model is its own; every other checkpoint's the built-in LSTM
        _refuse_pair(path, LSTM, student)
        teacher = Seq2Seq(len(saved["src_vocab"]), len(saved["tgt_vocab"]), config["embed_dim"],
                          config["hidden_size"], config["dropout"], config["bidirectional"])
    else:
        raise UsageError(f"--teacher {path}: a checkpoint of --task {config['task']} (its own model) cannot "
                           f"teach: {PAIRS}")
    try:
        teacher.load_state_dict(state["model"])
    except RuntimeError as err:
        raise UsageError(f"--teacher {path}: its parameters do not fit the model its config describes "
                           f"({str(err).splitlines()[0]})") from None
    return teacher


def _is_encoder_decoder(folder: str) -> bool:
    """Whether a Hugging Face folder's config.json (`hffolder.problem` checked it is there) is an encoder-decoder's:
    its own flag, as AutoModelForSeq2SeqLM reads it."""
    import json

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return bool(json.load(f).get("is_encoder_decoder", False))
