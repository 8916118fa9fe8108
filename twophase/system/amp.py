"""`--amp`: automatic mixed precision for both phases, and the loss scaling fp16 needs.

Under `torch.autocast` the matmuls (LSTM gates, attention, output layer) run in bf16 or fp16 while the
parameters, their `.grad`, the optimizer state, the output layer's log-softmax / logsumexp and every sum of
log-probabilities stay in float32 (see `fused`). Phase one, phase two and the MLE steps all run under the same
autocast, so a candidate's search score and its teacher-forced log-probability are computed the same way.
Validation and `twophase-decode` run in full precision: reported scores are the checkpoint's own.

A recurrent layer (`nn.LSTM`, `nn.GRU`, ...: one fused kernel over the sequence) runs in float32 under --amp
bf16 where its library has no bfloat16 kernel for it, found by trying one tiny layer once per device
(`rnns_in_float32`): on a CPU whose oneDNN lacks a bf16 LSTM primitive (one without AVX-512, e.g. an AVX2-only
EPYC), and on a GPU whose cuDNN RNN autocast path computes in float16 whatever the autocast dtype (float16
without a loss scale is what bf16 must not become). Its inputs are cast to float32 and autocast is off inside
it; everything around it (the attention, the decoder cell's matmuls, the output layer) stays in bf16.

fp16 has too few exponent bits for small gradients, so it needs loss scaling, with `torch.amp.GradScaler`'s
semantics: phase two's surrogate sum_i c_i log p_i is linear in the coefficients, so scaling them scales the
loss; the gradients are unscaled before clipping, a step with inf/nan gradients is skipped and the scale backed
off (the trainer's own skip of non-finite steps), and the scale grows again after a run of good steps.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

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
    """The autocast context of --amp `mode` on `device` (a no-op for 'off'), recurrent layers in float32 where
    `rnns_in_float32`."""
    dtype = MODES[mode]
    if dtype is None:
        return contextlib.nullcontext()
    if rnns_in_float32(mode, device):
        return _float32_rnns(device.type, dtype)
    return torch.autocast(device.type, dtype=dtype)


def rnns_in_float32(mode: str, device: torch.device) -> bool:
    """Whether --amp `mode` runs recurrent layers in float32 on `device`: under bf16, where a tiny LSTM under
    autocast raises (no bf16 kernel: oneDNN on a CPU without AVX-512) or computes in float16 (cuDNN's RNN
    autocast path). Tried once per device."""
    return mode == "bf16" and _rnn_without_bf16(str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _rnn_without_bf16(device: str) -> bool:
    layer = nn.LSTM(4, 4, batch_first=True).to(device)
    x = torch.zeros(1, 3, 4, device=device)  # one row: the unpacked path, where oneDNN's primitive is refused
    try:
        with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            out, _ = layer(x)
    except RuntimeError:
        return True
    return out.dtype == torch.float16


def _as_float32(x):
    """Floating tensors of a recurrent layer's arguments in float32 (hx's tuples, packed sequences too); a
    float64 model's are left as they are."""
    if isinstance(x, PackedSequence):
        return x._replace(data=_as_float32(x.data))
    if isinstance(x, (tuple, list)):
        return type(x)(_as_float32(y) for y in x)
    if isinstance(x, Tensor) and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


@contextlib.contextmanager
def _float32_rnns(device_type: str, dtype: torch.dtype):
    """torch.autocast(device_type, dtype) for the block, but every nn.RNNBase's forward in float32 with autocast
    off (global module hooks, removed after; the post-hook runs even where the forward raises)."""
    inner = []

    def before(module, args):
        if not isinstance(module, nn.RNNBase):
            return None
        off = torch.autocast(device_type, enabled=False)
        off.__enter__()
        inner.append(off)
        return _as_float32(args)

    def after(module, args, output):
        if isinstance(module, nn.RNNBase) and inner:
            inner.pop().__exit__(None, None, None)

    with torch.autocast(device_type, dtype=dtype):
        hooks = (nn.modules.module.register_module_forward_pre_hook(before),
                 nn.modules.module.register_module_forward_hook(after, always_call=True))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


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
