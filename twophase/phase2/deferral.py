"""Phase two through a model's own `step`: the weight gradients of its per-step products, summed once per chunk.

Autograd differentiates each step's `F.linear(x_t, W)` into a weight-sized gradient of its own and adds them up,
and each step's `F.embedding(ids_t, E)` into a dense (V, E) gradient, zeroed and then added: per step, two or
three weight-sized passes over memory whatever the step's rows. A chunk of C rows decodes T steps, so a smaller
chunk makes more of these passes for the same rows, and with a V-sized output layer and embedding they weigh as
much as the step's arithmetic. `Deferred` (a torch function mode, active while a chunk's steps run) sends those calls
(and, on the CPU, `torch.lstm_cell`'s two products) through Functions that compute the input's gradient in
backward and keep each step's (output gradient, input) pair; `add` then gives each weight its sum_t g_t^T x_t as
one product over every step's rows (and each embedding one index_add), the passes once per chunk (measured:
docs/results/). The built-in LSTM does the same by hand for its cell (`models/deferred.py`, whose sink this is).

Only steps of fewer than DEFERRED_BELOW_ROWS rows are deferred (a larger step's product amortises its passes),
only the trainable parameters phase two differentiates, only plain tensors (an FSDP-sharded model's
gathered weights are not among them), and never under autocast (the products' dtypes are then autocast's, which
these Functions do not reproduce) or while torch.compile traces: those calls run as they are. A parameter's
gradient hooks see only autograd's share of its gradient (none where every use is deferred).

Letters: n rows of a step, I input size, O output size, R rows of all steps together.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .. import blocks

# rows of (g, x) pairs concatenated per product: a block's worth (the pairs of a V-sized output layer together
# are as large as the log-probabilities phase two saved, so they are summed a block at a time, not concatenated)
BLOCK_BYTES = 2 * 2**20
# Steps of at least this many rows keep autograd's per-step products: with that many rows a product amortises its
# weight-sized passes; below it the sums save both time and the per-step weight-sized temporaries (a step-only
# model at chunks of 64 to 256 rows: docs/results/). A parallel pass over a chunk's positions (a model's own
# `score`) has its rows times its length, and is rarely below.
DEFERRED_BELOW_ROWS = 256


class WeightGradients:
    """Collects, per weight, the (incoming gradient, input) pairs of the products backward went through, and per
    embedding table its (ids, gradient rows); `gradients()` sums them."""

    def __init__(self):
        self._pairs: dict[int, tuple[Tensor, list, list]] = {}  # id(weight) -> (weight, [g (n, O)], [x (n, I)])
        self._rows: dict[int, tuple[Tensor, list, list]] = {}  # id(table) -> (table, [ids (n,)], [g (n, E)])

    def record(self, weight: Tensor, g: Tensor, x: Tensor) -> None:
        entry = self._pairs.setdefault(id(weight), (weight, [], []))
        entry[1].append(g)
        entry[2].append(x)

    def record_rows(self, table: Tensor, ids: Tensor, g: Tensor) -> None:
        entry = self._rows.setdefault(id(table), (table, [], []))
        entry[1].append(ids)
        entry[2].append(g)

    @torch.no_grad()  # a saved input comes back from backward still requiring grad: no graph through the sums
    def gradients(self, into=None):
        """Yields (weight, d loss / d weight) for each weight backward reached, one at a time, each pair dropped as
        it is summed (so at most one weight's sum and one block of pairs exist beside the gradients): computed
        outside autocast in at least float32, returned in the weight's dtype. `into(weight)` may give a tensor of
        the weight's shape to add the sum into (its .grad, say), which is then the one yielded."""
        while self._pairs:
            _, (weight, gs, xs) = self._pairs.popitem()
            acc, buffer = torch.promote_types(weight.dtype, torch.float32), into(weight) if into else None
            total = buffer if buffer is not None and buffer.dtype == acc else \
                torch.zeros(weight.shape, dtype=acc, device=weight.device)  # (O, I)
            with torch.autocast(weight.device.type, enabled=False):
                for lo, hi in list(_blocks(gs, xs, weight)):
                    g = torch.cat([t.to(acc) for t in gs[lo:hi]])  # (r, O)
                    x = torch.cat([t.to(acc) for t in xs[lo:hi]])  # (r, I)
                    gs[lo:hi] = xs[lo:hi] = [None] * (hi - lo)  # summed: freed
                    total.addmm_(g.t(), x)
                    del g, x
            yield weight, _into(total.to(weight.dtype), buffer)
        while self._rows:
            _, (table, ids, gs) = self._rows.popitem()
            acc, buffer = torch.promote_types(table.dtype, torch.float32), into(table) if into else None
            total = buffer if buffer is not None and buffer.dtype == acc else \
                torch.zeros(table.shape, dtype=acc, device=table.device)  # (V, E)
            g = torch.cat([t.to(acc) for t in gs])  # (R, E)
            gs.clear()
            total.index_add_(0, torch.cat(ids), g)
            del g
            yield table, _into(total.to(table.dtype), buffer)


def _into(total: Tensor, buffer: Tensor | None) -> Tensor:
    """The sum, added into buffer unless it was summed there."""
    if buffer is None or total is buffer:
        return total
    return buffer.add_(total)


def _blocks(gs: list, xs: list, weight: Tensor):
    """(lo, hi) runs of steps whose pairs together hold at most a block's bytes (at least one step each)."""
    limit = blocks.block_bytes(weight.device, BLOCK_BYTES) // max(1, 4 * sum(weight.shape))
    lo, rows = 0, 0
    for i, g in enumerate(gs):
        if i > lo and rows + g.shape[0] > limit:
            yield lo, i
            lo, rows = i, 0
        rows += g.shape[0]
    if lo < len(gs):
        yield lo, len(gs)


class DeferredLinear(torch.autograd.Function):
    """F.linear(x (n, I), weight (O, I), bias (O,)) whose weight gradient goes to a `WeightGradients`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, sink: WeightGradients) -> Tensor:
        ctx.save_for_backward(x)
        # The weight (a parameter, alive anyway) is kept as itself: saved through saved_tensors_hooks (the meter
        # of system.memory) it would come back as another tensor object, and its gradient would go to that one.
        ctx.weight, ctx.sink = weight, sink
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        (x,), weight = ctx.saved_tensors, ctx.weight
        if ctx.needs_input_grad[1]:
            ctx.sink.record(weight, g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]))
        dx = g @ weight if ctx.needs_input_grad[0] else None  # (..., I)
        db = g.reshape(-1, g.shape[-1]).sum(dim=0) if ctx.needs_input_grad[2] else None  # (O,)
        return dx, None, db, None


class DeferredEmbedding(torch.autograd.Function):
    """F.embedding(ids, table, padding_idx) whose table gradient goes to a `WeightGradients` as rows."""

    @staticmethod
    def forward(ctx, ids: Tensor, table: Tensor, padding_idx: int | None, sink: WeightGradients) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.table, ctx.padding_idx, ctx.sink = table, padding_idx, sink
        return F.embedding(ids, table, padding_idx)

    @staticmethod
    def backward(ctx, g: Tensor):
        (ids,) = ctx.saved_tensors
        ids, g = ids.reshape(-1), g.reshape(-1, g.shape[-1])  # (n,), (n, E)
        if ctx.padding_idx is not None:  # the padding row gets no gradient, as F.embedding's backward gives it
            g = g * (ids != ctx.padding_idx).to(g.dtype)[:, None]
        ctx.sink.record_rows(ctx.table, ids, g)
        return None, None, None, None


def _linear_arguments(input, weight, bias=None):
    return input, weight, bias


def _lstm_cell_arguments(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    return input, hx, w_ih, w_hh, b_ih, b_hh


def _lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh, sink: WeightGradients) -> tuple[Tensor, Tensor]:
    """torch.lstm_cell with its two products deferred, in the CPU kernel's order (the hidden product first; gates
    i, f, g, o): the numbers search's `nn.LSTMCell` computed. (CUDA's fused kernel differs in its last bits, so
    there the cell runs as it is.)"""
    gates = DeferredLinear.apply(h, w_hh, b_hh, sink) + DeferredLinear.apply(x, w_ih, b_ih, sink)  # (n, 4H)
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _embedding_arguments(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                         sparse=False):
    return input, weight, padding_idx, max_norm is None and not scale_grad_by_freq and not sparse


class Deferred(TorchFunctionMode):
    """While active, F.linear and F.embedding on one of `params` (with a graph, outside autocast) defer their
    weight's gradient to `self.sink`; `add` then puts the sums beside autograd's gradients."""

    def __init__(self, params: list[Tensor]):
        super().__init__()
        self.params = {id(p) for p in params if type(p) in (torch.Tensor, torch.nn.Parameter)}
        self.sink = WeightGradients()

    def _deferred(self, weight, rows: int, *tensors) -> bool:
        """Whether a product of `weight` with `rows` rows of input (or ids) is deferred."""
        if not isinstance(weight, Tensor) or id(weight) not in self.params or not torch.is_grad_enabled():
            return False
        if rows >= DEFERRED_BELOW_ROWS:
            return False
        if torch.compiler.is_compiling() or any(torch.is_autocast_enabled(t.device.type) for t in tensors):
            return False
        return True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_arguments(*args, **kwargs)
            if self._deferred(weight, x.numel() // max(1, x.shape[-1]), x):
                return DeferredLinear.apply(x, weight, bias, self.sink)
        elif func is torch.lstm_cell:
            x, (h, c), w_ih, w_hh, b_ih, b_hh = _lstm_cell_arguments(*args, **kwargs)
            if x.device.type == "cpu" and self._deferred(w_ih, x.shape[0], x) and id(w_hh) in self.params:
                return _lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh, self.sink)
        elif func is F.embedding:
            ids, table, padding_idx, plain = _embedding_arguments(*args, **kwargs)
            if plain and self._deferred(table, ids.numel(), table):
                if padding_idx is not None and padding_idx < 0:
                    padding_idx += table.shape[0]
                return DeferredEmbedding.apply(ids, table, padding_idx, self.sink)
        return func(*args, **kwargs)

    def add(self, inputs: list, grads, collect: bool) -> list:
        """With collect, grads (aligned with inputs) with the deferred sums added; without, the sums added into
        each weight's .grad and grads returned as they are."""
        grads = list(grads)
        where = {id(x): i for i, x in enumerate(inputs)}
        # each sum goes straight into what it is added to: at most one weight-sized temporary at a time
        into = (lambda w: grads[where[id(w)]]) if collect else (lambda w: w.grad)
        for weight, g in self.sink.gradients(into):
            if collect:
                grads[where[id(weight)]] = g
            elif weight.grad is None:
                weight.grad = g
        return grads
