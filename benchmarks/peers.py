"""The TRL peers of `benchmarks.hf`'s two-phase step: TRL's phase-two recipe written out
(`trl_backward`: per micro-batch of rows, the whole input through the model, `selective_log_softmax`, backward)
and the real TRL 1.16 `GRPOTrainer.compute_loss` (`grpo_trainer`, `grpo_trainer_backward`), each computing the
gradient of sum_i c_i log p(y_i | x_i) over phase one's samples.

Letters: N rows, C rows per micro-batch, P prompt (source) length, T completion length, V vocabulary.
"""
from __future__ import annotations

import inspect

import torch

from twophase.protocol import target_mask, teacher_forced_inputs


def selective_log_softmax(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """TRL's (trl.trainer.utils): log-softmax at the tokens without an (N, T, V) log-softmax, one row's logsumexp
    at a time; 16-bit logits go through log_softmax row by row."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(2, tokens[:, :, None]).squeeze(2)  # (C, T)
        return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return torch.stack([torch.log_softmax(row, dim=-1).gather(1, tok[:, None]).squeeze(1)
                        for row, tok in zip(logits, tokens)])


def trl_backward(wrapper, source: dict, samples, c: torch.Tensor, micro: int) -> float:
    """TRL's `_get_per_token_logps` + loss, per micro-batch of rows: the whole input through the model."""
    from twophase.models.hf import HFSeq2Seq

    model, total = wrapper.model, 0.0
    for start in range(0, len(samples), micro):
        rows = slice(start, start + micro)
        tokens, owner = samples.tokens[rows], samples.owner[rows]  # (C, T), (C,)
        keep = target_mask(tokens, wrapper.pad_id, wrapper.eos_id)  # (C, T)
        ids, mask = source["input_ids"][owner], source["attention_mask"][owner]  # (C, P) each
        if isinstance(wrapper, HFSeq2Seq):
            logits = model(input_ids=ids, attention_mask=mask,
                           decoder_input_ids=teacher_forced_inputs(tokens, wrapper.bos_id)).logits  # (C, T, V)
        else:
            full = torch.cat([mask, keep.long()], dim=1)  # (C, P + T)
            T = tokens.shape[1]
            only = {"logits_to_keep": T + 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
            logits = model(input_ids=torch.cat([ids, tokens], dim=1), attention_mask=full,
                           position_ids=(full.cumsum(1) - 1).clamp_min(0), **only).logits
            logits = logits[:, -T - 1:-1]  # (C, T, V): the position before each completion token predicts it
        logp = selective_log_softmax(logits, tokens)  # (C, T)
        loss = (c[rows].float() * torch.where(keep, logp, torch.zeros_like(logp)).sum(1)).sum()
        loss.backward()
        total += loss.item()
    return total


def grpo_trainer(wrapper, cell: dict):
    """TRL's GRPOTrainer around the wrapper's model, built offline: a word-level tokenizer over the ids, a dummy
    reward and dataset (compute_loss reads neither), beta 0 (no reference model loaded)."""
    import os
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, cell["vocab"])}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>")),
                                        pad_token="<pad>", eos_token="</s>", bos_token="<s>", padding_side="left")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=cell["samples"],
                      num_generations=cell["samples"], max_completion_length=cell["completion"], beta=0.0,
                      loss_type="dr_grpo", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=wrapper.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=tokenizer)
    wrapper.eval()  # compute_loss in "eval" mode: no gradient-accumulation scaling (and no dropout)
    return trainer


def grpo_trainer_backward(trainer, wrapper, source: dict, samples, c: torch.Tensor, micro: int) -> float:
    """TRL's compute_loss (dr_grpo: sum / (rows * max_len)) per micro-batch of rows, backward after each. With
    A_i = -c_i * rows * max_len its gradient at ratio 1 is sum_i c_i grad log p_i, the other methods'."""
    total = 0.0
    trainer.model.eval()  # "eval" mode, as built (rescore_backward elsewhere restores a wrapper's mode)
    for start in range(0, len(samples), micro):
        rows = slice(start, start + micro)
        tokens, owner = samples.tokens[rows], samples.owner[rows]  # (C, T), (C,)
        keep = target_mask(tokens, wrapper.pad_id, wrapper.eos_id)  # (C, T)
        adv = -c[rows] * len(tokens) * trainer.max_completion_length  # (C,)
        inputs = {"prompt_ids": source["input_ids"][owner], "prompt_mask": source["attention_mask"][owner],
                  "completion_ids": tokens, "completion_mask": keep.long(), "advantages": adv.float(),
                  "num_items_in_batch": keep.sum()}
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        total += loss.item()
    return total
