"""What a checkpoint holds of a model: every entry of its state_dict, or, where some parameters are frozen
(LoRA adapters on a `--hf-model`, `--lora-r`), only the trainable parameters: the frozen rest is the
--hf-model folder's, which the task loads again, and a checkpoint stays the adapters' size."""
from __future__ import annotations

import torch


def saved_state(model: torch.nn.Module) -> dict:
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = model.state_dict()
    if len(trainable) == sum(1 for _ in model.parameters()):
        return state
    return {k: v for k, v in state.items() if k in trainable}


def load_saved(model: torch.nn.Module, state: dict) -> None:
    """model.load_state_dict(state), strict about every trainable parameter; a checkpoint of trainable parameters
    alone leaves the frozen ones (and buffers) as the model was built. RuntimeError as load_state_dict's."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(model.state_dict()) == set(state) or not trainable:
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    lost = sorted(trainable & set(missing))
    if lost or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict: missing trainable {lost[:3]}, unexpected "
                           f"{sorted(unexpected)[:3]}")
