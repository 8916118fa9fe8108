"""`--task tsv --hf-model DIR`: the TSV files on a Hugging Face model and its tokenizer, both read from a local
`save_pretrained` folder with `local_files_only=True` (nothing is ever downloaded). Imported only when
--hf-model is given; transformers is the optional extra `hf`.

An encoder-decoder config (`is_encoder_decoder`: T5, BART, Marian, ...) is wrapped as `HFSeq2Seq`, any other
causal LM (GPT-2, Llama, ...) as `HFCausalLM`, whose source is the prompt. Ids:
    source      the tokenizer's encoding of the source text with its special tokens (T5 and Marian append
                </s>, BART wraps it in <s> ... </s>, Llama prepends <s>): the encoder's input, or the prompt;
    target      seq2seq: the tokenizer's target encoding (`text_target`) with its special tokens but no final
                eos (BART's leading <s> stays, as in its pre-training labels); causal LM: the completion alone,
                no special tokens. Either way the model's eos is appended to every row, as for the built-in model;
    candidate   read back as `tokenizer.decode(ids before the first eos, skip_special_tokens=True)`, without
                the tokenizer's clean-up of spaces and with whitespace collapsed as in the references: the
                string rewards and metrics see.
Prompt tables (.jsonl, .json, .csv, .parquet: `twophase.tasks.prompts`) instead of TSV files: a string prompt is
encoded as a TSV source; chat messages are rendered with the tokenizer's chat template (with the generation
prompt) and encoded without adding special tokens, as TRL does; decoding a model trained on them reads each
input line as one user message. --lora-r wraps the model with peft's LoRA adapters (`models.hf.lora`): only
they train, and hf_final holds them (--merge-lora: the merged model).
Token limits (--max-src-len, --max-len) count the tokenizer's tokens. Parameters are float32 whatever dtype the
folder was saved in (--amp bf16 for 16-bit matmuls). The final model is written back with save_pretrained,
with the tokenizer, into <save-dir>/hf_final.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from .. import hffolder
from ..models.hf import HFCausalLM, HFSeq2Seq, lora
from ..plugins import brief
from ..system import fsdp
from .base import Example, ExportMismatch, TaskError
from .data import DataError, pad_batch
from .table import is_table
from .text import TSV, examples

FINAL = "hf_final"


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise TaskError(f"--hf-model needs transformers ({brief(err)}): pip install 'twophase[hf]'") from None
    return transformers


def load_folder(folder: str):
    """(config, tokenizer, auto model class) of a save_pretrained folder; TaskError naming --hf-model if any is
    missing or the model is neither a seq2seq nor a causal LM."""
    T = _transformers()
    wrong = hffolder.problem(folder)
    if wrong is not None:
        raise TaskError(f"--hf-model {folder}: {wrong}")
    try:
        config = T.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise TaskError(f"--hf-model {folder}: cannot read config.json ({brief(exc)})") from None
    from transformers.models.auto import modeling_auto as auto
    if config.is_encoder_decoder:
        mapping, model_class = auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, T.AutoModelForSeq2SeqLM
    else:
        mapping, model_class = auto.MODEL_FOR_CAUSAL_LM_MAPPING, T.AutoModelForCausalLM
    if type(config) not in mapping:
        kind = "sequence-to-sequence" if config.is_encoder_decoder else "causal"
        raise TaskError(f"--hf-model {folder}: model type '{config.model_type}' has no {kind} language model "
                        "(AutoModelForSeq2SeqLM for encoder-decoders, AutoModelForCausalLM otherwise)")
    try:
        with hffolder.quiet_progress_bars():
            tokenizer = T.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise TaskError(f"--hf-model {folder}: cannot load the tokenizer ({brief(exc)})") from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise TaskError(f"--hf-model {folder}: the tokenizer has {len(tokenizer)} tokens, more than the model's "
                        f"vocabulary of {vocab} (resize the model's embeddings before saving it)")
    return config, tokenizer, model_class


class HFTSV(TSV):
    """TSV lines as text for a Hugging Face model: see the module docstring. The task's state is the case folding
    alone; the ids are the folder's tokenizer's."""

    flags = frozenset({"train", "valid", "test", "lowercase_source", "max_src_len", "too_long", "hf_model"})

    def __init__(self, cfg):
        super().__init__(cfg)
        self.folder = cfg.hf_model
        self.config, self.tokenizer, self.model_class = load_folder(self.folder)
        self.causal = not self.config.is_encoder_decoder
        self.model_width = getattr(self.config, "hidden_size", None)  # --threads auto
        self.lengths = self._lengths
        self.eos_id = None  # the model's, once built (the tokenizer's until then)
        self._noted = False  # the LoRA head note, printed once (decoding builds the model again)
        self._targets: dict[str, list[int]] = {}  # reference -> ids, encoded once while counting lengths
        self._check_positions(cfg)

    def _check_positions(self, cfg) -> None:
        """A model with a fixed number of positions must hold the longest source (and, for a causal LM, its
        longest completion after it): refused now, not as an index error deep in the first search."""
        positions = getattr(self.config, "max_position_embeddings", None)
        if not isinstance(positions, int):  # T5: relative positions, no limit
            return
        if self.causal and cfg.max_src_len + cfg.max_len > positions:
            raise TaskError(f"--hf-model {self.folder}: the model has {positions} positions, fewer than "
                            f"--max-src-len {cfg.max_src_len} + --max-len {cfg.max_len} (a prompt and its completion "
                            "must fit in them): lower those flags")
        for flag, value in (("--max-src-len", cfg.max_src_len), ("--max-len", cfg.max_len)):
            if value > positions:
                raise TaskError(f"--hf-model {self.folder}: the model has {positions} positions, fewer than {flag} "
                                f"{value}: lower it")

    # ---- data and state
    def load_data(self) -> None:
        if is_table(self.cfg.train):
            return self.load_tables()
        train, valid, test = self.splits()
        self.train, self.valid = examples(train, False), examples(valid, False)
        self.test = examples(test, False) if test is not None else []
        note = self._round_trip_note()
        if note:
            self.notes.append(note)

    def _round_trip_note(self) -> str | None:
        """Training references that do not read back the same from their ids: no candidate can match them."""
        refs = list(dict.fromkeys(r for ex in self.train for r in ex.references))
        changed = [(r, back) for r in refs if (back := self.detokenize(self._targets[r])) != r]
        if not changed:
            return None
        ref, back = changed[0]
        return (f"--hf-model: {len(changed)} of {len(refs)} training references read back otherwise from the "
                f"tokenizer's ids (e.g. {ref!r} -> {back!r}): exact-match rewards cannot reach 1 on them")

    def _lengths(self, sources, targets) -> tuple[list[int], list[int]]:
        """load_tsv's hook: every line's source and target counted in the tokenizer's tokens (targets without eos)."""
        source_ids = self.encode_sources([" ".join(s) for s in sources]) if sources else []
        texts = [" ".join(t) for t in targets]
        todo = [t for t in dict.fromkeys(texts) if t not in self._targets]
        self._targets.update(zip(todo, self._encode_targets(todo) if todo else []))
        return [len(ids) for ids in source_ids], [len(self._targets[t]) for t in texts]

    def state_dict(self) -> dict:
        return {"fold_case": self.fold_case, "causal": self.causal, "chat": self.chat}

    def load_state_dict(self, state: dict) -> None:
        self.fold_case = state["fold_case"]
        self.chat = state.get("chat", False)

    # ---- prompt tables (twophase.tasks.prompts)
    def prompt_text(self, prompt, where: str = "prompt") -> str:
        """A table's prompt as the text its ids encode: a string as a TSV source, chat messages rendered by the
        tokenizer's chat template with the generation prompt (continuing a final assistant message), as TRL's
        `apply_chat_template` does."""
        if not isinstance(prompt, list):
            return self.source_text(prompt)
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"{where}: a conversational prompt needs a chat template, and the tokenizer of "
                            f"--hf-model {self.folder} has none")
        last_is_assistant = prompt[-1]["role"] == "assistant"
        try:
            return self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=not last_is_assistant,
                                                      continue_final_message=last_is_assistant)
        except Exception as exc:
            raise DataError(f"{where}: the chat template cannot render this prompt ({brief(exc)})") from None

    def count_tokens(self, sources: list[str], references: list[list[str]]):
        """Prompts and references in the tokenizer's tokens (references without eos)."""
        texts = [r for refs in references for r in refs]
        todo = [t for t in dict.fromkeys(texts) if t not in self._targets]
        self._targets.update(zip(todo, self._encode_targets(todo) if todo else []))
        return ([len(ids) for ids in self._prompt_ids(sources)],
                [[len(self._targets[r]) for r in refs] for refs in references])

    def _prompt_ids(self, prompts: list) -> list[list[int]]:
        """The ids of prompts (strings or chat messages): a rendered chat template holds its special tokens
        already, so it is tokenized without adding any (as TRL does); a string gets them as a TSV source."""
        texts = [self.prompt_text(p) for p in prompts]
        if prompts and isinstance(prompts[0], list):
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return self.encode_sources(texts)

    # ---- model
    def build_model(self):
        try:
            with hffolder.quiet_progress_bars():
                model = self.model_class.from_pretrained(self.folder, **hffolder.offline_float32())
        except Exception as exc:
            raise TaskError(f"--hf-model {self.folder}: cannot load the model ({hffolder.load_failure(exc)})") \
                from None
        if self.cfg.lora_r:
            model = self._lora(model)
        try:
            wrapped = HFCausalLM(model, self.tokenizer) if self.causal else HFSeq2Seq(model)
        except Exception as exc:
            raise TaskError(f"--hf-model {self.folder}: cannot wrap the model ({brief(exc)})") from None
        if wrapped.head_note and not self._noted:
            self._noted = True
            print(f"--lora-target-modules: {wrapped.head_note}", file=sys.stderr, flush=True)
        self.eos_id = wrapped.eos_id
        return wrapped

    def _lora(self, model):
        """--lora-r: the model as a peft PeftModel with LoRA adapters (the rest frozen)."""
        try:
            import peft  # noqa: F401
        except ImportError as err:
            raise TaskError(f"--lora-r needs peft ({brief(err)}): pip install 'twophase[hf]'") from None
        cfg = self.cfg
        targets = [m.strip() for m in cfg.lora_target_modules.split(",")] if cfg.lora_target_modules else None
        try:
            return lora.attach(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, targets, not self.causal)
        except Exception as exc:  # peft: unknown target modules, a model type without default targets, ...
            raise TaskError(f"--lora-r {cfg.lora_r}: peft cannot adapt {self.folder} ({brief(exc)}); name the "
                            "modules with --lora-target-modules") from None

    def encode_sources(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=True)["input_ids"]

    def _encode_targets(self, texts: list[str]) -> list[list[int]]:
        if self.causal:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        encoded = self.tokenizer(text_target=texts, add_special_tokens=True)["input_ids"]
        return [ids[:-1] if ids and ids[-1] == eos else ids for ids in encoded]

    def source_text(self, source: str) -> str:
        """A source as training saw it: whitespace collapsed (and lower-cased with --lowercase-source)."""
        return " ".join((source.lower() if self.fold_case else source).split())

    def collate(self, batch: list[Example], device) -> dict:
        """{"input_ids", "attention_mask"} (B, S), right-padded (the wrappers read the mask, not the pad id)."""
        ids = self._prompt_ids([e.source for e in batch])
        fill = next((i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if i is not None), 0)
        padded, lengths = pad_batch(ids, device, fill)  # (B, S), (B,)
        mask = torch.arange(padded.shape[1], device=device)[None] < lengths[:, None]  # (B, S)
        return {"input_ids": padded, "attention_mask": mask.long()}

    def target_ids(self, example: Example) -> list[list[int]]:
        missing = [r for r in example.references if r not in self._targets]
        if missing:
            self._targets.update(zip(missing, self._encode_targets(missing)))
        return [list(self._targets[r]) for r in example.references]

    def detokenize(self, ids: list[int]) -> str:
        eos = self.eos_id if self.eos_id is not None else self.tokenizer.eos_token_id
        end = ids.index(eos) if eos in ids else len(ids)
        text = self.tokenizer.decode(ids[:end], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return " ".join(text.split())

    def save_final(self, model, save_dir) -> Path:
        """save_pretrained of the model (float32) and the tokenizer into <save-dir>/hf_final, via a temporary
        folder: the previous hf_final stays whole until the new one is. The folder is read back with
        from_pretrained, as its users read it, and compared with the model parameter by parameter: an export
        that would load as another model (a parameter its save_pretrained drops, say) raises ExportMismatch and
        is not kept."""
        final, tmp = Path(save_dir) / FINAL, Path(save_dir) / f".{FINAL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with hffolder.quiet_progress_bars():
                adapters = model.adapter is not None and not self.cfg.merge_lora
                if model.adapter is not None:  # --lora-r: the adapters (--merge-lora: merged into a copy of the model)
                    written = lora.save(model.adapter, tmp, self.cfg.merge_lora)
                else:
                    written = model.model
                    written.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            wrong = fsdp.first_difference(dict(written.named_parameters()),
                                           dict(self._reloaded(tmp, adapters).named_parameters()))
            if wrong is not None:
                raise ExportMismatch(f"{final}: reloaded with from_pretrained, {wrong}: not exported")
        except BaseException:  # a full disk, say: no half-written folder stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    def _reloaded(self, folder: Path, adapters: bool):
        """The export in `folder` as a user loads it: the model class's from_pretrained (float32, as training
        loads), or for adapters alone peft's PeftModel.from_pretrained on the --hf-model base."""
        with hffolder.quiet_progress_bars():
            model = self.model_class.from_pretrained(self.folder if adapters else folder, **hffolder.offline_float32())
            if adapters:
                import peft
                model = peft.PeftModel.from_pretrained(model, folder)
        return model

    # ---- decoding
    def parse_source(self, line: str):
        """An input line; trained on chat prompts, the line is one user message."""
        return [{"role": "user", "content": line}] if self.chat else self.source_text(line)

    def format_output(self, hypothesis: str) -> str:
        return hypothesis

    def source_problem(self, source, max_len: int) -> str | None:
        """A prompt (a string, or chat messages) longer than training's --max-src-len, or one that with max_len output tokens overruns the
        model's positions (an index error deep in the first step otherwise)."""
        count = len(self._prompt_ids([source if isinstance(source, list) else self.source_text(source)])[0])
        if count > self.cfg.max_src_len:
            return f"source has {count} tokens, more than the training limit of --max-src-len {self.cfg.max_src_len}"
        positions = getattr(self.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            need = count + max_len if self.causal else max(count, max_len)
            if need > positions:
                return (f"source has {count} tokens; with --max-len {max_len} the model needs {need} positions, more "
                        f"than its {positions}")
        return None

    def unknown_source_tokens(self, source: str) -> list[str]:
        """Words of a source the tokenizer maps to its unknown token (none for byte-level tokenizers)."""
        unk = self.tokenizer.unk_token_id
        if unk is None:
            return []
        if isinstance(source, list):
            source = " ".join(m["content"] for m in source)
        words = self.source_text(source).split()
        if not words:
            return []
        return [w for w, ids in zip(words, self.tokenizer(words, add_special_tokens=False)["input_ids"]) if unk in ids]
