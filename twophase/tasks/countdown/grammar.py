"""Well-formed RPN as a grammar for `twophase.constraints.Constrained`: a stack counter in tensors.

An RPN row is well formed when each operator finds two values on the stack and one value is left at its end.
So the state is three counters per row: `depth` (values on the stack), `used` (numbers read) and `done` (eos
read). A number is allowed while fewer than the most numbers a problem has were read; an operator where the
stack holds two values or more; eos where it holds exactly one and the count of numbers read is one a problem
has (`counts`: every generated problem has the same). A row with n numbers is then exactly 2n - 1 tokens, every
prefix a state allows can be completed, and `--max-len` need only hold the longest (2n tokens with eos).

The grammar sees no source (`Constrained.start` is given rows, not problems), so it cannot confine a row to its
own problem's numbers: it allows every number token, and using each given number once is the checker's to judge.

Letters: N rows, V vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .rpn import OPS


class RPNGrammar:
    """`start`/`allowed`/`advance` (twophase.constraints) over a vocabulary `itos` (id -> token): tokens that
    are integers are numbers, `+ - * /` operators, `eos_id` ends a row; `counts`: the numbers a problem may have."""

    def __init__(self, itos: list[str], eos_id: int, counts, max_len: int):
        counts = sorted(set(counts))
        longest = 2 * counts[-1]
        if max_len < longest:
            raise ValueError(f"--max-len {max_len} cannot hold an expression of {counts[-1]} numbers "
                             f"({longest - 1} tokens and EOS)")
        self.max_count, self.eos_id = counts[-1], eos_id
        self.is_number = torch.tensor([_is_int(t) for t in itos])  # (V,)
        self.is_op = torch.tensor([t in OPS for t in itos])  # (V,)
        self.is_eos = torch.arange(len(itos)) == eos_id  # (V,)
        self.count_ok = torch.zeros(self.max_count + 1, dtype=torch.bool)  # (max_count + 1,)
        self.count_ok[counts] = True

    def _tables(self, device):
        if self.is_number.device != device:
            self.is_number, self.is_op, self.is_eos, self.count_ok = (
                x.to(device) for x in (self.is_number, self.is_op, self.is_eos, self.count_ok))

    def start(self, owner: Tensor) -> dict:
        zeros = torch.zeros(len(owner), dtype=torch.long, device=owner.device)  # (N,)
        return {"depth": zeros, "used": zeros.clone(), "done": torch.zeros_like(zeros, dtype=torch.bool)}

    def allowed(self, state: dict) -> Tensor:
        """(N, V): numbers while some are left, operators on two values, eos on one complete expression."""
        depth, used = state["depth"], state["used"]
        self._tables(depth.device)
        can_end = (depth == 1) & self.count_ok[used.clamp(max=self.max_count)]  # (N,)
        out = ((self.is_number[None] & (used < self.max_count)[:, None])
               | (self.is_op[None] & (depth >= 2)[:, None]) | (self.is_eos[None] & can_end[:, None]))  # (N, V)
        return out & ~state["done"][:, None]

    def advance(self, state: dict, tokens: Tensor) -> dict:
        """Read tokens (N,): a number pushes a value, an operator pops two and pushes one; any token is safe."""
        self._tables(tokens.device)
        num, op = self.is_number[tokens].long(), self.is_op[tokens].long()  # (N,)
        return {"depth": state["depth"] + num - op, "used": state["used"] + num,
                "done": state["done"] | self.is_eos[tokens]}


def _is_int(token: str) -> bool:
    try:
        int(token)
    except ValueError:
        return False
    return True
