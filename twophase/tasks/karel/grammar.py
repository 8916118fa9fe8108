"""The Karel DSL (`dsl.py`) as a pushdown automaton in tensors: a grammar for `twophase.constraints.Constrained`.

The automaton is the grammar's LL(1) parser. Its stack holds the symbols still to be read, top last: a terminal
(one expected token), or a nonterminal whose production the next token chooses (every production of the DSL
starts with a distinct token). Reading token y with X on top pops X and pushes the rest of X's production for y.
The nonterminals (x one of the block kinds m, r, w, i, e, named by their closing tokens m) r) w) i) e)):

    PROG    := DEF run m( BLOCK_m                 END  := eos
    BLOCK_x := STMT REST_x                        REST_x := STMT REST_x | x)
    STMT    := ACTION | REPEAT COUNT r( BLOCK_r | WHILE c( COND c) w( BLOCK_w | IF c( COND c) i( BLOCK_i
             | IFELSE c( COND c) i( BLOCK_i ELSE e( BLOCK_e            (STMT is inlined into BLOCK_x and REST_x)
    COND    := CONDITION | not c( NAME c)         NAME := CONDITION    COUNT := R=0 | ... | R=19

so a state is a stack of symbol ids; a sequence starts with [END, PROG] and is complete once END is read.

The length cut: every symbol needs a fixed minimum of tokens (BLOCK_x two: an action and its closer; PROG five),
and the symbols on the stack are derived independently, so the fewest tokens that complete a prefix are the sum
over its stack (`need`, eos included). A token is allowed only where the prefix, the token and what the new
stack needs fit in max_len positions: a constrained search is never cut off mid-program, and every program of
at most max_len - 1 tokens stays reachable. The parser's nesting limit (`dsl.MAX_NESTING`) needs more than 400
tokens, which max_len may not exceed.

Letters: N rows, D stack capacity, P longest production pushed, S symbols, V vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .dsl import ACTIONS, CONDITIONS, MAX_NESTING, REPEAT_COUNTS

BLOCKS = ("m", "r", "w", "i", "e")
TERMINALS = ("run", "m(", "r(", "c(", "c)", "w(", "i(", "ELSE", "e(")
SYMBOLS = (("PROG", "END", "COUNT", "COND", "NAME") + tuple(f"BLOCK_{x}" for x in BLOCKS)
           + tuple(f"REST_{x}" for x in BLOCKS) + tuple(f"'{t}'" for t in TERMINALS))
MIN_TOKENS = {"PROG": 5, **{f"BLOCK_{x}": 2 for x in BLOCKS}}  # every other symbol: 1
SHORTEST = 6  # DEF run m( move m) and eos
LONGEST = 4 * MAX_NESTING  # a program this long cannot nest deeper than the parser allows


def productions(eos: str) -> dict:
    """symbol -> {token: the symbols that follow it, in reading order}."""
    stmt = {a: [] for a in ACTIONS}
    stmt["REPEAT"] = ["COUNT", "'r('", "BLOCK_r"]
    cond = ["'c('", "COND", "'c)'"]
    stmt["WHILE"] = cond + ["'w('", "BLOCK_w"]
    stmt["IF"] = cond + ["'i('", "BLOCK_i"]
    stmt["IFELSE"] = cond + ["'i('", "BLOCK_i", "'ELSE'", "'e('", "BLOCK_e"]
    table = {"PROG": {"DEF": ["'run'", "'m('", "BLOCK_m"]}, "END": {eos: []},
             "COUNT": {f"R={n}": [] for n in REPEAT_COUNTS}, "NAME": {c: [] for c in CONDITIONS},
             "COND": {**{c: [] for c in CONDITIONS}, "not": ["'c('", "NAME", "'c)'"]}}
    for x in BLOCKS:
        table[f"BLOCK_{x}"] = {tok: rest + [f"REST_{x}"] for tok, rest in stmt.items()}
        table[f"REST_{x}"] = {**table[f"BLOCK_{x}"], f"{x})": []}
    for t in TERMINALS:
        table[f"'{t}'"] = {t: []}
    return table


class KarelGrammar:
    """`start`/`allowed`/`advance` (twophase.constraints) over a vocabulary `ids` (token -> id, every DSL token
    in it) of `vocab_size` ids, sequences of at most max_len positions, eos included."""

    def __init__(self, ids: dict, vocab_size: int, eos_id: int, max_len: int):
        if max_len < SHORTEST:
            raise ValueError(f"--max-len {max_len} cannot hold the shortest Karel program (5 tokens and EOS)")
        if max_len > LONGEST:
            raise ValueError(f"--max-len {max_len}: the Karel grammar handles at most {LONGEST} (beyond it, "
                             f"the parser's nesting limit of {MAX_NESTING} would matter)")
        self.max_len, self.eos_id = max_len, eos_id
        sym = {s: k for k, s in enumerate(SYMBOLS)}
        table = productions("<eos>")
        missing = sorted({t for rules in table.values() for t in rules if t != "<eos>"} - set(ids))
        if missing:
            raise ValueError(f"the vocabulary lacks Karel tokens: {', '.join(missing)}")
        S, V = len(SYMBOLS), vocab_size
        self.P = max(len(rest) for rules in table.values() for rest in rules.values())
        self.n_push = torch.full((S, V), -1, dtype=torch.long)  # (S, V) symbols pushed; -1: not allowed
        self.push = torch.zeros(S, V, self.P, dtype=torch.long)  # (S, V, P) pushed symbols, bottom first
        self.delta = torch.zeros(S, V, dtype=torch.long)  # (S, V) change of `need` when the token is read
        for s, rules in table.items():
            for tok, rest in rules.items():
                v = eos_id if tok == "<eos>" else ids[tok]
                self.n_push[sym[s], v] = len(rest)
                self.push[sym[s], v, :len(rest)] = torch.tensor([sym[r] for r in reversed(rest)], dtype=torch.long)
                self.delta[sym[s], v] = sum(MIN_TOKENS.get(r, 1) for r in rest) - MIN_TOKENS.get(s, 1)
        self.bottom = torch.tensor([sym["END"], sym["PROG"]])
        self.D = max_len + self.P + 1  # the cut keeps the stack within max_len symbols; the rest is headroom

    def _tables(self, device):
        if self.n_push.device != device:
            self.n_push, self.push, self.delta, self.bottom = (x.to(device) for x in
                                                               (self.n_push, self.push, self.delta, self.bottom))
        return self.n_push, self.push, self.delta

    def start(self, owner: Tensor) -> dict:
        N, device = len(owner), owner.device
        self._tables(device)
        stack = torch.zeros(N, self.D, dtype=torch.long, device=device)
        stack[:, :2] = self.bottom
        return {"stack": stack, "depth": torch.full((N,), 2, dtype=torch.long, device=device),
                "need": torch.full((N,), SHORTEST, dtype=torch.long, device=device),  # END 1 + PROG 5
                "pos": torch.zeros(N, dtype=torch.long, device=device)}

    def _top(self, state: dict) -> Tensor:
        return state["stack"].gather(1, (state["depth"] - 1).clamp(min=0)[:, None]).squeeze(1)  # (N,)

    def allowed(self, state: dict) -> Tensor:
        """(N, V) tokens the top symbol reads whose completion still fits in max_len (nothing once complete)."""
        n_push, _, delta = self._tables(state["depth"].device)
        top = self._top(state)
        fits = (state["pos"] + 1 + state["need"])[:, None] + delta[top] <= self.max_len  # (N, V)
        return (n_push[top] >= 0) & fits & (state["depth"] > 0)[:, None]

    def advance(self, state: dict, tokens: Tensor) -> dict:
        """Read tokens (N,): pop the top, push its production's rest. Any token is safe: a disallowed one pushes
        nothing (the row is dead to `Constrained` anyway)."""
        n_push, push, delta = self._tables(tokens.device)
        stack, depth = state["stack"], state["depth"]
        top = self._top(state)
        k = n_push[top, tokens].clamp(min=0)  # (N,)
        at = ((depth - 1).clamp(min=0)[:, None] + torch.arange(self.P, device=tokens.device)).clamp(max=self.D - 1)
        stack = stack.scatter(1, at, push[top, tokens])  # (N, D); writes above the new top are never read
        open_ = depth > 0
        return {"stack": stack, "depth": torch.where(open_, depth - 1 + k, depth),
                "need": state["need"] + torch.where(open_, delta[top, tokens], 0), "pos": state["pos"] + 1}


def karel_grammar(vocab, max_len: int) -> KarelGrammar:
    """The grammar over a `twophase.vocab.Vocab` holding the DSL's tokens."""
    from ...vocab import EOS
    return KarelGrammar(vocab.stoi, len(vocab), EOS, max_len)
