"""What both Hugging Face wrappers need: special ids from a model's configs, normalised log-probabilities, and
a chunk's teacher-forced sum.

Letters: N rows, T target length, V vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor


def first_id(value):
    """A config may list several end tokens (Llama 3: end of text, end of turn): the protocol has one eos_id, the
    first of them."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def special_id(model, name: str, *, required: bool = True):
    """config.<name>, else generation_config.<name> (transformers keeps generation ids in either)."""
    for where in (model.config, getattr(model, "generation_config", None)):
        value = first_id(getattr(where, name, None))
        if value is not None:
            return int(value)
    if required:
        raise ValueError(f"{type(model).__name__}: neither config.{name} nor generation_config.{name} is set; "
                         f"set it before wrapping the model")
    return None


def log_softmax(logits: Tensor) -> Tensor:
    """Normalised in at least float32: a 16-bit model's logits are summed over long rows by the search."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """(N, T) log-softmax(logits (N, T, V)) at tokens (N, T)."""
    return log_softmax(logits).gather(2, tokens[:, :, None]).squeeze(2)


def masked_sum(tok: Tensor, mask: Tensor) -> Tensor:
    """(N,) the sum of tok (N, T) over the positions `mask` scores (a pad position may hold -inf)."""
    return torch.where(mask, tok, torch.zeros_like(tok)).sum(dim=1)
