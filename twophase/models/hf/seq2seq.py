"""`HFSeq2Seq`: a Hugging Face encoder-decoder (`AutoModelForSeq2SeqLM`: T5, BART, Marian, ...) as a
`twophase.SequenceModel`.

The source is a tokenizer's output, {"input_ids", "attention_mask"} of (B, S) tensors. The encoder runs once per
batch of sources; candidate rows read its output through `owner`. Search steps feed one token per row with the
decoder's self-attention cache kept in the state as tuples of tensors (`cache`), so the library's row selection
reorders them as `generate` reorders its cache. The cross-attention keys and values are made from the B sources'
encoder output and kept once per source (`PerSource`), not copied to each row: each layer folds the rows into
their source's queries (`grouped`), where the model's attention allows it (checked at wrap time). `score`
decodes a chunk of rows in one teacher-forced forward without a cache: it copies the encoder output once per
chunk, (C, S, H), and the decoder computes the chunk's cross-attention keys and values from it. Where the output
layer is known (`heads.find`: T5, BART, Marian), `score` and `weighted_score_backward` stop at the decoder's
hidden states and apply it a block of logits at a time, never holding the chunk's (C, T, V) logits.

Letters: B sources, S source length, H model width, N rows (C in a chunk), T target length, V vocabulary.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ... import nested
from ...protocol import eval_mode, target_mask, teacher_forced_inputs
from . import cache, grouped, heads, lora, precision
from .common import freeze_unsaved, log_softmax, masked_sum, source_forward, special_id, token_log_probs


class HFSeq2Seq(heads.FastPath, torch.nn.Module):
    """`model`: an `AutoModelForSeq2SeqLM` instance. Ids come from its config (the generation config where the
    config lacks them): the protocol's bos_id is the decoder start token (pad for T5 and Marian, eos for BART),
    which search never proposes unless it is eos_id. `recompute_source`: phase two keeps no activations of the
    encoder and runs it again in the backward (`common.source_forward`).

    `head`: the model's output layer (`heads.Head`) where its class is known and checked at wrap time, else
    None: phase two then goes through the model's full logits (set it to None to force that)."""

    def __init__(self, model, recompute_source: bool = True):
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
        self.pad_id = special_id(model, "pad_token_id")
        self.eos_id = special_id(model, "eos_token_id")
        self.bos_id = special_id(model, "decoder_start_token_id")
        self._caches = cache.Caches(model)
        self.head = self._checked_head()
        self._folding = grouped.checked(self, self._caches)  # None: this model's attention cannot fold rows
        self.head_note = lora.head_note(model, adapter)  # why a PeftModel's head falls back, or None

    def encode(self, source: dict) -> dict:
        mask = source["attention_mask"]
        hidden = source_forward(self._encoder, self.recompute_source, source["input_ids"], mask)
        return {"hidden": hidden, "mask": mask}  # (B, S, H), (B, S)

    def _encoder(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state

    def init_state(self, enc: dict, owner: Tensor) -> dict:
        """Nothing decoded yet: the first step fills both caches. Without a graph the self-attention cache is
        kept in buffers with room (`growing`), "length" of them filled; with one (one-phase), in tensors."""
        return {"self": (), "cross": (), "length": 0 if self._caches.buffered() else None}

    def step(self, enc: dict, owner: Tensor, prev: Tensor, state: dict):
        """One token per row. Where the rows are K per source in order (`grouped.blocked`: every full step of
        both searches) the cross-attention keys and values are made and kept once per source (`PerSource`,
        which row selection leaves alone: rows never change source) and each layer folds the rows into its
        source's queries; otherwise they are read per row."""
        length, cross = state.pop("length"), state.pop("cross")
        folded = self._folding is not None and grouped.blocked(owner, enc["hidden"].shape[0]) > 0
        if isinstance(cross, PerSource):  # made per source at the first step: gathered per row where not folded
            pairs = cross.pairs if folded else nested.select_rows(cross.pairs, owner)
        else:  # per row, or nothing yet: a first step that folds makes the cache per source
            pairs, folded = cross, folded and not cross
        past = self._caches.argument(list(state.pop("self")), list(pairs), length)  # state consumed
        with self._folding() if folded else contextlib.nullcontext():
            out = self._forward(enc, None if folded else owner, prev[:, None], {**past, "use_cache": True})
        self_pairs, cross_pairs = self._caches.layers2(out)
        if length is not None:
            self_pairs, length = self._caches.buffers(out, encoder_decoder=True)
        if isinstance(cross, PerSource):
            cross_pairs = cross  # the forward's were the per-source pairs or this step's per-row gather
        elif folded:
            cross_pairs = PerSource(cross_pairs)
        return {"self": self_pairs, "cross": cross_pairs, "length": length}, log_softmax(out.logits[:, -1])

    def score(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N,) teacher-forced log p(tokens | source): one decoder forward over the whole rows."""
        inputs = teacher_forced_inputs(tokens, self.bos_id)  # (N, T)
        mask = target_mask(tokens, self.pad_id, self.eos_id)
        if self.head is not None:
            return heads.log_probs(self.head, self.model, self._decoder(enc, owner, inputs), tokens, mask)
        logits = self._forward(enc, owner, inputs, {"use_cache": False}).logits  # (N, T, V)
        return masked_sum(token_log_probs(logits, tokens), mask)

    def token_scores(self, enc: dict, tokens: Tensor, owner: Tensor) -> Tensor:
        """(N, T) the per-token log-probabilities `score` sums, 0 past each row's end."""
        inputs = teacher_forced_inputs(tokens, self.bos_id)  # (N, T)
        mask = target_mask(tokens, self.pad_id, self.eos_id)
        if self.head is not None:
            return heads.token_log_probs(self.head, self.model, self._decoder(enc, owner, inputs), tokens, mask)
        logits = self._forward(enc, owner, inputs, {"use_cache": False}).logits  # (N, T, V)
        tok = token_log_probs(logits, tokens)
        return torch.where(mask, tok, torch.zeros_like(tok))

    def _weighted_score_backward(self, enc: dict, tokens: Tensor, owner: Tensor, c: Tensor, inputs: list,
                                 collect: bool):
        hidden = self._decoder(enc, owner, teacher_forced_inputs(tokens, self.bos_id))  # (N, T, H)
        mask = target_mask(tokens, self.pad_id, self.eos_id)
        return heads.weighted_backward(self.head, self.model, hidden, tokens, mask, c, inputs, collect)

    def head_states(self, enc: dict, tokens: Tensor, owner: Tensor):
        """The output layer and its inputs at every position of rows tokens (N, T) (`outputlayer.HeadStates`)."""
        return heads.states(self.head, self.model, self._decoder(enc, owner, teacher_forced_inputs(tokens, self.bos_id)))

    def _decoder(self, enc: dict, owner: Tensor, decoder_input_ids: Tensor) -> Tensor:
        """(N, T, H) the decoder's last hidden states, the input of the model's output layer, for N rows."""
        return self.model.get_decoder()(
            input_ids=decoder_input_ids, encoder_hidden_states=enc["hidden"].index_select(0, owner),
            encoder_attention_mask=enc["mask"].index_select(0, owner), use_cache=False).last_hidden_state

    def _checked_head(self):
        """`heads.find`'s head if it maps the decoder's states to the model's own logits on a two-token row."""
        found = heads.find(self.model)
        if found is None:
            return None
        device = self.model.device
        src = torch.tensor([[self.eos_id]], device=device)
        inputs = torch.tensor([[self.bos_id, self.eos_id]], device=device)
        with torch.no_grad(), eval_mode(self.model):
            logits = self.model(input_ids=src, decoder_input_ids=inputs, use_cache=False).logits  # (1, 2, V)
            enc = {"hidden": self._encoder(src, torch.ones_like(src)), "mask": torch.ones_like(src)}
            hidden = self._decoder(enc, torch.zeros(1, dtype=torch.long, device=device), inputs)
        return found if found.agrees(self.model, hidden, logits) else None

    def _forward(self, enc: dict, owner: Tensor | None, decoder_input_ids: Tensor, extra: dict):
        """The decoder and output layer for N rows, reading the encoder output of each row's source (owner) or,
        owner None, of the B sources themselves (folded attention). Attention layers whose cross-attention keys
        and values are cached never read the encoder output, but the model checks it is given."""
        from transformers.modeling_outputs import BaseModelOutput
        hidden, mask = enc["hidden"], enc["mask"]  # (B, S, H), (B, S)
        if owner is not None:
            hidden, mask = hidden.index_select(0, owner), mask.index_select(0, owner)  # (N, S, H), (N, S)
        return self.model(encoder_outputs=BaseModelOutput(last_hidden_state=hidden), attention_mask=mask,
                          decoder_input_ids=decoder_input_ids, **extra)


class PerSource:
    """The cross-attention cache, one (keys, values) pair of (B, heads, S, head_dim) per layer, kept once per
    source in a search state. Not a tree node (`twophase.nested`), so row selection carries it as it is."""

    def __init__(self, pairs: tuple):
        self.pairs = pairs
