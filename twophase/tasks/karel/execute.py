"""The Karel interpreter, with the semantics of Bunel et al. (2018).

- `move` steps one cell forward; into a wall or off the grid it crashes. `turnLeft`/`turnRight` turn in
  place and never crash. `pickMarker` on a cell without markers crashes; `putMarker` on a cell that already
  holds ten crashes.
- `frontIsClear`/`leftIsClear`/`rightIsClear` are true when that neighbour cell is inside the grid and not
  a wall; `markersPresent`/`noMarkersPresent` look at the hero's cell; `not c( X c)` negates X.
- Every action and every condition test (each WHILE test, including the last, failing one) costs one
  tick; REPEAT's counter is free. A run that needs more than `max_ticks` ticks is a time-out, so a loop
  that only tests conditions still ends.

`execute(program, world)` returns the final world, or None on a syntax error, a crash or a time-out; it
is memoised on (program string, world, max_ticks) (the latest 32,768), so a candidate that is sampled
again, or scored again on the same worlds, is not run again. `run(parsed, world)` does the same for a tree from `parse`, and
`trace` also reports the outcome, the ticks used and which branches were taken (for the generator).

Programs are compiled once to nested Python closures (kept per parsed tree), so a run does no dispatch
on node types. Speed: see `twophase/tasks/karel/__init__.py`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from .dsl import Action, If, IfElse, Program, Repeat, While, _parse_text, try_parse
from .world import MAX_MARKERS, World


class _Stop(Exception):
    pass


class _Crash(_Stop):
    pass


class _TimeOut(_Stop):
    pass


class _State:
    """The mutable state of one run; positions index the padded grid of `World`."""
    __slots__ = ("pos", "dir", "ticks", "walls", "markers", "offsets", "cov")

    def __init__(self, world: World, max_ticks: int, cov: set | None):
        stride = world.cols + 2
        self.pos, self.dir, self.ticks, self.cov = world.pos, world.dir, max_ticks, cov
        self.walls, self.markers = world.walls, bytearray(world.markers)
        self.offsets = (-stride, 1, stride, -1)  # N E S W


# Each action and condition spends a tick first: `ticks` counts down the ticks still allowed.
def _move(st: _State) -> None:
    st.ticks -= 1
    if st.ticks < 0:
        raise _TimeOut
    p = st.pos + st.offsets[st.dir]
    if st.walls[p]:
        raise _Crash
    st.pos = p


def _turn_left(st: _State) -> None:
    st.ticks -= 1
    if st.ticks < 0:
        raise _TimeOut
    st.dir = (st.dir - 1) & 3


def _turn_right(st: _State) -> None:
    st.ticks -= 1
    if st.ticks < 0:
        raise _TimeOut
    st.dir = (st.dir + 1) & 3


def _pick_marker(st: _State) -> None:
    st.ticks -= 1
    if st.ticks < 0:
        raise _TimeOut
    if not st.markers[st.pos]:
        raise _Crash
    st.markers[st.pos] -= 1


def _put_marker(st: _State) -> None:
    st.ticks -= 1
    if st.ticks < 0:
        raise _TimeOut
    if st.markers[st.pos] >= MAX_MARKERS:
        raise _Crash
    st.markers[st.pos] += 1


_ACTIONS = {"move": _move, "turnLeft": _turn_left, "turnRight": _turn_right,
            "pickMarker": _pick_marker, "putMarker": _put_marker}
# Direction turn applied before looking at the neighbour: 0 ahead, -1 left, +1 right.
_LOOK = {"frontIsClear": 0, "leftIsClear": -1, "rightIsClear": 1}


def _condition(name: str, negated: bool) -> Callable[[_State], bool]:
    if name in _LOOK:
        turn, blocked_value = _LOOK[name], negated  # clear = not blocked; negated flips it

        def clear(st: _State) -> bool:
            st.ticks -= 1
            if st.ticks < 0:
                raise _TimeOut
            return bool(st.walls[st.pos + st.offsets[(st.dir + turn) & 3]]) == blocked_value
        return clear
    want_markers = (name == "markersPresent") != negated

    def markers(st: _State) -> bool:
        st.ticks -= 1
        if st.ticks < 0:
            raise _TimeOut
        return (st.markers[st.pos] > 0) == want_markers
    return markers


class _Compiler:
    """Turns a tree into closures; numbers IF/IFELSE/WHILE nodes in preorder for coverage keys.

    A branch key is (node number, True) for a taken IF/IFELSE then-branch or an entered WHILE body, and
    (node number, False) for an IF whose test failed or an IFELSE else-branch.
    """

    def __init__(self, coverage: bool):
        self.coverage, self.count, self.branches = coverage, 0, set()

    def block(self, stmts: tuple) -> Callable[[_State], None]:
        fns = tuple(self.stmt(s) for s in stmts)
        if len(fns) == 1:
            return fns[0]

        def run_block(st: _State) -> None:
            for f in fns:
                f(st)
        return run_block

    def stmt(self, node) -> Callable[[_State], None]:
        if isinstance(node, Action):
            return _ACTIONS[node.name]
        if isinstance(node, Repeat):
            body, times = self.block(node.body), range(node.times)

            def run_repeat(st: _State) -> None:
                for _ in times:
                    body(st)
            return run_repeat
        k, cond = self.count, _condition(node.cond.name, node.cond.negated)
        self.count += 1
        if isinstance(node, While):
            self.branches.add((k, True))
            return (self._while_cov if self.coverage else self._while)(cond, self.block(node.body), (k, True))
        self.branches.update(((k, True), (k, False)))
        then = self.block(node.body if isinstance(node, If) else node.then)
        orelse = self.block(node.orelse) if isinstance(node, IfElse) else None
        return (self._if_cov if self.coverage else self._if)(cond, then, orelse, k)

    @staticmethod
    def _while(cond, body, key):
        def run_while(st: _State) -> None:
            while cond(st):
                body(st)
        return run_while

    @staticmethod
    def _while_cov(cond, body, key):
        def run_while(st: _State) -> None:
            while cond(st):
                st.cov.add(key)
                body(st)
        return run_while

    @staticmethod
    def _if(cond, then, orelse, k):
        if orelse is None:
            def run_if(st: _State) -> None:
                if cond(st):
                    then(st)
            return run_if

        def run_ifelse(st: _State) -> None:
            if cond(st):
                then(st)
            else:
                orelse(st)
        return run_ifelse

    @staticmethod
    def _if_cov(cond, then, orelse, k):
        yes, no = (k, True), (k, False)

        def run_if(st: _State) -> None:
            if cond(st):
                st.cov.add(yes)
                then(st)
            else:
                st.cov.add(no)
                if orelse is not None:
                    orelse(st)
        return run_if


# id(tree) -> [tree, plain runner, coverage runner, branch keys]; the stored tree makes a reused id safe.
_COMPILED: dict[int, list] = {}


def _compiled(program: Program, coverage: bool) -> list:
    entry = _COMPILED.get(id(program))
    if entry is None or entry[0] is not program:
        if len(_COMPILED) >= 1 << 14:
            _COMPILED.clear()
        entry = _COMPILED[id(program)] = [program, None, None, None]
    slot = 2 if coverage else 1
    if entry[slot] is None:
        compiler = _Compiler(coverage)
        entry[slot] = compiler.block(program.body)
        entry[3] = frozenset(compiler.branches)
    return entry


def branches(program: Program) -> frozenset:
    """The branch keys (see `trace`) that a run set must cover for every branch to be exercised."""
    return _compiled(program, False)[3]


@dataclass(frozen=True)
class Trace:
    """How a run ended. status: "ok", "crash" or "timeout"; world: the final state (for a crash, the state
    before the crashing action); ticks: ticks spent; coverage: branch keys taken (see `branches`)."""
    status: str
    world: World
    ticks: int
    coverage: frozenset


def _check_ticks(max_ticks: int) -> None:
    if max_ticks < 0:
        raise ValueError(f"max_ticks must be >= 0, got {max_ticks}")


def run(program: Program, world: World, max_ticks: int = 200) -> World | None:
    """Run a parsed program; the final world, or None on a crash or a time-out."""
    _check_ticks(max_ticks)
    st = _State(world, max_ticks, None)
    try:
        _compiled(program, False)[1](st)
    except _Stop:
        return None
    return World._make(world.rows, world.cols, world.walls, bytes(st.markers), st.pos, st.dir)


def trace(program: Program, world: World, max_ticks: int = 200) -> Trace:
    """Run a parsed program, recording the outcome, the ticks spent and the branches taken."""
    _check_ticks(max_ticks)
    st = _State(world, max_ticks, set())
    status = "ok"
    try:
        _compiled(program, True)[2](st)
    except _Crash:
        status = "crash"
    except _TimeOut:
        status = "timeout"
    final = World._make(world.rows, world.cols, world.walls, bytes(st.markers), st.pos, st.dir)
    # The failing action or test spent its tick too, so a time-out reports max_ticks + 1.
    return Trace(status, final, max_ticks - st.ticks, frozenset(st.cov))


@functools.lru_cache(maxsize=1 << 15)
def _execute(text: str, world: World, max_ticks: int) -> World | None:
    program = try_parse(text)
    return None if program is None else run(program, world, max_ticks)


def execute(program: str | Sequence[str], world: World, max_ticks: int = 200) -> World | None:
    """Run a program given as text (or tokens): the final world, or None on a syntax error, crash or time-out."""
    return _execute(program if isinstance(program, str) else " ".join(program), world, max_ticks)


def clear_caches() -> None:
    """Forget memoised parses, compiled programs and executions (e.g. to measure uncached speed)."""
    _parse_text.cache_clear()
    _execute.cache_clear()
    _COMPILED.clear()
