"""Phase two's output layer from the decoder's last hidden states, for the model classes whose head is known.

A chunk's teacher-forced forward through the whole model returns its (C, T, V) logits, and their gradient
follows in backward: phase two's largest tensors. Where the model's class is known, `score` stops at the last
hidden states (C, T, H) (the decoder of a seq2seq model, the base model of a causal LM) and applies the output
layer itself through `twophase.models.outputlayer`, a block of logits at a time: `target_log_probs` (recomputed
in backward) for `score`, `backward_from_hidden` (each block once, the coefficients being known) for
`weighted_score_backward`. The numbers are the model's own logits, normalised as search normalises them.

What lies between the last hidden state h and the logits, per class (transformers 4.40 to 5.x):

    T5ForConditionalGeneration                    lm_head(h * d_model ** -0.5) where the config scales decoder
                                                  outputs (5.x: scale_decoder_outputs; 4.x: tie_word_embeddings,
                                                  the default), lm_head(h) otherwise
    BartForConditionalGeneration, MarianMTModel   lm_head(h) + final_logits_bias
    GPT2LMHeadModel, LlamaForCausalLM             lm_head(h)

Anything else keeps the full logits (`find` returns None): another class, a subclass (its forward may differ),
an lm_head that is not a plain `nn.Linear` (quantised, an adapter) or has hooks, a T5 split across devices by
4.x's `parallelize`. Other families put more there (Gemma 2 soft-caps its logits, Cohere scales them, MPT and
OPT project differently), so none is assumed. A recognised model is checked once more at wrap time (`agrees`):
the wrapper runs two tokens through the model and through its hidden states + this head, and keeps the full
logits if the two differ by more than rounding.

Letters: N rows, T target length, H model width, V vocabulary, M scored positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...phase2 import tokenweights
from .. import outputlayer

# class name -> the name of a (1, V) logit-bias buffer the model adds after lm_head, or None
KNOWN = {
    "T5ForConditionalGeneration": None,
    "BartForConditionalGeneration": "final_logits_bias",
    "MarianMTModel": "final_logits_bias",
    "GPT2LMHeadModel": None,
    "LlamaForCausalLM": None,
}


@dataclass(frozen=True)
class Head:
    """logits = lm_head(h * scale) (+ the model's `buffer`). The tensors are read from the model at each call:
    `resize_token_embeddings` replaces the modules that hold them."""

    scale: float = 1.0
    buffer: str | None = None

    def parts(self, model) -> tuple[Tensor, Tensor]:
        """(weight (V, H), bias (V,)): lm_head's bias, the model's bias buffer, or zeros."""
        lm = model.get_output_embeddings()
        weight = lm.weight
        if lm.bias is not None:
            return weight, lm.bias
        if self.buffer is not None:
            return weight, getattr(model, self.buffer).reshape(-1).to(weight.dtype)  # (1, V) -> (V,)
        return weight, weight.new_zeros(weight.shape[0])

    def hidden(self, h: Tensor) -> Tensor:
        return h if self.scale == 1.0 else h * self.scale

    def logits(self, model, h: Tensor) -> Tensor:
        """(..., V) the model's logits at its last hidden states h (..., H), by this head."""
        weight, bias = self.parts(model)
        return F.linear(self.hidden(h).to(weight.dtype), weight, bias)

    def agrees(self, model, hidden: Tensor, logits: Tensor) -> bool:
        """Whether this head maps hidden (..., H) to the model's own logits (..., V), to rounding: 8 units in
        the last place of the coarser dtype, at least 1e-3, relative to the largest logit (equal infinities, a
        banned token's -inf bias, agree)."""
        with torch.no_grad():
            weight, _ = self.parts(model)
            ours = self.logits(model, hidden).double()
            theirs = logits.double()
            gap = torch.where(ours == theirs, 0.0, (ours - theirs).abs())  # nan where only one is infinite
            eps = max(torch.finfo(logits.dtype).eps, torch.finfo(weight.dtype).eps)
            finite = theirs[theirs.isfinite()]
            size = float(finite.abs().max()) if finite.numel() else 0.0
            return bool(gap.max() <= max(8 * eps, 1e-3) * (1.0 + size))


class FastPath:
    """The `weighted_score_backward` both wrappers expose (see `twophase.protocol`): their own
    `_weighted_score_backward`, the output layer differentiated by hand, where `self.head` is known; None
    otherwise, and the library then differentiates `score`. Both ban no token (a pretrained head gives pad
    some probability; search never proposes it): `bans_specials = False` tells `twophase.check_model`."""

    bans_specials = False

    @property
    def weighted_score_backward(self):
        return None if self.head is None else self._weighted_score_backward


def find(model) -> Head | None:
    """The Head of a model of a class in KNOWN, built as transformers builds it; None for anything else."""
    cls = type(model)
    if cls.__name__ not in KNOWN or not cls.__module__.startswith("transformers."):
        return None
    if "forward" in vars(model) or getattr(model, "model_parallel", False):
        return None  # a patched forward; 4.x T5 moving lm_head between devices inside forward
    lm = model.get_output_embeddings()
    if type(lm) is not torch.nn.Linear or lm._forward_hooks or lm._forward_pre_hooks:
        return None
    buffer = KNOWN[cls.__name__]
    if buffer is not None and (lm.bias is not None or getattr(model, buffer, None) is None):
        return None
    scale = 1.0
    if cls.__name__ == "T5ForConditionalGeneration":
        config = model.config
        if getattr(config, "scale_decoder_outputs", getattr(config, "tie_word_embeddings", True)):
            scale = config.d_model ** -0.5
    return Head(scale, buffer)


def scored(hidden: Tensor, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(h (M, H), target (M,), row (M,)) at the M positions mask (N, T) scores: a pad position would cost
    V-sized work and add nothing."""
    h, target, valid = _scored_positions(hidden, tokens, mask)
    return h, target, valid // hidden.shape[1]


def _scored_positions(hidden: Tensor, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`scored` with each position's flat index (M,) into the N*T positions instead of its row."""
    N, T, H = hidden.shape
    valid = mask.reshape(-1).nonzero().squeeze(1)  # (M,): its size read on the host, once per chunk
    return hidden.reshape(N * T, H).index_select(0, valid), tokens.reshape(-1).index_select(0, valid), valid


def log_probs(head: Head, model, hidden: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
    """(N,) sum over the positions mask (N, T) scores of log p(tokens) at hidden (N, T, H), with gradients
    (`outputlayer.target_log_probs`: no (N, T, V) tensor kept)."""
    weight, bias = head.parts(model)
    h, target, row = scored(head.hidden(hidden), tokens, mask)
    banned = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)  # the wrappers ban nothing
    tok = outputlayer.target_log_probs(h, weight, bias, target, banned)  # (M,)
    return tok.new_zeros(len(tokens)).index_add_(0, row, tok)


def token_log_probs(head: Head, model, hidden: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
    """(N, T) log p(tokens) at hidden (N, T, H) at the positions mask (N, T) scores, 0 elsewhere, with
    gradients: `log_probs` per position."""
    weight, bias = head.parts(model)
    h, target, valid = _scored_positions(head.hidden(hidden), tokens, mask)
    banned = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    tok = outputlayer.target_log_probs(h, weight, bias, target, banned)  # (M,)
    return tok.new_zeros(mask.numel()).index_copy(0, valid, tok).reshape(mask.shape)


def weighted_backward(head: Head, model, hidden: Tensor, tokens: Tensor, mask: Tensor, c, inputs: list,
                      collect: bool) -> tuple[Tensor, list]:
    """Phase two's chunk (see `twophase.protocol`, `weighted_score_backward`): loss = sum_i c_i log p_i over the
    positions mask (N, T) scores at hidden (N, T, H), and its gradients with respect to inputs; without collect
    they go into .grad. c may be a token-level objective (`twophase.phase2.tokenweights.ChunkLoss`)."""
    weight, bias = head.parts(model)
    h, target, valid = _scored_positions(head.hidden(hidden), tokens, mask)
    T = max(mask.shape[1], 1)
    row, col = valid // T, valid % T  # (M,) each
    # each position's d loss / d log p: its row's coefficient, in the precision log p is summed in
    w = tokenweights.weights(c, row, col, outputlayer.sum_dtype(weight))  # (M,)
    banned = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    tok, grads = outputlayer.backward_from_hidden(h, weight, bias, target, banned, w, inputs, collect)
    with torch.no_grad():
        if tokenweights.is_token_level(w):
            return tokenweights.weighted_sum(w, tok), grads
        return (w * tok).sum(), grads


def states(head: Head | None, model, hidden: Tensor) -> outputlayer.HeadStates:
    """The output layer and its inputs hidden (N, T, H), scaled as the head scales them, for another model's
    divergence from these distributions (`twophase.objectives.distill`)."""
    if head is None:
        raise ValueError(f"{type(model).__name__}'s output layer is not known (twophase.models.hf.heads): its "
                         "distributions cannot be read a block at a time")
    weight, bias = head.parts(model)
    banned = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)  # the wrappers ban nothing
    return outputlayer.HeadStates(head.hidden(hidden), weight, bias, banned)
