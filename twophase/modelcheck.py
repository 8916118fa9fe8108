"""`check_model(model, source)`: a cheap test of a model against the `SequenceModel` protocol, run by train.py on
one batch at start-up, so that a broken model is named in seconds rather than trained to a silent exit 0.

Rules (each violation is one line naming its rule):
    shapes       encode's output leads with B, init_state's and step's state with N, step's log-probabilities
                 are a floating (N, V) tensor, V holds the special ids (and `vocab_size`, where the model has one)
    finite       no NaN or +inf (-inf is a banned token)
    normalised   every row's logsumexp is 0: log-probabilities, not logits, probabilities or shifted values
    specials     pad_id and bos_id (unless equal to eos_id) have probability zero: search never proposes them,
                 so probability there means sampling draws from a renormalised distribution while scores keep
                 the full log p. A model that knowingly leaves them to search sets `bans_specials = False`
                 (the Hugging Face wrappers: a pretrained head gives pad some mass)
    vocabulary   the target ids given (a task's references) are below V
    reorder      the state is a tree of rows: selecting rows then stepping equals stepping then selecting
    score        the model's own `score` (where it has one) equals `step` teacher-forced on the same rows

Letters: B sources, N = 2B rows (each source twice), V vocabulary, T target length.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import tree
from .protocol import ModelError, model_name, num_sources, scoring_mode, step_score
from .samples import Samples
from .search import beam_search


def check_model(model, source, targets: Samples | None = None) -> None:
    """ModelError, one line per broken rule, where `model` breaks the protocol on `source` (a batch of the
    model's sources, a few are enough); `targets`: rows of target ids in the model's layout (references, say)."""
    found = problems(model, source, targets)
    if found:
        raise ModelError("\n".join(found))


def problems(model, source, targets: Samples | None = None) -> list[str]:
    """The broken rules as lines `model check: RULE: what` (empty: the model passed)."""
    name = model_name(model)
    with scoring_mode(model), torch.no_grad():
        found = _shapes(model, source)
        if found:  # nothing else can be read from a model whose shapes are wrong
            return [f"model check: shapes: {name}.{line}" for line in found]
        enc, owner, logp = _first_step(model, source)
        found = [f"model check: {rule}: {name}.{line}" for rule, line in _distribution(model, logp)]
        if targets is not None and len(targets) and int(targets.tokens.max()) >= logp.shape[1]:
            found.append(f"model check: vocabulary: {name}.step returns {logp.shape[1]} log-probabilities per row, "
                         f"but a target id is {int(targets.tokens.max())}")
            return found
        if not found or all(": specials:" in line for line in found):
            found += [f"model check: {rule}: {name}.{line}" for rule, line in _consistency(model, source, enc,
                                                                                         owner, logp, targets)]
    return found


def _owner(enc) -> Tensor:
    B = num_sources(enc)
    return torch.arange(B, device=tree.device_of(enc)).repeat(2)  # (N,) every source twice


def _rows(value, N: int) -> bool:
    """Every tensor of the state tree leads with its N rows (a state without tensors has nothing to reorder)."""
    return all(t.dim() > 0 and t.shape[0] == N for t in tree.tensors(value))


def _shapes(model, source) -> list[str]:
    enc = model.encode(source)
    if not tree.tensors(enc) or tree.tensors(enc)[0].dim() == 0:
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


def _first_step(model, source):
    enc = model.encode(source)
    owner = _owner(enc)
    prev = torch.full((len(owner),), model.bos_id, dtype=torch.long, device=owner.device)
    return enc, owner, model.step(enc, owner, prev, model.init_state(enc, owner))[1]


def _tolerance(logp: Tensor) -> float:
    return 1e-6 if logp.dtype == torch.float64 else 1e-3


def _distribution(model, logp: Tensor) -> list[tuple[str, str]]:
    """finite, normalised and specials on the first step's (N, V) log-probabilities."""
    x, tol = logp.double(), _tolerance(logp)
    if bool(torch.isnan(x).any() | torch.isposinf(x).any()):
        return [("finite", "step returned NaN or +inf log-probabilities (only -inf, a banned token, may be "
                           "non-finite)")]
    found = []
    total = torch.logsumexp(x, dim=1)  # (N,) 0 for normalised rows
    worst = float(total[total.abs().argmax()])
    if abs(worst) > tol:
        found.append(("normalised", f"step's log-probabilities are not normalised: a row's logsumexp is "
                                    f"{worst:.4g}, not 0 (return log_softmax of the logits)"))
    banned = sorted({model.pad_id, model.bos_id} - {model.eos_id})
    if banned and getattr(model, "bans_specials", True):
        mass = float(torch.softmax(x, dim=1)[:, banned].sum(1).max())
        if mass > tol:
            found.append(("specials", f"step gives pad_id/bos_id {banned} probability up to {mass:.3g}; search never "
                                      "proposes them: set their logits to -inf (or bans_specials = False)"))
    return found


def _consistency(model, source, enc, owner: Tensor, logp: Tensor, targets) -> list[tuple[str, str]]:
    found, tol = [], _tolerance(logp)
    banned = sorted({model.pad_id, model.bos_id} - {model.eos_id})
    open_logp = logp.index_fill(1, torch.tensor(banned, dtype=torch.long, device=logp.device), float("-inf")) \
        if banned else logp
    if open_logp.shape[1] - len(banned) >= 2:
        # Rows of one source differ: the first copy continues with its best token, the second with its next best.
        second = torch.arange(len(owner), device=owner.device) >= len(owner) // 2
        prev = open_logp.topk(2, dim=1).indices.gather(1, second.long()[:, None]).squeeze(1)  # (N,)
        perm = torch.arange(len(owner) - 1, -1, -1, device=owner.device)  # (N,) the rows reversed
        selected = _state_after_one_step(model, enc, owner, perm)
        a = model.step(enc, owner[perm], prev[perm], selected)[1]
        b = model.step(enc, owner, prev, _state_after_one_step(model, enc, owner))[1][perm]
        if not torch.allclose(a.double(), b.double(), rtol=0, atol=tol, equal_nan=True):
            found.append(("reorder", "step after selecting rows of the state differs from selecting rows after "
                                     "step: every state tensor must lead with the rows (N, ...)"))
    if callable(getattr(model, "score", None)):
        rows = targets if targets is not None and len(targets) else beam_search(model, source, 2, 4)
        if len(rows):
            own = model.score(enc, rows.tokens, rows.owner).double()
            stepped = step_score(model, enc, rows.tokens, rows.owner).double()
            gap = float((own - stepped).abs().max())
            if not gap <= tol * (1 + rows.tokens.shape[1]):
                found.append(("score", f"score differs from step teacher-forced by up to {gap:.4g} on the same "
                                       "rows: both phases must score with one function"))
    return found


def _state_after_one_step(model, enc, owner: Tensor, rows: Tensor | None = None):
    """The state after the bos step, computed afresh (a model may consume the state it is given), optionally
    with its rows selected."""
    prev = torch.full((len(owner),), model.bos_id, dtype=torch.long, device=owner.device)
    state = model.step(enc, owner, prev, model.init_state(enc, owner))[0]
    return tree.select_rows(state, rows) if rows is not None else state
