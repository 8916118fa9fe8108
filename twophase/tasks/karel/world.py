"""Karel worlds: an immutable grid of walls and markers with the hero's position and direction.

Text format (`World.from_text` / `World.to_text`): the first line is `hero ROW COL DIR` (0-based, row 0 is
the northernmost row, column 0 the westernmost, DIR one of N E S W); then one line per row, north first,
one character per cell: `#` wall, `.` empty, `1`..`9` that many markers, `A` ten markers. For example::

    hero 1 0 E
    ..#
    .2.

A cell holds 0..10 markers; a wall holds none and the hero never stands on one. Outside the grid counts
as wall. Bad text raises ValueError with a one-line message `SOURCE:LINE: ...`.

Worlds are immutable by contract (nothing in this package mutates one; don't assign to their slots),
hashable (the hash is computed once) and compare by value, so they can key caches and be shared instead
of copied. Internally the grid is stored padded with a one-cell border of walls, row-major, as two
`bytes` objects (walls 0/1, marker counts), and the hero as a flat index into that padded grid, so that
the interpreter needs no bounds checks: a step in direction d adds `offsets[d]`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

DIRS = "NESW"
_CELL_CHARS = ".123456789A"
_TEXT_CELLS = "#" + _CELL_CHARS
_WALL_BYTES = bytes.maketrans(_TEXT_CELLS.encode(), bytes([1] + [0] * 11))
_TEXT_BYTES = np.frombuffer((_CELL_CHARS + "#").encode(), np.uint8)
_COUNT_BYTES = bytes.maketrans(_TEXT_CELLS.encode(), bytes([0] + list(range(11))))
MAX_MARKERS = 10


class World:
    """A grid with walls and markers, and the hero's cell and direction (see the module docstring).

    Public attributes: rows, cols, pos (flat index into the padded grid), dir (0..3 for N E S W), and the
    properties row, col, direction; walls and markers are the padded row-major bytes.
    """
    __slots__ = ("rows", "cols", "walls", "markers", "pos", "dir", "_hash")

    def __init__(self, *args):
        raise TypeError("build a World with World.from_text or World.from_arrays")

    @classmethod
    def _make(cls, rows: int, cols: int, walls: bytes, markers: bytes, pos: int, d: int) -> World:
        """Unchecked constructor from the padded representation (used by the interpreter)."""
        w = object.__new__(cls)
        w.rows, w.cols, w.walls, w.markers, w.pos, w.dir, w._hash = rows, cols, walls, markers, pos, d, None
        return w

    @classmethod
    def from_arrays(cls, walls: Sequence[Sequence[int]], markers: Sequence[Sequence[int]],
                    row: int, col: int, direction: str) -> World:
        """A world from row-major nested sequences (north row first); raises ValueError when inconsistent."""
        rows, cols = len(walls), len(walls[0]) if len(walls) else 0
        if rows == 0 or cols == 0:
            raise ValueError("a world needs at least one row and one column")
        if len(markers) != rows or any(len(r) != cols for r in walls) or any(len(r) != cols for r in markers):
            raise ValueError(f"walls and markers must both be {rows}x{cols}")
        stride = cols + 2
        pad_w = bytearray(b"\1" * (stride * (rows + 2)))
        pad_m = bytearray(stride * (rows + 2))
        for r in range(rows):
            for c in range(cols):
                n, wall = int(markers[r][c]), bool(walls[r][c])
                if not 0 <= n <= MAX_MARKERS or (wall and n):
                    raise ValueError(f"cell ({r}, {c}): {n} markers{' on a wall' if wall else ''}")
                pad_w[(r + 1) * stride + c + 1], pad_m[(r + 1) * stride + c + 1] = wall, n
        if not (0 <= row < rows and 0 <= col < cols) or direction not in DIRS or len(direction) != 1:
            raise ValueError(f"hero {row} {col} {direction!r} is not in the {rows}x{cols} grid facing N/E/S/W")
        if walls[row][col]:
            raise ValueError(f"hero {row} {col} stands on a wall")
        return cls._make(rows, cols, bytes(pad_w), bytes(pad_m), (row + 1) * stride + col + 1, DIRS.index(direction))

    @classmethod
    def from_text(cls, text: str, source: str = "world") -> World:
        """Parse the text format (see the module docstring); errors name `source` and the line."""
        lines = [line.strip() for line in text.strip("\n").split("\n")]
        head = lines[0].split() if lines else []
        if len(head) != 4 or head[0] != "hero" or not all(_is_int(x) for x in head[1:3]) or head[3] not in tuple(DIRS):
            raise ValueError(f"{source}:1: expected 'hero ROW COL DIR' with DIR in N E S W, got {lines[0][:40]!r}")
        grid = lines[1:]
        if not grid or not grid[0]:
            raise ValueError(f"{source}:2: expected the grid's first row")
        for i, line in enumerate(grid, start=2):
            if len(line) != len(grid[0]):
                raise ValueError(f"{source}:{i}: row of {len(line)} cells, the first row has {len(grid[0])}")
            bad = line.strip(_TEXT_CELLS)
            if bad:
                raise ValueError(f"{source}:{i}: bad cell {bad[0]!r} (expected # . 1-9 A)")
        rows, cols, stride = len(grid), len(grid[0]), len(grid[0]) + 2
        row, col, d = int(head[1]), int(head[2]), DIRS.index(head[3])
        if not (0 <= row < rows and 0 <= col < cols):
            raise ValueError(f"{source}:1: hero {row} {col} is outside the {rows}x{cols} grid")
        if grid[row][col] == "#":
            raise ValueError(f"{source}:1: hero {row} {col} stands on a wall")
        border = b"\1" * stride
        walls = border + b"".join(b"\1" + g.encode().translate(_WALL_BYTES) + b"\1" for g in grid) + border
        markers = bytes(stride) + b"".join(b"\0" + g.encode().translate(_COUNT_BYTES) + b"\0" for g in grid) \
            + bytes(stride)
        return cls._make(rows, cols, walls, markers, (row + 1) * stride + col + 1, d)

    def to_text(self) -> str:
        """The text format, rows joined by newlines, no final newline."""
        # Walls hold no markers, so markers + 11 * wall indexes ".123456789A#" (padding dropped).
        codes = np.frombuffer(self.markers, np.uint8) + 11 * np.frombuffer(self.walls, np.uint8)
        chars = _TEXT_BYTES[codes.reshape(self.rows + 2, self.cols + 2)[1:-1, 1:-1]]
        lines = [f"hero {self.row} {self.col} {DIRS[self.dir]}"]
        lines += [row.tobytes().decode() for row in chars]
        return "\n".join(lines)

    @property
    def row(self) -> int:
        return self.pos // (self.cols + 2) - 1

    @property
    def col(self) -> int:
        return self.pos % (self.cols + 2) - 1

    @property
    def direction(self) -> str:
        return DIRS[self.dir]

    def is_wall(self, row: int, col: int) -> bool:
        """True for walls and for cells outside the grid."""
        if not (0 <= row < self.rows and 0 <= col < self.cols):
            return True
        return bool(self.walls[(row + 1) * (self.cols + 2) + col + 1])

    def marker_count(self, row: int, col: int) -> int:
        return self.markers[(row + 1) * (self.cols + 2) + col + 1]

    def to_array(self) -> np.ndarray:
        """The 16-channel state of Bunel et al.: uint8 (16, rows, cols), 1 where true.

        Channels 0-3: the hero's cell, if facing N, E, S, W; 4: wall; 5: no markers; 5 + n: n markers (1..10).
        """
        stride = self.cols + 2
        walls = np.frombuffer(self.walls, np.uint8).reshape(self.rows + 2, stride)[1:-1, 1:-1]
        counts = np.frombuffer(self.markers, np.uint8).reshape(self.rows + 2, stride)[1:-1, 1:-1]
        out = np.zeros((16, self.rows, self.cols), np.uint8)
        out[self.dir, self.row, self.col] = 1
        out[4] = walls
        np.put_along_axis(out[5:], counts[None].astype(np.intp), 1, axis=0)
        return out

    def _key(self) -> tuple:
        return (self.rows, self.cols, self.pos, self.dir, self.walls, self.markers)

    def __eq__(self, other) -> bool:
        if not isinstance(other, World):
            return NotImplemented
        return self is other or self._key() == other._key()

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key())
        return self._hash

    def __reduce__(self):
        # The cached hash is left out: str/bytes hashes differ between processes.
        return World._make, (self.rows, self.cols, self.walls, self.markers, self.pos, self.dir)

    def __repr__(self) -> str:
        return f"World.from_text({self.to_text()!r})"


def _is_int(s: str) -> bool:
    return s.lstrip("-").isdecimal()
