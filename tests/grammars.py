"""Grammars for the constrained-decoding tests, each written twice: in tensors (what `Constrained` runs, the
`start`/`allowed`/`advance` protocol of `twophase.constraints`) and as a plain Python function of the prefix
(`allowed_after(prefix) -> set`), the oracle the tests compare with.

- `RandomDFA`: a seeded random finite automaton over a model's generable tokens; accepting states allow eos.
- `Brackets`: balanced brackets (one or two kinds, nesting at most `max_depth`) plus free tokens, a pushdown
  automaton whose state is a (N, D) stack and a depth; eos where every bracket is closed.

Letters: N rows, S automaton states, D stack capacity, V vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor


def generable(vocab: int, specials) -> list[int]:
    return [t for t in range(vocab) if t not in set(specials)]


class RandomDFA:
    def __init__(self, vocab: int, pad_id: int, bos_id: int, eos_id: int, states: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.eos_id, self.sink = eos_id, states
        words = generable(vocab, (pad_id, bos_id, eos_id))
        self.trans = torch.full((states + 1, vocab), states, dtype=torch.long)  # (S + 1, V); row S: the sink
        self.table = torch.zeros(states + 1, vocab, dtype=torch.bool)  # (S + 1, V) allowed
        for s in range(states):
            keep = torch.rand(len(words), generator=g) < 0.6
            accepting = s == 0 or bool(torch.rand(1, generator=g) < 0.5)
            if not keep.any() and not accepting:
                keep[0] = True  # every state allows something
            for w, k in zip(words, keep.tolist()):
                if k:
                    self.table[s, w] = True
                    self.trans[s, w] = int(torch.randint(states, (1,), generator=g))
            self.table[s, eos_id] = accepting
        self.start_state = 1 if states > 1 else 0  # not accepting at first, where state 1 is not

    def start(self, owner: Tensor) -> Tensor:
        return torch.full_like(owner, self.start_state)  # (N,)

    def allowed(self, state: Tensor) -> Tensor:
        return self.table.to(state.device)[state]  # (N, V)

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        return self.trans.to(state.device)[state, tokens]  # (N,): a disallowed token leads to the sink

    def allowed_after(self, prefix) -> set:
        s = self.start_state
        for tok in prefix:
            if not self.table[s, tok] or tok == self.eos_id:
                return set()
            s = int(self.trans[s, tok])
        return set(self.table[s].nonzero().squeeze(1).tolist())


class Brackets:
    def __init__(self, vocab: int, pad_id: int, bos_id: int, eos_id: int, max_depth: int = 2):
        words = generable(vocab, (pad_id, bos_id, eos_id))
        kinds = 2 if len(words) >= 5 else 1
        self.pairs = [(words[2 * k], words[2 * k + 1]) for k in range(kinds)]  # (open, close) ids
        self.free = words[2 * kinds:]
        self.eos_id, self.D, self.V = eos_id, max_depth, vocab
        self.opens = torch.full((vocab,), -1, dtype=torch.long)  # (V,) bracket kind an id opens, else -1
        self.closes = torch.full((vocab,), -1, dtype=torch.long)  # (V,) bracket kind an id closes, else -1
        for k, (o, c) in enumerate(self.pairs):
            self.opens[o], self.closes[c] = k, k
        self.free_mask = torch.zeros(vocab, dtype=torch.bool)
        self.free_mask[self.free] = True

    def start(self, owner: Tensor) -> dict:
        N = len(owner)
        return {"stack": torch.zeros(N, self.D, dtype=torch.long, device=owner.device),
                "depth": torch.zeros(N, dtype=torch.long, device=owner.device)}

    def allowed(self, state: dict) -> Tensor:
        stack, depth = state["stack"], state["depth"]  # (N, D), (N,)
        top = stack.gather(1, (depth - 1).clamp(min=0)[:, None])  # (N, 1) kind of the innermost open bracket
        opens, closes = self.opens.to(depth.device), self.closes.to(depth.device)
        may_open = (opens >= 0)[None, :] & (depth < self.D)[:, None]  # (N, V)
        may_close = (closes[None, :] == top) & (depth > 0)[:, None]  # (N, V)
        allowed = may_open | may_close | self.free_mask.to(depth.device)[None, :]
        return allowed.index_put((torch.arange(len(depth), device=depth.device), torch.full_like(depth, self.eos_id)),
                                 depth == 0)

    def advance(self, state: dict, tokens: Tensor) -> dict:
        stack, depth = state["stack"], state["depth"]
        kind_open = self.opens.to(tokens.device)[tokens]  # (N,)
        is_open, is_close = kind_open >= 0, self.closes.to(tokens.device)[tokens] >= 0
        pushed = stack.scatter(1, depth.clamp(max=self.D - 1)[:, None], kind_open.clamp(min=0)[:, None])
        stack = torch.where(is_open[:, None], pushed, stack)
        depth = (depth + is_open.long() - is_close.long()).clamp(0, self.D)
        return {"stack": stack, "depth": depth}

    def allowed_after(self, prefix) -> set:
        stack = []
        for tok in prefix:
            if tok not in self.allowed_after_stack(stack) or tok == self.eos_id:
                return set()
            if tok in [o for o, _ in self.pairs]:
                stack.append(tok)
            elif tok in [c for _, c in self.pairs]:
                stack.pop()
        return self.allowed_after_stack(stack)

    def allowed_after_stack(self, stack: list) -> set:
        ok = set(self.free)
        if len(stack) < self.D:
            ok |= {o for o, _ in self.pairs}
        if stack:
            ok |= {c for o, c in self.pairs if o == stack[-1]}
        else:
            ok.add(self.eos_id)
        return ok


GRAMMARS = {"dfa": RandomDFA, "brackets": Brackets}


def make(kind: str, model, vocab: int, **kwargs):
    return GRAMMARS[kind](vocab, model.pad_id, model.bos_id, model.eos_id, **kwargs)
