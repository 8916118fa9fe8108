"""Seeded generation of Karel tasks with the heuristics of Bunel et al. (2018).

A task (`Example`) is a program and `n_pairs` (input, output) world pairs: the first `n_pairs - 1` are
the specification, the last one is held out. `sample_example` draws programs from the grammar (nesting
and length limits) and keeps one only when

- it is canonical (`is_canonical`): no spurious action pairs `turnLeft turnRight`, `turnRight turnLeft`,
  `pickMarker putMarker`, `putMarker pickMarker` adjacent in the token stream, no four identical turns in
  a row, no IFELSE with identical branches, no negated IFELSE condition (that is the same IFELSE with its
  branches swapped), no negated marker condition (`noMarkersPresent` says `not c( markersPresent c)`);
  the sampler never draws the negations in the first place;
- it has not been drawn before (the caller's `taken` set of program strings, shared by all splits);
- random worlds give `n_pairs` distinct inputs on which it neither crashes nor times out and changes the
  world (output != input), and over those pairs every branch is exercised: each IF and IFELSE test is
  seen both true and false, each WHILE body is entered at least once.

Worlds are `rows x cols` grids where each cell is a wall with probability `wall_prob`, otherwise holds
1..`max_markers` markers (uniformly) with probability `marker_prob`; the hero stands on a uniformly drawn
free cell facing a uniformly drawn direction. Programs are drawn from one `random.Random`, which also
seeds the numpy generator of each program's worlds, so one seed fixes the result.
Speed: see `twophase/tasks/karel/__init__.py`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, fields

import numpy as np

from .dsl import ACTIONS, CONDITIONS, Action, Cond, If, IfElse, Program, Repeat, While
from .execute import branches, trace
from .world import MAX_MARKERS, World

SPURIOUS_PAIRS = frozenset({("turnLeft", "turnRight"), ("turnRight", "turnLeft"),
                            ("pickMarker", "putMarker"), ("putMarker", "pickMarker")})
_SPATIAL = ("frontIsClear", "leftIsClear", "rightIsClear")


@dataclass(frozen=True)
class GeneratorParams:
    """Knobs of the generator; every field is part of the dataset's cache key."""
    rows: int = 8
    cols: int = 8
    wall_prob: float = 0.1
    marker_prob: float = 0.1
    max_markers: int = 5          # a marked cell holds 1..max_markers markers
    max_depth: int = 3            # control statements nested at most this deep
    max_tokens: int = 30          # whole program, DEF run m( ... m) included
    max_block: int = 3            # statements per block: 1..max_block
    control_prob: float = 0.35    # chance that a statement (above max_depth) is REPEAT/WHILE/IF/IFELSE
    negate_prob: float = 0.25     # chance that an IF/WHILE spatial condition is `not c( X c)`
    repeat_min: int = 2
    repeat_max: int = 10
    max_ticks: int = 200
    n_pairs: int = 6              # n_pairs - 1 specification pairs and one held-out pair
    world_tries: int = 30         # random worlds tried per program before giving it up

    def __post_init__(self):
        # wall_prob=0 and wall_prob=0.0 must make the same cache key.
        for name in ("wall_prob", "marker_prob", "control_prob", "negate_prob"):
            object.__setattr__(self, name, float(getattr(self, name)))
        checks = {"rows": 1 <= self.rows <= 64, "cols": 1 <= self.cols <= 64,
                  "wall_prob": 0 <= self.wall_prob < 1, "marker_prob": 0 <= self.marker_prob <= 1,
                  "max_markers": 1 <= self.max_markers <= MAX_MARKERS, "max_depth": self.max_depth >= 0,
                  "max_tokens": self.max_tokens >= 5, "max_block": self.max_block >= 1,
                  "control_prob": 0 <= self.control_prob <= 1, "negate_prob": 0 <= self.negate_prob <= 1,
                  "repeat_min": 0 <= self.repeat_min <= self.repeat_max,
                  "repeat_max": self.repeat_min <= self.repeat_max <= 19, "max_ticks": self.max_ticks >= 1,
                  "n_pairs": self.n_pairs >= 2, "world_tries": self.world_tries >= self.n_pairs}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"karel generator: bad {name}={getattr(self, name)!r}")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Example:
    """A program (canonical token string) and its (input, output) pairs; the last pair is held out."""
    program: str
    pairs: tuple

    @property
    def spec(self) -> tuple:
        return self.pairs[:-1]

    @property
    def held_out(self) -> tuple:
        return self.pairs[-1]


def sample_program(rng: random.Random, p: GeneratorParams) -> Program:
    """A program from the grammar with at most `p.max_depth` nested control statements (length unchecked)."""
    return Program(_sample_block(rng, p, 0))


def _sample_block(rng: random.Random, p: GeneratorParams, depth: int) -> tuple:
    return tuple(_sample_stmt(rng, p, depth) for _ in range(rng.randint(1, p.max_block)))


def _sample_stmt(rng: random.Random, p: GeneratorParams, depth: int):
    if depth >= p.max_depth or rng.random() >= p.control_prob:
        return Action(rng.choice(ACTIONS))
    kind = rng.randrange(4)
    if kind == 0:
        return Repeat(rng.randint(p.repeat_min, p.repeat_max), _sample_block(rng, p, depth + 1))
    name = rng.choice(CONDITIONS)
    negated = kind != 3 and name in _SPATIAL and rng.random() < p.negate_prob
    cond = Cond(name, negated)
    if kind == 1:
        return While(cond, _sample_block(rng, p, depth + 1))
    if kind == 2:
        return If(cond, _sample_block(rng, p, depth + 1))
    return IfElse(cond, _sample_block(rng, p, depth + 1), _sample_block(rng, p, depth + 1))


def is_canonical(program: Program) -> bool:
    """False for a spurious adjacent action pair, four identical turns in a row, an IFELSE with equal arms
    or a negated condition, or a negated marker condition: each has a shorter or a canonical equivalent."""
    toks = program.tokens()
    for i in range(len(toks) - 1):
        if (toks[i], toks[i + 1]) in SPURIOUS_PAIRS:
            return False
        if toks[i] in ("turnLeft", "turnRight") and toks[i:i + 4] == [toks[i]] * 4:
            return False
    return not _redundant(program.body)


def _redundant(block: tuple) -> bool:
    for node in block:
        if isinstance(node, IfElse) and (node.then == node.orelse or node.cond.negated):
            return True
        if isinstance(node, (While, If)) and node.cond.negated and node.cond.name not in _SPATIAL:
            return True
        if any(_redundant(getattr(node, arm)) for arm in ("body", "then", "orelse") if hasattr(node, arm)):
            return True
    return False


def sample_world(rng: np.random.Generator, p: GeneratorParams) -> World:
    """A random world (see the module docstring); redrawn in the rare case that every cell is a wall."""
    while True:
        u = rng.random((p.rows, p.cols))
        wall = u < p.wall_prob
        if not wall.all():
            break
    # Given no wall, v = (u - wall_prob) / (1 - wall_prob) is uniform again: markers if v < marker_prob,
    # and then v / marker_prob is uniform once more and picks the count, so one draw per cell suffices.
    v = (u - p.wall_prob) / (1.0 - p.wall_prob)
    marked = ~wall & (v < p.marker_prob)
    walls = np.ones((p.rows + 2, p.cols + 2), np.uint8)  # padded, see World
    walls[1:-1, 1:-1] = wall
    markers = np.zeros_like(walls)
    markers[1:-1, 1:-1][marked] = 1 + np.minimum(v[marked] / p.marker_prob * p.max_markers, p.max_markers - 1)
    free = np.flatnonzero(walls == 0)
    pos, d = free[rng.integers(len(free))], rng.integers(4)
    return World._make(p.rows, p.cols, walls.tobytes(), markers.tobytes(), int(pos), int(d))


def _cover(found: list, required: frozenset, n: int) -> list | None:
    """Indices of n pairs of `found` covering `required` (greedy set cover, then earliest), or None."""
    uncovered, chosen = set(required), []
    while uncovered:
        # Most new branches first; among equals, the earliest pair (hence -i).
        gain, neg_i = max(((len(found[i][2] & uncovered), -i) for i in range(len(found)) if i not in chosen),
                          default=(0, 0))
        if gain == 0:
            return None
        chosen.append(-neg_i)
        uncovered -= found[-neg_i][2]
    if len(chosen) > n:
        return None
    chosen += [i for i in range(len(found)) if i not in chosen][:n - len(chosen)]
    return chosen


def find_pairs(program: Program, rng: np.random.Generator, p: GeneratorParams) -> tuple | None:
    """`p.n_pairs` valid (input, output) pairs in random order (see the module docstring), or None."""
    required, found, seen, union = branches(program), [], set(), set()
    for _ in range(p.world_tries):
        world = sample_world(rng, p)
        if world in seen:
            continue
        seen.add(world)
        t = trace(program, world, p.max_ticks)
        if t.status != "ok" or t.world == world:
            continue
        found.append((world, t.world, t.coverage))
        union |= t.coverage
        if len(found) >= p.n_pairs and required <= union:
            chosen = _cover(found, required, p.n_pairs)
            if chosen is not None:
                chosen = [chosen[i] for i in rng.permutation(len(chosen))]
                return tuple((found[i][0], found[i][1]) for i in chosen)
    return None


def sample_example(rng: random.Random, p: GeneratorParams, taken: set, patience: int = 20000) -> Example:
    """A new task whose program is not in `taken`; every program string drawn is added to `taken`.

    Raises RuntimeError after `patience` program draws in a row without success (parameters too tight).
    """
    for _ in range(patience):
        program = sample_program(rng, p)
        text = str(program)
        if text in taken or len(program.tokens()) > p.max_tokens or not is_canonical(program):
            continue
        taken.add(text)  # also when rejected below: its worlds were random, but retrying costs more than it finds
        # Worlds come from numpy (vectorised, much faster than Python's random), seeded from `rng` so that one seed
        # fixes all.
        pairs = find_pairs(program, np.random.default_rng(rng.getrandbits(64)), p)
        if pairs is not None:
            return Example(text, pairs)
    raise RuntimeError(f"karel generator: no new valid program in {patience} draws; loosen the parameters")
