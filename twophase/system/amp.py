"""`--amp`: automatic mixed precision for both phases, and the loss scaling fp16 needs.

Under `torch.autocast` the matmuls (LSTM gates, attention, output layer) run in bf16 or fp16 while the
parameters, their `.grad`, the optimizer state, the output layer's log-softmax / logsumexp and every sum of
log-probabilities stay in float32 (see `fused`). Phase one, phase two and the MLE steps all run under the same
autocast, so a candidate's search score and its teacher-forced log-probability are computed the same way.
Validation and `twophase-decode` run in full precision: reported scores are the checkpoint's own.

fp16 has too few exponent bits for small gradients, so it needs loss scaling, with `torch.amp.GradScaler`'s
semantics: phase two's surrogate sum_i c_i log p_i is linear in the coefficients, so scaling them scales the
loss; the gradients are unscaled before clipping, a step with inf/nan gradients is skipped and the scale backed
off (the trainer's own skip of non-finite steps), and the scale grows again after a run of good steps.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

MODES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_device(mode: str, device: torch.device) -> None:
    """Refuse an --amp the device cannot run; ValueError naming the flag."""
    if mode == "fp16" and device.type != "cuda":
        raise ValueError(f"--amp fp16 needs a CUDA device, not {device}; use --amp bf16 on CPU")
    if mode == "bf16" and device.type == "cuda" and not native_bf16(device):
        raise ValueError(f"--amp bf16: {torch.cuda.get_device_name(device)} has no native bfloat16 (only emulated, "
                         "slower than float32); use --amp fp16")


def native_bf16(device: torch.device) -> bool:
    """Whether the CUDA device computes in bfloat16 itself (compute capability 8.0 on, or ROCm's), not by
    emulation in float32 as a T4 or V100 does (what `is_bf16_supported()` also counts by default)."""
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def autocast(mode: str, device: torch.device):
    """The autocast context of --amp `mode` on `device` (a no-op for 'off')."""
    dtype = MODES[mode]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def grad_scaler(mode: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16; None otherwise (bf16 has float32's exponent range and needs no scaling)."""
    return torch.amp.GradScaler(device.type) if mode == "fp16" else None


def scale_coefficients(coefficients: Tensor, scaler) -> tuple[Tensor, float]:
    """(coefficients times the current scale, that scale): the gradient of sum_i c_i log p_i is linear in c, so
    scaling c is scaling the loss, before any of it is computed in fp16. Divide the returned loss by the scale."""
    if scaler is None or not scaler.is_enabled():
        return coefficients, 1.0
    return scaler.scale(coefficients), scaler.get_scale()


def unscale(scaler, optimizer, params: list) -> None:
    """Divide the gradients by the scale in place (recording whether any is inf/nan), before clipping."""
    if scaler is not None and params:  # GradScaler records nothing for an optimizer without gradients
        scaler.unscale_(optimizer)


def update(scaler, params: list) -> float | None:
    """After the step is taken or skipped: the scale the step ran with, then GradScaler.update (halve it after
    inf/nan gradients, double it after growth_interval good steps). None without a scaler."""
    if scaler is None:
        return None
    scale = scaler.get_scale()
    if params:
        scaler.update()
    return scale


def counts_as_bad(loss: float, scale: float | None) -> bool:
    """Whether a skipped (non-finite) step counts towards --max-bad-steps. With a scaler (scale: its value when
    the gradient overflowed), an inf/nan gradient under a finite loss is the scale being too large: it is backed
    off and the step retried on the next batch, as GradScaler does, without counting. Below a scale of 1 the
    gradient overflows on its own, and counts like any other."""
    return scale is None or not math.isfinite(loss) or scale < 1.0
