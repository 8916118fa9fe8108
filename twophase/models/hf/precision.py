"""A float64 model computed in float64: the RMS norms that transformers runs in float32 whatever the model's dtype.

T5's `T5LayerNorm` and Llama's `LlamaRMSNorm` (and the families that copy it: Mistral, Qwen, ...) compute
    y = weight * (x * rsqrt(mean(x ** 2) + eps))
after `x.to(torch.float32)`: meant to raise a 16-bit model's precision, it lowers a float64 model's. Its
backward then rounds every gradient that passes through a norm to float32, so two float64 computations of one
gradient (phase two's chunks, a plain autograd of the whole batch) differ by about 1e-8 relative instead of
1e-15, and float64 can no longer show that the chunked gradient is exact.

`keep_float64_norms(model)` gives each such module a forward hook that, where its input and weight are both
float64, replaces the output by the same formula computed in float64 (any other dtype keeps the module's own
output, bit for bit). A module is hooked only if, on a probe input, its own output equals the formula to float32
rounding, so a norm of another shape (Gemma's 1 + weight, a mean-centred LayerNorm) is left alone. A hook (not
a replaced forward) survives `copy.deepcopy` and pickling, and leaves the model's state_dict unchanged.

Letters: H the normalised width.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

_NAMES = ("RMSNorm", "T5LayerNorm")  # class names end so: the transformers norms of the formula above


def keep_float64_norms(model: nn.Module) -> int:
    """Hook every RMS norm of `model` that computes in float32 (see the module docstring); returns how many were
    hooked (a second call hooks none again)."""
    hooked = 0
    for module in model.modules():
        if _candidate(module) and _matches(module):
            module.register_forward_hook(_float64_output)
            hooked += 1
    return hooked


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith(_NAMES) and isinstance(weight, Tensor) and weight.dim() == 1
            and isinstance(_eps(module), float) and _float64_output not in module._forward_hooks.values())


def _eps(module: nn.Module):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _formula(weight: Tensor, eps: float, x: Tensor) -> Tensor:
    """weight (H,) * x (..., H) / rms(x), in x's and weight's dtype."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _matches(module: nn.Module) -> bool:
    """Whether the module's own output is the formula's, to float32 rounding, on a probe (2, H) input."""
    weight = module.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, weight.shape[0], generator=g, dtype=torch.float64).to(weight.device)  # (2, H)
    with torch.no_grad():
        try:
            theirs = module(x.to(weight.dtype)).double()
        except Exception:  # a norm with another signature: not ours to change
            return False
        ours = _formula(weight.double(), _eps(module), x)
    tol = max(1e-5, 8 * torch.finfo(weight.dtype).eps)
    return theirs.shape == ours.shape and bool(torch.allclose(theirs, ours, rtol=tol, atol=tol))


def _float64_output(module: nn.Module, args: tuple, output):
    """The forward hook: the formula in float64 where input and weight are float64, else the module's own."""
    x = args[0] if args else None
    if not (isinstance(x, Tensor) and x.dtype == torch.float64 and module.weight.dtype == torch.float64
            and isinstance(output, Tensor)):
        return None
    return _formula(module.weight, _eps(module), x)
