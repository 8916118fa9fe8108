"""A Hugging Face sequence-classification model as the reward: `--reward hf:FOLDER` (or `--reward FOLDER`), the
`save_pretrained` folder of an `AutoModelForSequenceClassification` with `num_labels=1` and its tokenizer, read
with `local_files_only=True`. The reward of a candidate is the model's single logit, as TRL's GRPOTrainer scores a
reward model given in `reward_funcs`:

    causal LM task         text = prompt + completion (the prompt as the data holds it, no separator added), in
                           the reward model's tokens without adding special tokens, right-padded, not truncated;
    chat prompts           text = the reward tokenizer's chat template over prompt + [assistant: completion],
                           tokenized the same way;
    encoder-decoder task   the text pair (source, hypothesis), with the tokenizer's special tokens (a cross-encoder
                           such as a quality-estimation model reads [CLS] source [SEP] hypothesis [SEP]).

Scored without a graph, in evaluation mode and float32, on the run's device, `BATCH` texts per forward. As TRL
does, a tokenizer without a pad token pads with its eos, and the model is told that pad id (a causal classifier
reads the logit at the last token that is not padding). transformers is imported only when such a reward is
built.
"""
from __future__ import annotations

import os
from typing import Any

from .. import hffolder
from .errors import RewardError

BATCH = 64  # texts per forward: all of a step's candidates at once could exceed a large reward model's memory
PREFIX = "hf:"


def folder_of(spec: str) -> str:
    """The folder `--reward spec` names: spec without its `hf:`."""
    return spec[len(PREFIX):] if spec.startswith(PREFIX) else spec


def holds_model(spec: str) -> bool:
    """Whether the folder `spec` names holds a config.json."""
    return os.path.isfile(os.path.join(folder_of(spec), "config.json"))


def is_folder_spec(spec: str) -> bool:
    """Whether `--reward spec` names a reward model: `hf:FOLDER`, or a folder holding a config.json."""
    return spec.startswith(PREFIX) or holds_model(spec)


class RewardModel:
    """The reward (hypotheses, references, sources) -> list[float] of one sequence-classification folder.
    `causal`: the task's model is a causal LM (its source is the prompt) rather than an encoder-decoder."""

    def __init__(self, spec: str, device: Any = None, causal: bool = False):
        self.spec, self.causal = spec, causal
        folder = folder_of(spec)
        self.model, self.tokenizer = load(folder, f"--reward {spec}")
        if device is not None:
            self.model.to(device)
        self.__name__ = os.path.basename(os.path.normpath(folder))  # the logs' name, as TRL's: the folder's

    def texts(self, hypotheses: list[str], sources: list[Any]) -> dict:
        """The tokenizer's arguments for one batch: one text per candidate, or text pairs."""
        if any(isinstance(s, list) for s in sources):  # chat messages (a prompt table's): TRL's chat template
            if not all(isinstance(s, list) for s in sources):
                raise RewardError(f"--reward {self.spec}: the prompts mix strings and chat messages")
            if not self.tokenizer.chat_template:
                raise RewardError(f"--reward {self.spec}: conversational prompts need a chat template, and its "
                                  "tokenizer has none")
            texts = [self.tokenizer.apply_chat_template([*s, {"role": "assistant", "content": h}], tokenize=False)
                     for s, h in zip(sources, hypotheses)]
            return {"text": texts, "add_special_tokens": False}
        wrong = next((s for s in sources if not isinstance(s, str)), None)
        if wrong is not None:
            raise RewardError(f"--reward {self.spec}: a reward model scores text, and this task's sources are "
                              f"{type(wrong).__name__}s")
        if self.causal:
            return {"text": [s + h for s, h in zip(sources, hypotheses)], "add_special_tokens": False}
        return {"text": list(sources), "text_pair": list(hypotheses), "add_special_tokens": True}

    def __call__(self, hypotheses: list[str], references: list[list[str]], sources: list[Any]) -> list[float]:
        import torch

        device = next(self.model.parameters()).device
        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(hypotheses), BATCH):
                args = self.texts(hypotheses[start:start + BATCH], sources[start:start + BATCH])
                inputs = self.tokenizer(**args, padding=True, padding_side="right", return_tensors="pt")
                logits = self.model(**inputs.to(device)).logits  # (batch, 1)
                out += logits[:, 0].float().tolist()
        return out


def load(folder: str, flag: str):
    """(model in evaluation mode, float32, without gradients; tokenizer with a pad token) of a save_pretrained
    sequence-classification folder with one label; RewardError (one line naming `flag`) where it is not one."""
    try:
        import transformers as T
        from transformers.models.auto import modeling_auto as auto
    except ImportError as err:
        raise RewardError(f"{flag}: a reward model needs transformers ({err}): pip install 'twophase[hf]'") from None
    from ..plugins import brief

    wrong = hffolder.problem(folder)
    if wrong is not None:
        raise RewardError(f"{flag}: {wrong}")
    try:
        config = T.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise RewardError(f"{flag}: cannot read config.json ({brief(exc)})") from None
    architectures = config.architectures or []
    if type(config) not in auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING or \
            not any(a.endswith("ForSequenceClassification") for a in architectures):
        saved = ", ".join(architectures) or f"model type '{config.model_type}'"
        raise RewardError(f"{flag}: not a sequence-classification model ({saved}); a reward model is saved from "
                    "AutoModelForSequenceClassification with num_labels=1")
    if config.num_labels != 1:
        raise RewardError(f"{flag}: the model has num_labels={config.num_labels}; a reward model has one (its logit "
                    "is the reward)")
    try:
        with hffolder.quiet_progress_bars():  # one line per event in a training log
            tokenizer = T.AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model, info = T.AutoModelForSequenceClassification.from_pretrained(
                folder, output_loading_info=True, **hffolder.offline_float32())
    except Exception as exc:
        raise RewardError(f"{flag}: cannot load the model or its tokenizer ({hffolder.load_failure(exc)})") \
            from None
    if info.get("missing_keys"):  # a head initialised at random would score noise
        raise RewardError(f"{flag}: the folder's weights lack {', '.join(sorted(info['missing_keys'])[:3])}; save the "
                    "trained sequence-classification model with save_pretrained")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise RewardError(f"{flag}: the tokenizer has neither a pad nor an eos token to pad a batch with")
        tokenizer.pad_token = tokenizer.eos_token  # as TRL
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # where a causal classifier reads
    return model.eval().requires_grad_(False), tokenizer
