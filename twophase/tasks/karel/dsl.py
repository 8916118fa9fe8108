"""The Karel DSL of Bunel et al. (2018): tokens, abstract syntax tree and parser.

A program is a whitespace-separated token string (or a sequence of tokens) of this grammar::

    prog   := DEF run m( block m)
    block  := stmt stmt*                                  (blocks are never empty)
    stmt   := ACTION
            | REPEAT R=n r( block r)                      (n in 0..19)
            | WHILE c( cond c) w( block w)
            | IF c( cond c) i( block i)
            | IFELSE c( cond c) i( block i) ELSE e( block e)
    cond   := COND | not c( COND c)
    ACTION := move | turnLeft | turnRight | pickMarker | putMarker
    COND   := frontIsClear | leftIsClear | rightIsClear | markersPresent | noMarkersPresent

Anything else (unknown token, empty block, missing or trailing token, R=20, ...) is a syntax error:
`parse` raises `KarelSyntaxError` (a `SyntaxError`) with a one-line message naming the token position;
`try_parse` returns None instead. Both are cached on the program string, so a program parsed once is
not parsed again when it is run on many worlds. Nesting deeper than `MAX_NESTING` control statements is
rejected as a syntax error so that the recursive parser and interpreter never exhaust Python's stack.

The tree is made of frozen dataclasses; `str(node)` is the canonical token string (single spaces), so
`str(parse(p)) == " ".join(p.split())` for every valid program `p`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence, Union

ACTIONS = ("move", "turnLeft", "turnRight", "pickMarker", "putMarker")
CONDITIONS = ("frontIsClear", "leftIsClear", "rightIsClear", "markersPresent", "noMarkersPresent")
REPEAT_COUNTS = tuple(range(20))
STRUCTURE = ("DEF", "run", "m(", "m)", "REPEAT", "r(", "r)", "WHILE", "w(", "w)", "IF", "IFELSE", "ELSE",
             "i(", "i)", "e(", "e)", "c(", "c)", "not")
# Every token a program may contain, in a fixed order (a model's output vocabulary can be built from it).
VOCAB = STRUCTURE + ACTIONS + CONDITIONS + tuple(f"R={n}" for n in REPEAT_COUNTS)
MAX_NESTING = 100


class KarelSyntaxError(SyntaxError):
    """A program that is not in the grammar; str(err) is one line naming the token position."""


class _Node:
    """Base of the tree nodes: str(node) is its canonical token string."""

    def tokens(self) -> list[str]:
        raise NotImplementedError

    def __str__(self) -> str:
        return " ".join(self.tokens())


@dataclass(frozen=True)
class Action(_Node):
    name: str

    def tokens(self) -> list[str]:
        return [self.name]


@dataclass(frozen=True)
class Cond(_Node):
    name: str
    negated: bool = False

    def tokens(self) -> list[str]:
        return ["not", "c(", self.name, "c)"] if self.negated else [self.name]


@dataclass(frozen=True)
class Repeat(_Node):
    times: int
    body: tuple

    def tokens(self) -> list[str]:
        return ["REPEAT", f"R={self.times}", "r(", *_block_tokens(self.body), "r)"]


@dataclass(frozen=True)
class While(_Node):
    cond: Cond
    body: tuple

    def tokens(self) -> list[str]:
        return ["WHILE", "c(", *self.cond.tokens(), "c)", "w(", *_block_tokens(self.body), "w)"]


@dataclass(frozen=True)
class If(_Node):
    cond: Cond
    body: tuple

    def tokens(self) -> list[str]:
        return ["IF", "c(", *self.cond.tokens(), "c)", "i(", *_block_tokens(self.body), "i)"]


@dataclass(frozen=True)
class IfElse(_Node):
    cond: Cond
    then: tuple
    orelse: tuple

    def tokens(self) -> list[str]:
        return ["IFELSE", "c(", *self.cond.tokens(), "c)", "i(", *_block_tokens(self.then), "i)",
                "ELSE", "e(", *_block_tokens(self.orelse), "e)"]


Stmt = Union[Action, Repeat, While, If, IfElse]


@dataclass(frozen=True)
class Program(_Node):
    body: tuple

    def tokens(self) -> list[str]:
        return ["DEF", "run", "m(", *_block_tokens(self.body), "m)"]


def _block_tokens(block: tuple) -> list[str]:
    return [tok for stmt in block for tok in stmt.tokens()]


def program_text(program: str | Sequence[str]) -> str:
    """The canonical string of a program given as a string or as a sequence of tokens."""
    return " ".join(program.split() if isinstance(program, str) else program)


class _Parser:
    """Recursive descent over a token list; `pos` is the index of the next token."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos = tokens, 0

    def fail(self, expected: str):
        if self.pos < len(self.tokens):
            raise KarelSyntaxError(f"token {self.pos + 1} {self.tokens[self.pos]!r}: expected {expected}")
        raise KarelSyntaxError(f"program ends after {len(self.tokens)} tokens: expected {expected}")

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expect(self, token: str) -> None:
        if self.peek() != token:
            self.fail(repr(token))
        self.pos += 1

    def program(self) -> Program:
        for tok in ("DEF", "run", "m("):
            self.expect(tok)
        body = self.block("m)", 0)
        if self.pos != len(self.tokens):
            self.fail("the end of the program after 'm)'")
        return Program(body)

    def block(self, closer: str, depth: int) -> tuple:
        """Statements up to and including `closer`; at least one."""
        stmts = [self.stmt(depth)]
        while self.peek() != closer:
            stmts.append(self.stmt(depth))
        self.pos += 1
        return tuple(stmts)

    def stmt(self, depth: int) -> Stmt:
        tok = self.peek()
        if tok in ACTIONS:
            self.pos += 1
            return Action(tok)
        if tok not in ("REPEAT", "WHILE", "IF", "IFELSE"):
            self.fail("an action or REPEAT/WHILE/IF/IFELSE")
        if depth >= MAX_NESTING:
            raise KarelSyntaxError(f"token {self.pos + 1} {tok!r}: nesting deeper than {MAX_NESTING}")
        self.pos += 1
        if tok == "REPEAT":
            times = self.repeat_count()
            self.expect("r(")
            return Repeat(times, self.block("r)", depth + 1))
        cond = self.cond_slot()
        if tok == "WHILE":
            self.expect("w(")
            return While(cond, self.block("w)", depth + 1))
        self.expect("i(")
        then = self.block("i)", depth + 1)
        if tok == "IF":
            return If(cond, then)
        self.expect("ELSE")
        self.expect("e(")
        return IfElse(cond, then, self.block("e)", depth + 1))

    def repeat_count(self) -> int:
        tok = self.peek() or ""
        digits = tok[2:]
        # isdecimal + no leading zero: only the 20 tokens R=0..R=19 of the vocabulary are accepted.
        if not (tok.startswith("R=") and digits.isdecimal() and str(int(digits)) == digits and int(digits) < 20):
            self.fail("a repeat count R=0 .. R=19")
        self.pos += 1
        return int(digits)

    def cond_slot(self) -> Cond:
        self.expect("c(")
        negated = self.peek() == "not"
        if negated:
            self.pos += 1
            self.expect("c(")
        name = self.peek()
        if name not in CONDITIONS:
            self.fail("a condition" + ("" if negated else " or 'not'"))
        self.pos += 1
        self.expect("c)")
        if negated:
            self.expect("c)")
        return Cond(name, negated)


@functools.lru_cache(maxsize=1 << 16)
def _parse_text(text: str) -> Program | KarelSyntaxError:
    # Errors are returned, not raised, so that lru_cache also remembers invalid programs.
    try:
        return _Parser(text.split()).program()
    except KarelSyntaxError as err:
        return err.with_traceback(None)  # a cached traceback would keep the parser's frames alive


def parse(program: str | Sequence[str]) -> Program:
    """The tree of `program`; raises KarelSyntaxError (one line, naming the token) if it is not valid."""
    result = _parse_text(program_text(program))
    if isinstance(result, KarelSyntaxError):
        raise KarelSyntaxError(str(result))
    return result


def try_parse(program: str | Sequence[str]) -> Program | None:
    """The tree of `program`, or None on a syntax error."""
    result = _parse_text(program_text(program))
    return None if isinstance(result, KarelSyntaxError) else result
