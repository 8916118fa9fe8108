"""LoRA adapters (peft) on the wrapped models: `attach` (what `--lora-r` does) and `unwrap`, through which both
wrappers accept a `peft.PeftModel`.

A LoRA `PeftModel` runs the very forward of the transformers model it wraps (`base_model.model`, whose layers
peft replaced by adapted ones), so the wrappers call that model directly: its class is the transformers class,
and the output layer from the hidden states (`heads`) stays available unless the adapters are on lm_head
itself (then lm_head is no plain `nn.Linear`: the full logits, said in `head_note`). The PeftModel stays
reachable as the wrapper's `adapter` (not a submodule: the parameters would be listed twice) to save the
adapters. Prompt-learning PeftModels (prefix or prompt tuning) change the forward's inputs: they are kept whole.
"""
from __future__ import annotations

import sys

import torch


def unwrap(model):
    """(the module to call, the PeftModel or None) for a transformers model or a LoRA-style PeftModel."""
    peft = sys.modules.get("peft")  # a PeftModel exists only where peft was imported
    if peft is None or not isinstance(model, peft.PeftModel):
        return model, None
    if model.active_peft_config.is_prompt_learning:
        return model, None
    return model.base_model.model, model


def head_note(model, adapter) -> str | None:
    """One line where adapters sit on the output layer itself, which keeps phase two on the full logits."""
    if adapter is None:
        return None
    lm = model.get_output_embeddings()
    if lm is None or type(lm) is torch.nn.Linear:
        return None
    return (f"LoRA on the output layer ({type(lm).__name__}): phase two computes each chunk's full (C, T, V) logits "
            "(the output layer from the hidden states needs a plain lm_head; adapt other modules to keep it)")


def attach(model, r: int, alpha: float, dropout: float, targets: list[str] | None, seq2seq: bool):
    """model wrapped by peft.get_peft_model with a LoraConfig: rank r, alpha (0: 2 r), dropout, target modules
    (None: peft's default for the model type); every other parameter frozen."""
    import warnings

    import peft

    config = peft.LoraConfig(r=r, lora_alpha=alpha or 2 * r, lora_dropout=dropout, target_modules=targets,
                             task_type="SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM")
    with warnings.catch_warnings():  # peft's notes on GPT-2's Conv1D layout and transformers' renamed properties
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def save(adapter, folder, merge: bool):
    """save_pretrained of the adapters alone (peft's adapter folder), or with merge a copy of the model with the
    adapters merged into its weights (a plain transformers folder); the trained model is left as it is. The
    merged copy is made in host memory: its tensors are copied to the CPU one by one, never a second model on
    the device. Returns the module written (the adapter, or the merged copy)."""
    if merge:
        merged = on_host(adapter).merge_and_unload()
        merged.save_pretrained(folder)
        return merged
    adapter.save_pretrained(folder)
    return adapter


def on_host(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` whose parameters and buffers are CPU copies of its own (copied one at a time)."""
    import copy

    memo = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(module, memo)


def adds_nothing(adapter) -> bool:
    """Whether the LoRA adapters add exactly nothing to the model's outputs, as peft initialises them: every B
    matrix zero (B A x = 0), no DoRA, no trained bias, nothing but A and B trainable. The model then equals its
    base, which `base_only` scores (the reference of --objective policy at the first RL step: `train.reference`)."""
    config = adapter.active_peft_config
    if getattr(config, "peft_type", None) != "LORA" or getattr(config, "use_dora", False) \
            or getattr(config, "bias", "none") != "none":  # PeftType is a str enum
        return False
    for name, p in adapter.named_parameters():
        if not p.requires_grad:
            continue
        if ".lora_B." in name or ".lora_embedding_B." in name:
            if bool(p.any()):
                return False
        elif ".lora_A." not in name and ".lora_embedding_A." not in name:
            return False
    return True


def base_only(adapter):
    """peft's `disable_adapter()` context: the model it adapts runs as its base (no adapter in any layer); the
    adapters are enabled again (and trainable) on exit."""
    return adapter.disable_adapter()
