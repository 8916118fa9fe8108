"""Tiny Hugging Face models and an offline word-level tokenizer for tests (no download anywhere): random
weights from small configs, in float64 and evaluation mode (no dropout), and a tokenizer built with the
`tokenizers` library and wrapped as a transformers fast tokenizer. Reused by the CLI's `--hf-model` tests.

Special tokens: <pad> 0, </s> 1, <s> 2, <unk> 3; words from 4 on.
"""
from __future__ import annotations

import torch

SPECIALS = ["<pad>", "</s>", "<s>", "<unk>"]
WORDS = "a b c d e f g h".split()  # few: eos is likely enough that rows end
VOCAB = len(SPECIALS) + len(WORDS)  # 12
PAD, EOS, BOS = 0, 1, 2
SEQ2SEQ = ("t5", "bart", "marian")
CAUSAL = ("gpt2", "llama")


def tokenizer(padding_side: str = "right", append_eos: bool = False):
    """A PreTrainedTokenizerFast over SPECIALS + WORDS, splitting on whitespace; appends nothing, or with
    `append_eos` </s> to every encoding with special tokens (as T5's and Marian's tokenizers do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if append_eos:
        core.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>", padding_side=padding_side)


def seq2seq(kind: str, seed: int = 0, vocab: int = VOCAB, width: int = 16, layers: int = 1):
    """A random AutoModelForSeq2SeqLM: 't5' (starts with pad), 'bart' (starts with eos) or 'marian'."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, pad_token_id=PAD, eos_token_id=EOS)
    if kind == "t5":
        config = T.T5Config(d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=layers, num_heads=2,
                            dropout_rate=0.0, decoder_start_token_id=PAD, **common)
        model = T.T5ForConditionalGeneration(config)
    else:
        bart_like = dict(d_model=width, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width,
                         max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                         **common)
        if kind == "bart":
            model = T.BartForConditionalGeneration(T.BartConfig(bos_token_id=BOS, decoder_start_token_id=EOS,
                                                                forced_eos_token_id=None, **bart_like))
        else:
            model = T.MarianMTModel(T.MarianConfig(decoder_start_token_id=PAD, **bart_like))
    return _peaked(model)


def causal(kind: str, seed: int = 0, vocab: int = VOCAB, width: int = 16, layers: int = 2):
    """A random AutoModelForCausalLM: 'gpt2' (no pad token: eos pads) or 'llama' (rotary positions, grouped
    key/value heads)."""
    import transformers as T

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = T.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=2, n_positions=64,
                              bos_token_id=EOS, eos_token_id=EOS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = T.GPT2LMHeadModel(config)
    else:
        config = T.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                               num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None)
        model = T.LlamaForCausalLM(config)
    return _peaked(model)


def _peaked(model):
    """float64, evaluation mode, weights scaled up a little so that distributions are peaked and varied (tiny
    random models are nearly uniform, where every candidate ties)."""
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return model


def save(folder, kind: str, seed: int = 0) -> str:
    """A tiny model of `kind` (SEQ2SEQ or CAUSAL) and the word-level tokenizer (appending </s> for seq2seq, as T5's
    does) written to `folder` with save_pretrained: a folder for --hf-model."""
    model = seq2seq(kind, seed) if kind in SEQ2SEQ else causal(kind, seed)
    model.save_pretrained(folder)
    tokenizer(append_eos=kind in SEQ2SEQ).save_pretrained(folder)
    return str(folder)
