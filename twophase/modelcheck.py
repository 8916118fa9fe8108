"""`check_model(model, source)`: a cheap test of a model against the `SequenceModel` protocol, run by train.py on
one batch at start-up, so that a broken model is named in seconds rather than trained to a silent exit 0.

Rules (each violation is one line naming its rule), read over STEPS decoder steps: each row fed bos, then a
token of its own (a source's first copy its best open token, its second copy the next best):
    shapes       encode's output leads with B, init_state's and step's state with N, step's log-probabilities
                 are a floating (N, V) tensor, V holds the special ids (and `vocab_size`, where the model has one)
    finite       no NaN or +inf (-inf is a banned token), at every step
    normalised   every row's logsumexp is 0 at every step: log-probabilities, not logits, probabilities or
                 shifted values (to the dtype's rounding, `_tolerance`)
    specials     pad_id and bos_id (unless equal to eos_id) have probability zero at every step: search never
                 proposes them, so probability there means sampling draws from a renormalised distribution while
                 scores keep the full log p. A model that knowingly leaves them to search sets
                 `bans_specials = False` (the Hugging Face wrappers: a pretrained head gives pad some mass)
    vocabulary   the target ids given (a task's references) are below V
    reorder      the state is a tree of rows: selecting rows (reversed, then with repeats) before a step equals
                 selecting the rows of the steps' output
    rows         a row's log-probabilities do not depend on which other rows share its batch: a subset of the
                 rows, a permutation with repeats and single rows, teacher-forced on the same tokens, give what
                 the full batch gave (a layer mixing the batch dimension fails this, and search would score rows
                 by their neighbours), to rounding: other batch sizes run other kernels, which add in other orders
    score        the model's own `score` (where it has one) equals `step` teacher-forced on the same rows

Letters: B sources, N = 2B rows (each source twice), V vocabulary, T target length.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import nested
from .phase1.search import beam_search
from .protocol import ModelError, all_modules, eval_mode, model_name, num_sources, step_score
from .samples import Samples
from .vocab import pad_targets

STEPS = 3  # decoder steps the rules read: bos, then two tokens of each row's own


def check_model(model, source, targets: Samples | None = None) -> None:
    """ModelError, one line per broken rule, where `model` breaks the protocol on `source` (a batch of the
    model's sources, a few are enough); `targets`: rows of target ids in the model's layout (references, say)."""
    found = problems(model, source, targets)
    if found:
        raise ModelError("\n".join(found))


def check_model_on(model, task, device) -> None:
    """`check_model` on a task's first two training sources (and their references, where they have some), as a
    run does before its first step: ModelError naming every broken rule. The task is read for `train`,
    `target_ids` and `collate` only."""
    examples = task.train[:2]
    ids = [(b, row) for b, ex in enumerate(examples) for row in task.target_ids(ex)]
    targets = None
    if ids:
        tgt = pad_targets([row for _, row in ids], device, model.pad_id, model.eos_id)  # (R, T)
        owner = torch.tensor([b for b, _ in ids], dtype=torch.long, device=device)
        targets = Samples.of_targets(tgt, owner, model.pad_id, model.eos_id)
    check_model(model, task.collate(examples, device), targets)


def problems(model, source, targets: Samples | None = None) -> list[str]:
    """The broken rules as lines `model check: RULE: what` (empty: the model passed)."""
    name = model_name(model)
    with eval_mode(model), torch.no_grad():
        found = _shapes(model, source)
        if found:  # nothing else can be read from a model whose shapes are wrong
            return [f"model check: shapes: {name}.{line}" for line in found]
        enc = model.encode(source)
        owner = _owner(enc)
        prefix, steps = _free_run(model, enc, owner)
        found = [f"model check: {rule}: {name}.{line}" for rule, line in _distribution(model, steps)]
        V = steps[0].shape[1]
        if targets is not None and len(targets) and int(targets.tokens.max()) >= V:
            found.append(f"model check: vocabulary: {name}.step returns {V} log-probabilities per row, "
                         f"but a target id is {int(targets.tokens.max())}")
            return found
        if not found or all(": specials:" in line for line in found):
            found += [f"model check: {rule}: {name}.{line}" for rule, line in _consistency(model, source, enc,
                                                                                         owner, prefix, steps,
                                                                                         targets)]
    return found


def _owner(enc) -> Tensor:
    B = num_sources(enc)
    return torch.arange(B, device=nested.device_of(enc)).repeat(2)  # (N,) every source twice


def _rows(value, N: int) -> bool:
    """Every tensor of the state tree leads with its N rows (a state without tensors has nothing to reorder)."""
    return all(t.dim() > 0 and t.shape[0] == N for t in nested.tensors(value))


def _shapes(model, source) -> list[str]:
    enc = model.encode(source)
    if not nested.tensors(enc) or nested.tensors(enc)[0].dim() == 0:
        return ["encode returned no tensor with a leading dimension of sources"]
    owner = _owner(enc)
    N = len(owner)
    state = model.init_state(enc, owner)
    if not _rows(state, N):
        return [f"init_state for {N} rows returned a state whose tensors do not lead with {N} rows"]
    out = model.step(enc, owner, torch.full((N,), model.bos_id, dtype=torch.long, device=owner.device), state)
    if not (isinstance(out, tuple) and len(out) == 2):
        return ["step must return (state, log_probs)"]
    state, logp = out
    if not (isinstance(logp, Tensor) and logp.dim() == 2 and logp.shape[0] == N and logp.is_floating_point()):
        shape = tuple(logp.shape) if isinstance(logp, Tensor) else type(logp).__name__
        return [f"step returned log-probabilities of shape {shape} for {N} rows, not a floating (N, V) = ({N}, V)"]
    V, found = logp.shape[1], []
    if not _rows(state, N):
        found.append(f"step returned a state whose tensors do not lead with its {N} rows")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and vocab != V:
        found.append(f"step returned {V} log-probabilities per row, but vocab_size is {vocab}")
    ids = {"pad_id": model.pad_id, "bos_id": model.bos_id, "eos_id": model.eos_id}
    found += [f"{k} {v} is outside the {V} log-probabilities step returns" for k, v in ids.items() if not 0 <= v < V]
    return found


# What rounding allows: ROUNDING_UNITS of the eps log p was computed with, per nat of a row's entropy in its
# logsumexp (a 16-bit log p keeps 8 or 11 bits); ACROSS_BATCHES times that per nat of a row's size and per decoder
# step where the same rows are decoded in another batch, whose size runs other kernels that add in another order:
# up to 12 eps in the suite's float32 and float64 models (an LSTM, Karel's, GPT-2, Llama, BART, Marian, a 4-layer
# T5 the most). A model whose rows read 1% of the batch's mean log-probabilities moves them by ~1e-4 to 1e-3 nats,
# a thousand eps of float32 and more.
ROUNDING_UNITS = 8
ACROSS_BATCHES = 8
TF32_EPS = 2.0 ** -10  # TensorFloat32 keeps 10 bits of float32's 23


def _tolerance(model, logp: Tensor) -> float:
    """ROUNDING_UNITS of the eps log p was computed with: its dtype's (float64 2.2e-16, float32 1.2e-7, bf16
    0.0078, float16 0.00098), but float32's is TF32's where float32 matmuls may round to it (--tf32:
    torch.get_float32_matmul_precision() 'high'; 'medium': bf16's), or on a GPU where cuDNN may (its default,
    `torch.backends.cudnn.allow_tf32`) and the model has convolutions or recurrent layers."""
    eps = torch.finfo(logp.dtype).eps
    if logp.dtype == torch.float32:
        precision = torch.get_float32_matmul_precision()
        cudnn = logp.device.type == "cuda" and torch.backends.cudnn.allow_tf32 and any(
            isinstance(m, (torch.nn.modules.conv._ConvNd, torch.nn.RNNBase)) for m in all_modules(model))
        if precision == "medium":
            eps = torch.finfo(torch.bfloat16).eps
        elif precision == "high" or cudnn:
            eps = TF32_EPS
    return ROUNDING_UNITS * eps


def _off(a: Tensor, b: Tensor, tol: float, steps: int) -> Tensor:
    """Where a differs from b by more than the rounding of `steps` steps allows: |a - b| > tol * steps * (1 + size),
    size the largest finite |b| of the row (of (N, V) log-probabilities: the spread of the row's logits, which
    each log p is rounded with), or |b| (of (N,) sums). Equal infinities agree; NaN agrees with NaN only."""
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    size = torch.where(b.isfinite(), b.abs(), torch.zeros_like(b))
    if size.dim() == 2:
        size = size.amax(dim=1, keepdim=True)  # (N, 1)
    return ~same & ~((a - b).abs() <= tol * steps * (1 + size))


def _distribution(model, steps: list[Tensor]) -> list[tuple[str, str]]:
    """finite, normalised and specials on every step's (N, V) log-probabilities (the first broken step named)."""
    for t, logp in enumerate(steps):
        found = _distribution_at(model, logp, f"step {t + 1} of {len(steps)}")
        if found:
            return found
    return []


def _distribution_at(model, logp: Tensor, at: str) -> list[tuple[str, str]]:
    x, tol = logp.double(), _tolerance(model, logp)
    if bool(torch.isnan(x).any() | torch.isposinf(x).any()):
        return [("finite", f"step returned NaN or +inf log-probabilities at {at} (only -inf, a banned token, may "
                           "be non-finite)")]
    found = []
    total = torch.logsumexp(x, dim=1)  # (N,) 0 for normalised rows
    worst = float(total[total.abs().argmax()])
    if abs(worst) > tol * (1 + math.log(x.shape[1])):  # each log p rounded: the row's entropy (<= log V) in eps
        found.append(("normalised", f"step's log-probabilities are not normalised at {at}: a row's logsumexp is "
                                    f"{worst:.4g}, not 0 (return log_softmax of the logits)"))
    banned = _banned(model)
    if banned and getattr(model, "bans_specials", True):
        mass = float(torch.softmax(x, dim=1)[:, banned].sum(1).max())
        if mass > tol:
            found.append(("specials", f"step gives pad_id/bos_id {banned} probability up to {mass:.3g} at {at}; "
                                      "search never proposes them: set their logits to -inf (or bans_specials = "
                                      "False)"))
    return found


def _banned(model) -> list[int]:
    return sorted({model.pad_id, model.bos_id} - {model.eos_id})


def _free_run(model, enc, owner: Tensor) -> tuple[Tensor, list[Tensor]]:
    """STEPS steps of the N rows from bos, each row continuing with a token of its own: the first copy of a
    source its best open token, the second its next best (never a special id, where enough others remain), so
    that the rows of one source differ from the second step on. Returns (prefix (N, STEPS): the token each
    step was fed, steps: STEPS (N, V) log-probabilities)."""
    N = len(owner)
    prev = torch.full((N,), model.bos_id, dtype=torch.long, device=owner.device)
    second = (torch.arange(N, device=owner.device) >= N // 2).long()  # (N,) 1 for each source's second copy
    state, fed, steps = model.init_state(enc, owner), [], []
    for _ in range(STEPS):
        fed.append(prev)
        state, logp = model.step(enc, owner, prev, state)
        steps.append(logp)
        prev = _continuation(model, logp, second)
    return torch.stack(fed, 1), steps


def _continuation(model, logp: Tensor, second: Tensor) -> Tensor:
    """(N,) each row's best (second == 0) or next best (second == 1) token, specials excluded where at least two
    others remain (the eos too, so that every row keeps going)."""
    V = logp.shape[1]
    specials = sorted({model.pad_id, model.bos_id, model.eos_id})
    if V - len(specials) < 2:
        specials = _banned(model)
    if V - len(specials) < 2:
        return logp.double().nan_to_num(nan=0.0).argmax(1)
    closed = torch.tensor(specials, dtype=torch.long, device=logp.device)
    scores = logp.double().nan_to_num(nan=0.0, posinf=0.0).index_fill(1, closed, float("-inf"))
    return scores.topk(2, dim=1).indices.gather(1, second[:, None]).squeeze(1)


def _teacher_forced(model, enc, owner: Tensor, prefix: Tensor, rows: Tensor | None = None,
                    reorders: tuple = ()) -> list[Tensor]:
    """The log-probabilities of every step of rows (all when None) fed their prefix (N, STEPS), decoded in a
    batch of their own; reorders[k - 1] (rows of the batch so far), where given, selects the state's rows
    before step k (repeats allowed), as search does. Returns STEPS (n, V), the rows as they end up."""
    rows = torch.arange(len(owner), device=owner.device) if rows is None else rows
    state, out = model.init_state(enc, owner[rows]), []
    for t in range(prefix.shape[1]):
        if 0 < t <= len(reorders):
            rows = rows[reorders[t - 1]]
            state = nested.select_rows(state, reorders[t - 1])
        state, logp = model.step(enc, owner[rows], prefix[rows, t], state)
        out.append(logp)
    return out


def _gap(got: list[Tensor], want: list[Tensor], tol: float) -> tuple[int, float] | None:
    """(step, largest difference) at the first step where got differs from want by more than the rounding of that
    many steps allows (`_off`); None."""
    for t, (a, b) in enumerate(zip(got, want)):
        off = _off(a, b, tol, t + 1)
        if bool(off.any()):
            diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
            return t + 1, float(diff[off].max())
    return None


def _row_sets(N: int, device) -> list[tuple[str, Tensor]]:
    """Batches of rows that must decode as they do in the full batch: a subset, a permutation with repeats,
    and single rows (the first and last few)."""
    sets = [("the rows " + ", ".join(map(str, range(0, N, 2))), torch.arange(0, N, 2, device=device)),
            ("a reordering with repeats", torch.tensor([N - 1, 0, 0, N // 2, N - 1], device=device))]
    singles = range(N) if N <= 8 else [0, 1, N - 2, N - 1]
    return sets + [(f"row {i} alone", torch.tensor([i], device=device)) for i in singles]


def _consistency(model, source, enc, owner: Tensor, prefix: Tensor, steps: list[Tensor],
                 targets) -> list[tuple[str, str]]:
    found, tol = [], ACROSS_BATCHES * _tolerance(model, steps[0])
    N, device = len(owner), owner.device
    # reorder: the state's rows selected before steps 2 and 3 (reversed, then with repeats), as search does
    reorders = (torch.arange(N - 1, -1, -1, device=device), torch.tensor([N - 1, 0, 0, N // 2], device=device))
    reorders = reorders[:STEPS - 1]
    got = _teacher_forced(model, enc, owner, prefix, reorders=reorders)
    gap = _gap(got, [s.index_select(0, _composed(reorders[:t], N, device)) for t, s in enumerate(steps)], tol)
    if gap is not None:
        found.append(("reorder", f"step after selecting rows of the state differs from selecting rows after "
                                 f"step (by {gap[1]:.4g} at step {gap[0]}): every state tensor must lead with the "
                                 f"rows (N, ...)"))
    for what, rows in _row_sets(N, device):
        gap = _gap(_teacher_forced(model, enc, owner, prefix, rows), [s[rows] for s in steps], tol)
        if gap is not None:
            found.append(("rows", f"step's log-probabilities for a row depend on the other rows of the batch: "
                                  f"{what} decoded without the others differ from the full batch by {gap[1]:.4g} "
                                  f"at step {gap[0]} (a layer that mixes the batch dimension: nn.Transformer* or "
                                  f"MultiheadAttention without batch_first=True, a statistic over rows)"))
            break
    if callable(getattr(model, "score", None)):
        rows = targets if targets is not None and len(targets) else beam_search(model, source, 2, 4)
        if len(rows):
            own = model.score(enc, rows.tokens, rows.owner).double()
            stepped = step_score(model, enc, rows.tokens, rows.owner).double()
            gap = float((own - stepped).abs().max())
            if bool(_off(own, stepped, tol, rows.tokens.shape[1]).any()):
                found.append(("score", f"score differs from step teacher-forced by up to {gap:.4g} on the same "
                                       "rows: both phases must score with one function"))
    return found


def _composed(reorders: tuple, N: int, device) -> Tensor:
    """The full batch's rows after the selections so far."""
    rows = torch.arange(N, device=device)
    for perm in reorders:
        rows = rows[perm]
    return rows
