"""`HFCausalLM`: a Hugging Face decoder-only model (`AutoModelForCausalLM`: GPT-2, Llama, ...) as a
`twophase.SequenceModel`; the prompt is the source, the completion the candidate row.

The source is a tokenizer's output, {"input_ids", "attention_mask"} of (B, P) tensors, left- or right-padded.
Positions come from the mask as `generate` makes them (cumsum(mask) - 1), so a prompt's completions score the
same whichever side it was padded on. `encode` runs the prompts once and keeps their key/value cache, their
mask and what predicts the first completion token at each prompt's last real token: the base model's state
there where the output layer is known (`heads.find`), so that phase two puts that position through the output
layer a block of logits at a time like every other, else the model's logits. The prompt's last token is
therefore read once, by `encode`, and never fed again: the first `step` ignores prev (bos_id) and returns
those logits' log-softmax; later steps feed one token with the cache. The rows' cache holds their
completions only: each layer attends over its source's prompt keys and values in `enc`, kept once per source
(`grouped.prefixed`), where the model's attention allows it (checked at wrap time; else the first step copies
the prompts' cache to every row).

Phase two runs `encode` with gradients: every chunk's rows index the B prompts' cache by owner (a (C, heads, P,
head_dim) copy per layer and chunk), the library cuts that cache out of the graph at the chunk boundary, and the
prompts are back-propagated once after the last chunk. The prompts cost O(B P) tokens of forward and backward,
not O(B K P) as re-running prompt + completion per row does; by default their activations are recomputed for
that backward rather than held through all chunks (`recompute_source`). Where the output layer is known
(`heads.find`: GPT-2, Llama), a chunk's forward stops at the base model's hidden states and the output layer is
applied a block of logits at a time, never holding the chunk's (C, T, V) logits.

Letters: B prompts, P prompt length, N rows (C in a chunk), T completion length, V vocabulary.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from ... import nested
from ...protocol import eval_mode, target_mask
from . import cache, grouped, heads, lora, precision
from .common import freeze_unsaved, log_softmax, masked_sum, source_forward, special_id, token_log_probs


class HFCausalLM(heads.FastPath, torch.nn.Module):
    """`model`: an `AutoModelForCausalLM` instance; `tokenizer` (optional) supplies pad and eos where it sets
    them. Without a pad token (GPT-2), pad_id = eos_id: a row ends at its first eos_id. bos_id is the config's
    bos_token_id (eos_id when it has none): the first step's prev, which is ignored, and a token search never
    proposes (unless it is eos_id). `recompute_source`: phase two keeps no activations of the prompts' forward
    and runs it again in the backward (`common.source_forward`).

    `head`: the model's output layer (`heads.Head`) where its class is known and checked at wrap time, else
    None: phase two then goes through the model's full logits (set it to None to force that)."""

    def __init__(self, model, tokenizer=None, recompute_source: bool = True):
        super().__init__()
        model, adapter = lora.unwrap(model)  # a LoRA PeftModel: the transformers model it adapts, called directly
        self.model = model
        # what its save_pretrained drops is not trained (every export is the trained model), and is no base a
        # checkpoint needs: from_pretrained rebuilds it from the config (resume.fingerprint leaves it out)
        self.rebuilt_on_load = frozenset("model." + n for n in freeze_unsaved(model))
        self.training = model.training  # the wrapper's mode is the model's (nn.Module's default is True)
        precision.keep_float64_norms(model)  # a float64 model's norms in float64, not transformers' float32
        object.__setattr__(self, "adapter", adapter)  # not a submodule: its parameters are self.model's
        self.recompute_source = recompute_source
        ids = {name: getattr(tokenizer, name, None) for name in ("pad_token_id", "eos_token_id")}
        self.eos_id = ids["eos_token_id"] if ids["eos_token_id"] is not None else special_id(model, "eos_token_id")
        pad = ids["pad_token_id"] if ids["pad_token_id"] is not None else special_id(model, "pad_token_id",
                                                                                     required=False)
        self.pad_id = self.eos_id if pad is None else int(pad)
        bos = special_id(model, "bos_token_id", required=False)
        self.bos_id = self.eos_id if bos is None else bos
        params = inspect.signature(model.forward).parameters
        self._caches = cache.Caches(model)
        self._keep_kw = "logits_to_keep" in params
        self.head = self._checked_head()
        self._folding = grouped.checked(self, self._caches)  # None: the rows copy the prompts' cache
        self.head_note = lora.head_note(model, adapter)  # why a PeftModel's head falls back, or None

    def encode(self, source: dict) -> dict:
        """The prompts' cache (one (B, heads, P, head_dim) pair per layer), mask (B, P), first completion
        position (B,) and, at the last real token, the base model's state (B, H) ("state") where the head is
        known, else the next-token logits (B, V) ("last")."""
        ids, mask = source["input_ids"], source["attention_mask"]
        real = mask.long().sum(dim=1)  # (B,)
        if bool((real == 0).any()):
            raise ValueError("HFCausalLM: a prompt has no token (attention_mask all zero); a causal model needs at "
                             "least one to predict the completion from (e.g. the bos token)")
        kv, last = source_forward(self._prompt, self.recompute_source, ids, mask)
        return {"kv": kv, "mask": mask, "next": real, ("last" if self.head is None else "state"): last}

    def _prompt(self, ids: Tensor, mask: Tensor):
        """The prompts' cache pairs and, at each one's last real token, the base model's state (B, H) where the
        head is known, else the logits (B, V)."""
        P = ids.shape[1]
        last = P - 1 - mask.long().flip(1).argmax(dim=1)  # (B,) each prompt's last real position
        rows = torch.arange(len(ids), device=ids.device)
        if self.head is not None:
            out = self.model.base_model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask),
                                        use_cache=True)
            return self._caches.layers(out), out.last_hidden_state[rows, last]
        extra = {"use_cache": True}
        keep = None
        if self._keep_kw:  # the LM head on those positions only, not on (B, P, V)
            keep = torch.unique(last)  # (U,) sorted
            extra["logits_to_keep"] = keep
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), **extra)
        at = last if keep is None else torch.searchsorted(keep, last)  # (B,) into out.logits' positions
        return self._caches.layers(out), out.logits[rows, at]

    def init_state(self, enc: dict, owner: Tensor) -> dict:
        return {"kv": (), "length": None, "fed": None}  # fed None: the first step reads the prompts' logits

    def step(self, enc: dict, owner: Tensor, prev: Tensor, state: dict):
        """Without a graph the rows' cache is kept in buffers with room (`growing`): "length" is how much of
        them is filled; with one (one-phase), in tensors that each step's forward concatenates onto. Where the
        model's attention folds (`grouped.checked`) the rows' cache holds their completions only and each
        layer reads the prompts' keys and values from `enc` ("shared"); otherwise the first step copies the
        prompts' cache to every row."""
        fed = state.pop("fed")
        if fed is None:  # prev is bos_id: the prompt's last token was fed by encode
            shared = self._folding is not None
            P = 0 if shared else enc["mask"].shape[1]  # cached positions of a row
            kv = () if shared else nested.select_rows(enc["kv"], owner)  # (N, heads, P, head_dim) per layer
            length = P if self._caches.buffered() else None
            return {"kv": kv, "length": length, "fed": 0, "shared": shared}, log_softmax(self._first_logits(enc, owner))
        length, shared = state.pop("length"), state.pop("shared")
        kv = list(state.pop("kv"))  # consumed
        if shared:
            out = self._continue_shared(enc, owner, prev[:, None], fed, kv, length)
        else:
            out = self._continue(enc, owner, prev[:, None], fed, self.model, kv, length)
        logp = log_softmax(out.logits[:, -1])  # (N, V)
        if length is None:
            kv = self._caches.layers(out)
        else:
            kv, length = self._caches.buffers(out)
        return {"kv": kv, "length": length, "fed": fed + 1, "shared": shared}, logp

    def score(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N,) teacher-forced log p(tokens | prompt): the first token from the prompts' last position, the rest
        from one forward of tokens[:, :-1] on the rows' copy of the prompts' cache."""
        mask = target_mask(tokens, self.pad_id, self.eos_id)
        if self.head is not None:
            return heads.log_probs(self.head, self.model, self._states(enc, tokens, owner), tokens, mask)
        total = self._first(enc, tokens, owner, mask)  # (N,)
        if tokens.shape[1] == 1:
            return total
        rest = self._continue(enc, owner, tokens[:, :-1], 0, self.model).logits  # (N, T - 1, V)
        return total + masked_sum(token_log_probs(rest, tokens[:, 1:]), mask[:, 1:])

    def token_scores(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N, T) the per-token log-probabilities `score` sums, 0 past each row's end."""
        mask = target_mask(tokens, self.pad_id, self.eos_id)
        if self.head is not None:
            return heads.token_log_probs(self.head, self.model, self._states(enc, tokens, owner), tokens, mask)
        first = self._first(enc, tokens, owner, mask)[:, None]  # (N, 1)
        if tokens.shape[1] == 1:
            return first
        rest = token_log_probs(self._continue(enc, owner, tokens[:, :-1], 0, self.model).logits, tokens[:, 1:])
        rest = torch.where(mask[:, 1:], rest, torch.zeros_like(rest))  # (N, T - 1)
        return torch.cat([first, rest], dim=1)

    def _weighted_score_backward(self, enc: dict, tokens: Tensor, owner: Tensor, c: Tensor, inputs: list,
                                 collect: bool):
        mask = target_mask(tokens, self.pad_id, self.eos_id)
        return heads.weighted_backward(self.head, self.model, self._states(enc, tokens, owner), tokens, mask, c,
                                       inputs, collect)

    def head_states(self, enc: dict, tokens: Tensor, owner: Tensor):
        """The output layer and its inputs at every position of rows tokens (N, T) (`outputlayer.HeadStates`)."""
        return heads.states(self.head, self.model, self._states(enc, tokens, owner))

    def _states(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N, T, H) the base model's states that predict tokens (N, T): column 0 the prompt's last, the rest
        from one forward of tokens[:, :-1] on the rows' copy of the prompts' cache (the head is known)."""
        first = enc["state"].index_select(0, owner)[:, None]  # (N, 1, H)
        if tokens.shape[1] == 1:
            return first
        rest = self._continue(enc, owner, tokens[:, :-1], 0, self.model.base_model).last_hidden_state
        return torch.cat([first.to(rest.dtype), rest], dim=1)  # (N, T, H)

    def _first_logits(self, enc: dict, owner: Tensor) -> Tensor:
        """(N, V) the logits of each row's first completion token."""
        if self.head is None:
            return enc["last"].index_select(0, owner)
        return self.head.logits(self.model, enc["state"]).index_select(0, owner)  # (B, V) logits, then per row

    def _first(self, enc: dict, tokens: Tensor, owner: Tensor, mask: Tensor) -> Tensor:
        """(N,) log p of each row's first token, from the prompts' last logits (0 where the row scores none)."""
        tok = token_log_probs(self._first_logits(enc, owner)[:, None], tokens[:, :1])  # (N, 1)
        return masked_sum(tok, mask[:, :1])

    def _continue(self, enc: dict, owner: Tensor, inputs: Tensor, fed: int, module, kv: list | None = None,
                  length: int | None = None):
        """module's forward (the model, or its base model for the hidden states) of `inputs` (N, L), the
        completion's tokens fed..fed+L-1, after rows whose cache kv holds their prompt and `fed` completion
        tokens (kv is emptied: see `cache.Caches.argument`; `length`: kv are buffers filled that far); kv None:
        the rows' copy of the prompts' cache."""
        N, L = inputs.shape
        if kv is None:
            kv = list(nested.select_rows(enc["kv"], owner))
        mask = enc["mask"].index_select(0, owner)  # (N, P)
        mask = torch.cat([mask, mask.new_ones(N, fed + L)], dim=1)  # (N, P + fed + L)
        steps = torch.arange(fed, fed + L, device=inputs.device)
        positions = enc["next"].index_select(0, owner)[:, None] + steps  # (N, L)
        return module(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=True,
                      **self._caches.argument(kv, length=length))

    def _continue_shared(self, enc: dict, owner: Tensor, inputs: Tensor, fed: int, kv: list,
                         length: int | None):
        """The model's forward of `inputs` (N, L) after rows whose cache kv holds their `fed` completion tokens
        only, every layer attending over its source's prompt in enc first (`grouped.prefixed`): once per source
        where the rows are K per source in order, else gathered per row."""
        prompt, mask = enc["kv"], enc["mask"]  # (B, heads, P, head_dim) per layer, (B, P)
        if not grouped.blocked(owner, mask.shape[0]):
            prompt, mask = nested.select_rows(prompt, owner), mask.index_select(0, owner)
        steps = torch.arange(fed, fed + inputs.shape[1], device=inputs.device)
        positions = enc["next"].index_select(0, owner)[:, None] + steps  # (N, L)
        with self._folding(prefix=prompt, prefix_mask=mask):
            return self.model(input_ids=inputs, position_ids=positions, use_cache=True,
                              **self._caches.argument(kv, length=length))

    def _checked_head(self):
        """`heads.find`'s head if it maps the base model's states to the model's own logits on two tokens."""
        found = heads.find(self.model)
        if found is None or self.model.base_model is self.model:
            return None
        ids = torch.tensor([[self.bos_id, self.eos_id]], device=self.model.device)
        with torch.no_grad(), eval_mode(self.model):
            logits = self.model(input_ids=ids, use_cache=False).logits  # (1, 2, V)
            hidden = self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state  # (1, 2, H)
        return found if found.agrees(self.model, hidden, logits) else None


def _positions(mask: Tensor) -> Tensor:
    """(B, P) each token's position among its prompt's real tokens; padding gets 0 (it is masked anyway)."""
    return (mask.long().cumsum(dim=1) - 1).clamp_min(0)
