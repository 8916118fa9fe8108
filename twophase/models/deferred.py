"""Weight gradients of a recurrence's per-step products, computed once for all steps after backward.

Autograd differentiates `x_t W^T` at every decoding step t into a weight-sized gradient of its own and adds
them up: per step, a product with a few rows of inner dimension and two weight-sized passes over memory. Phase
two's prefix tree decodes few nodes per depth, so those passes dominate its backward (measured: docs/results/).
(Phase two does the same for a model of your own, through its `step`: `phase2.deferral`, without
autocast; this is the built-in LSTM's, under autocast too.) `DeferredWeights.linear` computes only the input's
gradient in backward and keeps (g_t, x_t); `gradients()` then gives each weight's sum_t g_t^T x_t as one product
over every step's rows.
Autograd itself never computes those weights' gradients, so a hook registered on them sees none.

Letters: n rows of a step, I input size, O output size, R rows of all steps together.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..phase2 import deferral
from .fused import amp_backward, amp_forward


class DeferredWeights:
    """Collects, per weight, the (incoming gradient, input) pairs of every `linear` backward went through (in
    phase two's sink, `phase2.deferral.WeightGradients`, which sums them)."""

    def __init__(self):
        self.sink = deferral.WeightGradients()

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear(x (n, I), weight (O, I), bias (O,)), the weight's gradient left to `gradients` (the input's
        and the bias's are autograd's, per step)."""
        return _DeferredLinear.apply(x, weight, bias, self.sink)

    def gradients(self) -> list[tuple[Tensor, Tensor]]:
        """(weight, d loss / d weight) for each weight backward reached, in the weight's dtype; the pairs are
        dropped. The product runs outside autocast, in at least float32."""
        return list(self.sink.gradients())


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    @amp_forward
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, sink: deferral.WeightGradients) -> Tensor:
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
