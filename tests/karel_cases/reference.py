"""A second, deliberately naive Karel interpreter for the tests: it walks the token list itself (no parser,
no tree, no closures) on a grid of characters read from `World.to_text()`, so it shares no code path with
twophase.tasks.karel except the text format. It assumes a syntactically valid program.

`reference_run(program, world_text, max_ticks)` returns (status, final world text, coverage) with status
"ok", "crash" or "timeout", the world as it was when the run stopped, and coverage a set of
(token index of IF/IFELSE/WHILE, outcome) for every test whose outcome led into a branch (WHILE: True only
when its body was entered).
"""
ACTIONS = {"move", "turnLeft", "turnRight", "pickMarker", "putMarker"}
STEP = {"N": (-1, 0), "E": (0, 1), "S": (1, 0), "W": (0, -1)}
COUNTS = ".123456789A"


class Stop(Exception):
    def __init__(self, status):
        self.status = status


def reference_run(program: str, world_text: str, max_ticks: int = 200):
    toks = program.split()
    head, *rows = world_text.split("\n")
    _, r, c, d = head.split()
    s = {"r": int(r), "c": int(c), "d": d, "ticks": 0, "grid": [list(row) for row in rows], "cov": set()}

    def tick():
        s["ticks"] += 1
        if s["ticks"] > max_ticks:
            raise Stop("timeout")

    def cell(r, c):
        g = s["grid"]
        return g[r][c] if 0 <= r < len(g) and 0 <= c < len(g[0]) else "#"

    def turned(d, k):  # k quarter turns clockwise
        return "NESW"[("NESW".index(d) + k) % 4]

    def closer(i):  # toks[i] opens a bracket; index of the matching closer
        depth = 0
        for j in range(i, len(toks)):
            depth += toks[j].endswith("(") - toks[j].endswith(")")
            if depth == 0:
                return j
        raise AssertionError("unbalanced")

    def test(i):  # toks[i] == "c(": (value, index after the matching "c)")
        if toks[i + 1] == "not":
            value, _ = test(i + 2)
            return not value, closer(i) + 1
        tick()
        name = toks[i + 1]
        if name == "markersPresent":
            value = cell(s["r"], s["c"]) not in ".#"
        elif name == "noMarkersPresent":
            value = cell(s["r"], s["c"]) == "."
        else:
            k = {"frontIsClear": 0, "leftIsClear": 3, "rightIsClear": 1}[name]
            dr, dc = STEP[turned(s["d"], k)]
            value = cell(s["r"] + dr, s["c"] + dc) != "#"
        return value, closer(i) + 1

    def act(name):
        tick()
        here = cell(s["r"], s["c"])
        if name == "move":
            dr, dc = STEP[s["d"]]
            if cell(s["r"] + dr, s["c"] + dc) == "#":
                raise Stop("crash")
            s["r"] += dr
            s["c"] += dc
        elif name in ("turnLeft", "turnRight"):
            s["d"] = turned(s["d"], 3 if name == "turnLeft" else 1)
        elif name == "pickMarker":
            if here == ".":
                raise Stop("crash")
            s["grid"][s["r"]][s["c"]] = COUNTS[COUNTS.index(here) - 1]
        else:
            if here == "A":
                raise Stop("crash")
            s["grid"][s["r"]][s["c"]] = COUNTS[COUNTS.index(here) + 1]

    def block(i, j):  # run toks[i:j]
        while i < j:
            t = toks[i]
            if t in ACTIONS:
                act(t)
                i += 1
            elif t == "REPEAT":
                end = closer(i + 2)
                for _ in range(int(toks[i + 1][2:])):
                    block(i + 3, end)
                i = end + 1
            elif t == "WHILE":
                while True:
                    value, body = test(i + 1)
                    if not value:
                        break
                    s["cov"].add((i, True))
                    block(body + 1, closer(body))
                i = closer(body) + 1
            else:  # IF / IFELSE
                value, body = test(i + 1)
                end = closer(body)
                s["cov"].add((i, value))
                if value:
                    block(body + 1, end)
                if t == "IFELSE":
                    else_end = closer(end + 2)
                    if not value:
                        block(end + 3, else_end)
                    end = else_end
                i = end + 1

    status = "ok"
    try:
        block(3, len(toks) - 1)
    except Stop as stop:
        status = stop.status
    lines = [f"hero {s['r']} {s['c']} {s['d']}"] + ["".join(row) for row in s["grid"]]
    return status, "\n".join(lines), s["cov"]


def required_branches(program: str) -> set:
    """What full coverage means, read off the tokens: both outcomes of each IF/IFELSE, WHILE entered."""
    need = set()
    for i, t in enumerate(program.split()):
        if t in ("IF", "IFELSE"):
            need |= {(i, True), (i, False)}
        elif t == "WHILE":
            need.add((i, True))
    return need
