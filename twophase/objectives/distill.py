"""On-policy distillation: the divergence of the student's next-token distributions from a teacher's at every
position of the student's own candidates, TRL 1.16's `DistillationTrainer` loss.

With s = log_softmax(z / temperature) the student's and t = log_softmax(z_teacher / temperature) the teacher's
log-distributions at a scored position, p = exp s, q = exp t:

    beta = 0        D = KL(q || p) = sum_v q (t - s)                          forward KL
    beta = 1        D = KL(p || q) = sum_v p (s - t)                          reverse KL
    0 < beta < 1    D = beta KL(q || m) + (1 - beta) KL(p || m),              the generalized Jensen-Shannon
                    m = (1 - beta) p + beta q                                 divergence (TRL's mixture)

    L = sum over the rows' scored positions of D / num_items                  num_items: the generation's scored
                                                                              tokens (TRL's num_items_in_batch)

and with respect to the student's logits z (u = z / temperature):

    beta = 0        dD/du = p - q
    beta = 1        dD/du = p (s - t - D)
    0 < beta < 1    dD/du = (1 - beta) p (s - log m - KL(p || m))

(the mixture's own dependence on p cancels), times 1 / temperature. The target token does not enter D: each
position's loss is a function of its whole distribution, which the student's by-hand output layer computes a
block of logits at a time (`outputlayer.target_log_probs_and_grads`, `tokenweights.PositionWeights.logit_gradient`);
the teacher's logits of the same block come from its hidden states (`outputlayer.HeadStates`), so no (rows, T, V)
tensor of either model exists. L is a sum over rows with constant normalisers, so the chunks stay exact.

`distillation(teacher, beta, temperature)` goes to `rescore_backward` in place of the coefficients. There it is
bound to the batch (`bind`): the teacher encodes the B sources once, in evaluation mode and without a graph, and
each chunk's rows are teacher-forced through it the same way (`decoded`); the teacher gets no gradient. The
teacher may differ from the student in size and kind but must share its target vocabulary and special ids.

Letters: B sources, N rows (C in a chunk), T positions, P scored positions (row, col), V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .. import protocol


@dataclass(frozen=True)
class Distillation:
    """The objective before it meets a batch: `rescore_backward` binds it (`bind`) to its rows."""

    teacher: object
    beta: float = 1.0
    temperature: float = 1.0
    num_items: float | Tensor | None = None

    def bind(self, model, source, samples) -> "DistillationLoss":
        """The objective of samples' N rows: the teacher's encoder output for source (once, no graph), every
        row's normaliser 1 / num_items (default: the rows' scored positions)."""
        check_compatible(model, self.teacher)
        with torch.no_grad(), protocol.eval_mode(self.teacher):
            enc = self.teacher.encode(source)
        lengths = samples.lengths
        items = lengths.sum() if self.num_items is None else torch.as_tensor(self.num_items, device=lengths.device)
        scale = torch.ones(len(lengths), dtype=torch.float64, device=lengths.device) / items.to(torch.float64).clamp(min=1)
        return DistillationLoss(self.teacher, enc, self.beta, self.temperature, scale, lengths)


def distillation(teacher, beta: float = 1.0, temperature: float = 1.0,
                 num_items: float | Tensor | None = None) -> Distillation:
    """TRL 1.16's on-policy distillation loss (see the module docstring) for `rescore_backward`: beta 0 forward
    KL(teacher || student), 1 reverse KL(student || teacher), between the generalized JSD; temperature divides
    both models' logits. num_items: what the sum is divided by, the generation's scored tokens (TRL's
    num_items_in_batch: every accumulated batch's and every process's, whose gradients are summed; TRL divides it
    by the number of processes because DDP averages theirs); default the rows' own."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return Distillation(teacher, float(beta), float(temperature), num_items)


@dataclass
class DistillationLoss:
    """The divergence objective over N rows, bound to the teacher's encoder output: what phase two's chunks read
    (the `tokenweights.ChunkLoss` interface: `derivative` of the target's log-probabilities, zero here, and
    `divergence` of whole distributions)."""

    teacher: object
    enc: object  # the teacher's encoder output of the B sources
    beta: float
    temperature: float
    scale: Tensor  # (N,) float64: 1 / num_items
    lengths: Tensor  # (N,) positions each row scores
    states: object = None  # the teacher's `outputlayer.HeadStates` of one chunk's rows (`decoded`)

    def __len__(self) -> int:
        return len(self.scale)

    def __getitem__(self, rows) -> "DistillationLoss":
        return replace(self, scale=self.scale[rows], lengths=self.lengths[rows])

    def live(self) -> Tensor:
        return self.scale != 0

    def needs_row_statistics(self) -> bool:
        return False

    def decoded(self, tokens: Tensor, owner: Tensor) -> "DistillationLoss":
        """This chunk's objective with the teacher's output-layer inputs at every position of rows tokens (C, T)
        of sources owner (C,): teacher-forced in evaluation mode, without a graph."""
        with torch.no_grad(), protocol.eval_mode(self.teacher):
            states = head_states(self.teacher, self.enc, tokens, owner)
        return replace(self, states=states)

    def chunk_states(self) -> list[Tensor]:
        """The tensors `decoded` made for this chunk's rows alone, held beside the student's graph through the
        chunk: the teacher's hidden states (C, T, H_teacher). `--rescore-chunk auto` counts them
        (`system.profiling.ChunkPlanner`)."""
        return [] if self.states is None else [self.states.hidden]

    def derivative(self, logp: Tensor, row: Tensor, col: Tensor):
        """(loss, d loss / d log p(target), statistics) at the positions: 0, the divergence ignores the target."""
        zero = torch.zeros_like(logp)
        return zero, zero, {}

    def divergence(self, z: Tensor, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
        """((m,) D at positions (row, col) whose student logits are z (m, V), (m, V) dD/dz), without a graph."""
        # the teacher's (m, V) logits go straight in, to be consumed there
        return divergence_and_gradient(z, self.states.logits(row, col), self.beta, self.temperature)


def _log_softmax(z: Tensor, temperature: float) -> Tensor:
    return torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)


def divergence_and_gradient(z: Tensor, zt: Tensor, beta: float, temperature: float) -> tuple[Tensor, Tensor]:
    """((m,) D, (m, V) dD/dz) at the student's logits z (m, V) and the teacher's zt (m, V), without a graph:
    the closed forms of the module docstring. zt is consumed (normalised in place; the caller keeps no other
    reference to it, so its block is freed as soon as the teacher's log-probabilities replace it). Every step
    works in place on a block no longer needed, so beside z at most two (m, V) blocks are held at once for
    beta 1, three for beta 0 and four between (with one boolean block for a moment, and one more block when the
    temperature is not 1): a block pass's memory is a few blocks, whatever V."""
    with torch.no_grad():
        dtype = torch.promote_types(z.dtype, torch.float32)
        zt = zt.to(dtype)
        if temperature != 1.0:
            zt.div_(temperature)
        t = torch.log_softmax(zt, dim=-1)  # (m, V)
        del zt
        s = _log_softmax(z.to(dtype), temperature)  # (m, V)
        if beta == 1.0:
            d = t.sub_(s).neg_()  # (m, V) s - t, in t's block
            p = s.exp_()  # in s's block: s is not needed again
            D = _weighted_sum_(d, p)  # d now holds p (s - t)
            grad = d.addcmul_(p, D[:, None], value=-1.0)  # p (s - t - D): 0 where p is 0
        elif beta == 0.0:
            q = t.exp()
            D = _weighted_sum_(t.sub_(s), q)  # q (t - s)
            del t
            p = s.exp_()
            zero = p == 0  # (m, V) no gradient there (a banned token, whose logit is a constant)
            grad = p.sub_(q).masked_fill_(zero, 0.0)  # p - q
        else:
            # the mixture's log-probabilities log((1 - beta) p + beta q), as logaddexp in log space
            shift = math.log(beta) - math.log(1 - beta)
            m = t + shift
            torch.logaddexp(s, m, out=m)
            m.add_(math.log(1 - beta))  # (m, V)
            q = t.exp()
            kl_teacher = _weighted_sum_(t.sub_(m), q)  # q (t - m)
            del t, q
            p = s.exp()
            d = s.sub_(m)  # (m, V) s - m
            del m
            kl_student = _weighted_sum_(d, p)  # d now holds p (s - m)
            D = beta * kl_teacher + (1 - beta) * kl_student
            grad = d.addcmul_(p, kl_student[:, None], value=-1.0).mul_(1 - beta)  # (1 - beta) p (s - m - KL)
        if temperature != 1.0:
            grad.div_(temperature)
        return D, grad


def _weighted_sum_(d: Tensor, p: Tensor) -> Tensor:
    """(m,) sum_v p d, 0 where p is 0 (d may be -inf or nan there: a banned token), without a graph: d (m, V)
    is overwritten with p d (and 0 where p is 0), which is then also the gradient's first term."""
    return d.mul_(p).masked_fill_(p == 0, 0.0).sum(-1)


def head_states(model, enc, tokens: Tensor, owner: Tensor):
    """The model's `outputlayer.HeadStates` at every position of rows tokens (C, T): its own `head_states`
    (the built-in LSTM, the Hugging Face wrappers whose output layer is known)."""
    own = getattr(model, "head_states", None)
    if own is None:
        raise ValueError(f"the teacher {protocol.model_name(model)} cannot hand over its output layer's inputs "
                         "(head_states): use the built-in LSTM or a Hugging Face model whose head is known")
    return own(enc, tokens, owner)


def vocab_size(model) -> int | None:
    """The size of the model's output vocabulary, where it can be read without a forward."""
    size = getattr(model, "vocab_size", None)
    if isinstance(size, int):
        return size
    inner = getattr(model, "model", None)
    out = inner.get_output_embeddings() if callable(getattr(inner, "get_output_embeddings", None)) else None
    return None if out is None else out.weight.shape[0]


def check_compatible(student, teacher) -> None:
    """A one-line ValueError unless teacher and student share the target vocabulary and special ids: the
    divergence compares their distributions token by token over the student's rows."""
    vs, vt = vocab_size(student), vocab_size(teacher)
    if vs is not None and vt is not None and vs != vt:
        raise ValueError(f"the teacher's vocabulary has {vt} tokens, the student's {vs}: distillation needs one "
                         "target vocabulary")
    for name in ("eos_id", "pad_id"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            raise ValueError(f"the teacher's {name} is {b}, the student's {a}: distillation needs one target "
                             "vocabulary")
