"""Hugging Face transformers models through the `twophase.SequenceModel` protocol (the optional `hf` extra:
`pip install twophase[hf]`): `HFSeq2Seq` wraps an `AutoModelForSeq2SeqLM`, `HFCausalLM` an
`AutoModelForCausalLM`. Importing this package imports transformers; nothing else in twophase does."""
from .causal import HFCausalLM
from .seq2seq import HFSeq2Seq

__all__ = ["HFSeq2Seq", "HFCausalLM"]
