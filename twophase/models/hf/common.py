"""What both Hugging Face wrappers need: special ids from a model's configs, the source's forward (recomputed in
phase two's backward), normalised log-probabilities and a chunk's teacher-forced sum.

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


def freeze_unsaved(model) -> frozenset[str]:
    """Freeze the parameters the model's own `save_pretrained` leaves out (`_keys_to_ignore_on_save`: Marian's
    sinusoidal position tables under transformers 5, which require grad there): `from_pretrained` rebuilds them
    from the config, so a trained value would be lost from every export. Returns their names."""
    skipped = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    unsaved = frozenset(name for name, _ in model.named_parameters() if name in skipped)
    for name, p in model.named_parameters():
        if name in unsaved:
            p.requires_grad_(False)
    return unsaved


def log_softmax(logits: Tensor) -> Tensor:
    """Normalised in at least float32: a 16-bit model's logits are summed over long rows by the search."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """(N, T) log-softmax(logits (N, T, V)) at tokens (N, T), with gradients; see `_TokenLogProbs`."""
    return _TokenLogProbs.apply(logits, tokens)


class _TokenLogProbs(torch.autograd.Function):
    """log p = logits[token] - logsumexp(logits), differentiated by hand: d/dlogits = onehot(token) - softmax.

    Phase two's largest tensors are a chunk's (N, T, V) logits. Autograd through log_softmax + gather keeps the
    log-softmax besides the logits, and its backward holds its incoming gradient and its result at once. Here
    the forward's temporaries are one row's (logsumexp row by row, as TRL's selective_log_softmax does) and the
    backward builds one (N, T, V) tensor, the softmax, scaled in place. The same numbers, computed in at least
    float32 as `log_softmax` is."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor) -> Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.stack([torch.logsumexp(row.to(dtype), dim=-1) for row in logits])  # (N, T)
        ctx.save_for_backward(logits, tokens, lse)
        return logits.gather(2, tokens[:, :, None]).squeeze(2).to(dtype) - lse

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, tokens, lse = ctx.saved_tensors
        g = torch.sub(logits, lse[:, :, None]).exp_()  # (N, T, V) softmax, in lse's dtype: the one allocation
        g.mul_(-grad[:, :, None]).scatter_add_(2, tokens[:, :, None], grad[:, :, None].to(g.dtype))
        return g.to(logits.dtype), None


def masked_sum(tok: Tensor, mask: Tensor) -> Tensor:
    """(N,) the sum of tok (N, T) over the positions `mask` scores (a pad position may hold -inf)."""
    return torch.where(mask, tok, torch.zeros_like(tok)).sum(dim=1)


def source_forward(fn, recompute: bool, *args):
    """fn(*args), the source's (prompt's) forward. With gradients and `recompute`, its activations are not kept:
    phase two holds the source's graph from its encoder pass until the backward after the last chunk, as much
    memory as a chunk's own graph when B * P is about C * T; `torch.utils.checkpoint` runs it again in that
    backward instead, which costs one more forward of B sources (random state preserved: the same dropout)."""
    if recompute and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
