"""Weight gradients of a recurrence's per-step products, computed once for all steps after backward.

Autograd differentiates `x_t W^T` at every decoding step t into a weight-sized gradient of its own and adds
them up: per step, a product with a few rows of inner dimension and two weight-sized passes over memory. Phase
two's prefix tree decodes few nodes per depth, so those passes dominate its backward (measured: docs/results/).
`DeferredWeights.linear` computes only the input's gradient in backward and keeps
(g_t, x_t); `gradients()` then gives each weight's sum_t g_t^T x_t as one product over every step's rows.
Autograd itself never computes those weights' gradients, so a hook registered on them sees none.

Letters: n rows of a step, I input size, O output size, R rows of all steps together.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .fused import amp_backward, amp_forward
from .outputlayer import sum_dtype


class DeferredWeights:
    """Collects, per weight, the (incoming gradient, input) pairs of every `linear` backward went through."""

    def __init__(self):
        self._pairs: dict[int, tuple[Tensor, list, list]] = {}  # id(weight) -> (weight, [g (n, O)], [x (n, I)])

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear(x (n, I), weight (O, I), bias (O,)), the weight's gradient left to `gradients` (the input's
        and the bias's are autograd's, per step)."""
        return _DeferredLinear.apply(x, weight, bias, self)

    def record(self, weight: Tensor, g: Tensor, x: Tensor) -> None:
        entry = self._pairs.setdefault(id(weight), (weight, [], []))
        entry[1].append(g)
        entry[2].append(x)

    def gradients(self) -> list[tuple[Tensor, Tensor]]:
        """(weight, d loss / d weight) for each weight backward reached, in the weight's dtype; the pairs are
        dropped. The product runs outside autocast, in at least float32."""
        out = []
        for weight, gs, xs in self._pairs.values():
            acc = sum_dtype(weight)
            with torch.autocast(weight.device.type, enabled=False):
                g = torch.cat([x.to(acc) for x in gs])  # (R, O)
                x = torch.cat([x.to(acc) for x in xs])  # (R, I)
                out.append((weight, (g.t() @ x).to(weight.dtype)))  # (O, I)
        self._pairs.clear()
        return out


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, sink: DeferredWeights) -> Tensor:
        ctx.save_for_backward(x)
        # The weight (a parameter, alive anyway) is kept as itself: saved through saved_tensors_hooks (the meter
        # of system.memory) it would come back as another tensor object, and its gradient would go to that one.
        ctx.weight, ctx.sink = weight, sink
        return F.linear(x, weight, bias)  # under autocast, in its dtype, as nn.Linear and the LSTM cell run

    @staticmethod
    @amp_backward
    def backward(ctx, g: Tensor):
        (x,), weight = ctx.saved_tensors, ctx.weight
        if ctx.needs_input_grad[1]:
            ctx.sink.record(weight, g, x)
        dx = g @ weight if ctx.needs_input_grad[0] else None  # (n, I); autograd casts it to x's dtype
        db = g.sum(dim=0) if ctx.needs_input_grad[2] else None  # (O,)
        return dx, None, db, None
