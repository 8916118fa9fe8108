"""--task countdown: the checker and the solver against independent computations (Python's own evaluation of the
infix form, a brute-force enumeration of every RPN row), the grammar against an exhaustive enumeration of
well-formed rows, the generator's determinism and disjoint splits, TSV files (round trip, bad lines), and a tiny
train.py run end to end."""
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from twophase.tasks.countdown import problems, rpn
from twophase.tasks.countdown.grammar import RPNGrammar
from twophase.tasks.countdown.reward import countdown
from twophase.tasks.data import DataError
from twophase.train import decode
from twophase.vocab import EOS, SPECIALS

import forks

ROOT = Path(__file__).resolve().parents[2]


# ---- an independent evaluator: the RPN row as a tree (read from its end), printed in infix, evaluated by Python
class Exact(int):
    """An int whose `/` divides exactly or raises (the rule: integers at every step)."""

    def __add__(self, o): return Exact(int(self) + int(o))
    def __sub__(self, o): return Exact(int(self) - int(o))
    def __mul__(self, o): return Exact(int(self) * int(o))

    def __truediv__(self, o):
        if int(o) == 0 or int(self) % int(o):
            raise ArithmeticError
        return Exact(int(self) // int(o))


def infix(tokens: list[str]) -> str | None:
    """The infix form of an RPN row (fully parenthesised), by recursive descent from its last token; None where
    the row is not exactly one expression."""
    pos = len(tokens)

    def parse():
        nonlocal pos
        if pos == 0:
            raise SyntaxError
        pos -= 1
        tok = tokens[pos]
        if tok in "+-*/":
            right = parse()
            return f"({parse()} {tok} {right})"
        return f"Exact({int(tok)})"

    try:
        text = parse()
    except SyntaxError:
        return None
    return text if pos == 0 else None


def python_value(tokens: list[str]):
    text = infix(tokens)
    if text is None:
        return None
    try:
        return int(eval(text, {"Exact": Exact}))
    except ArithmeticError:
        return None


def random_row(rng: random.Random, numbers: list[int]) -> list[str]:
    """A random token row over the numbers and operators: sometimes well formed, sometimes not."""
    if rng.random() < 0.5:  # a well-formed one: numbers in random order, operators wherever two values wait
        order, out, depth = rng.sample(numbers, len(numbers)), [], 0
        while order or depth > 1:
            if order and (depth < 2 or rng.random() < 0.5):
                out.append(str(order.pop()))
                depth += 1
            else:
                out.append(rng.choice("+-*/"))
                depth -= 1
        return out
    return [rng.choice([*map(str, numbers), "+", "-", "*", "/"]) for _ in range(rng.randint(1, 7))]


def test_the_checker_agrees_with_python_evaluating_the_infix_form():
    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        numbers = [rng.randint(0, 12) for _ in range(rng.randint(1, 4))]
        row = random_row(rng, numbers)
        value = python_value(row)
        assert rpn.evaluate(row) == value, row
        target = value if value is not None and rng.random() < 0.7 else rng.randint(-5, 30)
        uses_each_once = sorted(t for t in row if t not in "+-*/") == sorted(map(str, numbers))
        expected = uses_each_once and value == target
        assert rpn.accepts(" ".join(row), numbers, target) == expected, (row, numbers, target)
        seen[expected] += 1
    assert min(seen.values()) > 300  # both answers were exercised
    assert rpn.evaluate("8 3 /".split()) is None and rpn.evaluate("8 0 /".split()) is None  # exact division only
    assert rpn.accepts("3 7 - 10 +", [10, 3, 7], 6)  # negative intermediates are allowed
    assert not rpn.accepts("3 3 +", [3], 6) and rpn.accepts("3 3 +", [3, 3], 6)  # each given number once


def test_the_solver_finds_exactly_the_values_a_brute_force_enumeration_reaches():
    rng = random.Random(1)
    for _ in range(12):
        numbers = [rng.randint(1, 12) for _ in range(rng.choice([1, 2, 3]))]
        n = len(numbers)
        brute = set()
        for order in itertools.permutations(numbers):
            for ops in itertools.product("+-*/", repeat=n - 1):
                for row in merges([str(x) for x in order], list(ops)):
                    v = python_value(row)
                    if v is not None:
                        brute.add(v)
        found = rpn.reachable(numbers)
        assert set(found) == brute, numbers
        assert all(rpn.accepts(expr, numbers, v) for v, expr in found.items())


def merges(nums: list[str], ops: list[str]) -> list[list[str]]:
    """Every row interleaving nums and ops (each in its order) in which the stack never runs short."""
    out = []

    def go(i, j, depth, row):
        if i == len(nums) and j == len(ops):
            out.append(row)
            return
        if i < len(nums):
            go(i + 1, j, depth + 1, row + [nums[i]])
        if j < len(ops) and depth >= 2:
            go(i, j + 1, depth - 1, row + [ops[j]])

    go(0, 0, 0, [])
    return out


def test_the_grammar_allows_exactly_the_prefixes_of_well_formed_rows():
    itos = list(SPECIALS) + ["+", "-", "1", "2"]
    V, max_len = len(itos), 6
    for counts in ([2], [1, 3]):
        g = RPNGrammar(itos, EOS, counts, max_len)
        words = list(range(len(SPECIALS), V))
        complete = {tuple(row) for n in range(1, max_len) for row in itertools.product(words, repeat=n)
                    if infix([itos[t] for t in row]) is not None
                    and sum(itos[t] in "12" for t in row) in counts}
        prefixes = {row[:k] for row in complete for k in range(len(row) + 1)}
        states = sorted(prefixes, key=len)
        for prefix in states:  # every allowed prefix: its allowed tokens are its extensions towards a complete row
            state = g.start(torch.zeros(1, dtype=torch.long))
            for t in prefix:
                state = g.advance(state, torch.tensor([t]))
            allowed = set(g.allowed(state)[0].nonzero().squeeze(1).tolist())
            expected = {t for t in words if prefix + (t,) in prefixes} | ({EOS} if prefix in complete else set())
            assert allowed == expected, ([itos[t] for t in prefix], counts)
    with pytest.raises(ValueError, match="--max-len 5 cannot hold an expression of 3 numbers"):
        RPNGrammar(itos, EOS, [3], 5)


def test_generation_is_deterministic_with_disjoint_splits_and_the_hidden_share():
    counts, params = {"train": 400, "valid": 50, "test": 50}, problems.Params(numbers=3, max_number=9, hidden=0.25)
    a, b = problems.generate(counts, params, seed=3), problems.generate(counts, params, seed=3)
    assert a == b and a != problems.generate(counts, params, seed=4)
    keys = [{p.key for p in a[s]} for s in problems.SPLITS]
    assert [len(k) for k in keys] == [400, 50, 50] and not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    assert sum(not p.solution for p in a["train"]) == 100
    for p in a["valid"] + a["test"] + [p for p in a["train"] if p.solution]:  # every shown solution is right
        assert 1 <= p.target <= 100 and max(p.numbers) <= 9 and python_value(p.solution.split()) == p.target
    assert all(rpn.solve(p.numbers, p.target) for p in a["train"])  # the hidden ones have a solution too


def test_tsv_round_trip_and_bad_lines_name_file_and_line(tmp_path):
    split = problems.generate({"train": 30, "valid": 0, "test": 0}, problems.Params(hidden=0.5))["train"]
    path = tmp_path / "p.tsv"
    problems.write_tsv(path, split)
    assert problems.read_tsv(path) == split
    (tmp_path / "q.tsv").write_text("3 4 = 7\t3 4 +\n2 5 10\n2 5 10\t\n")  # `=` optional, solution optional
    assert problems.read_tsv(tmp_path / "q.tsv") == [problems.Problem((3, 4), 7, "3 4 +"),
                                                     problems.Problem((2, 5), 10), problems.Problem((2, 5), 10)]
    for line, message in (("3 x = 7\t", "'x' is not an integer"), ("7\t", "expected numbers then the target"),
                          ("3 4 = 7\t3 4 *", "the solution '3 4 \\*' is not accepted"),
                          ("3 4 = 7\t3 4 +\tx", "expected 'SOURCE<TAB>SOLUTION'")):
        (tmp_path / "bad.tsv").write_text(f"3 4 = 7\t4 3 +\n{line}\n")
        with pytest.raises(DataError, match=f"^{tmp_path / 'bad.tsv'}:2: {message}"):
            problems.read_tsv(tmp_path / "bad.tsv")


def test_the_reward_reads_the_problem_from_its_source():
    assert countdown(["3 7 + 25 *", "3 7 * 25 +", "3 25 * 7 +"], [[], [], []],
                     ["3 7 25 = 250", "3 7 25 = 46", "3 7 25 250"]) == [1.0, 1.0, 0.0]


def test_train_py_runs_countdown_end_to_end_and_records_its_files(tmp_path):
    save = tmp_path / "run"
    proc = forks.run(argv=[ROOT / "train.py", "--task", "countdown", "--train-size", "200", "--valid-size", "20",
                           "--countdown-max", "9", "--mle-steps", "20", "--rl-steps", "4", "--eval-every", "10",
                           "--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--beam-size", "3",
                           "--eval-beam", "3", "--save-dir", save, "--rescore-chunk", "16"],
                     env={"TWOPHASE_CACHE_DIR": str(tmp_path / "cache")}, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "200 train problems (160 without a solution: RL only) / 20 valid / 20 test" in proc.stdout
    assert "solves 100.00% of the 20 test problems" in proc.stdout
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    tests = [r for r in rows if r["phase"] == "test"]
    assert len(tests) == 3 and all(0 <= r["solved"] <= r["solved_at_k"] <= 1 for r in tests)
    config = json.loads((save / "config.json").read_text())["config"]
    assert Path(config["train"]).parent.parent == tmp_path / "cache" / "countdown" and config["grammar"] == "on"
    assert len(problems.read_tsv(config["test"])) == 20
    out = tmp_path / "decoded.txt"  # the recorded test file decodes as it is (SOURCE<TAB>SOLUTION lines)
    assert decode.main(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", config["test"],
                        "--output", str(out), "--beam-size", "3"]) == 0
    decoded = out.read_text().splitlines()
    assert len(decoded) == 20 and all(infix(line.split()) and len(line.split()) == 5 for line in decoded)  # grammar
    (tmp_path / "bad.tsv").write_text("3 4 = 7\t3 4 +\n3 4 = 7\t3 4 -\n")
    proc = forks.run(argv=[ROOT / "train.py", "--task", "countdown", "--valid", tmp_path / "bad.tsv",
                           "--train-size", "200", "--valid-size", "20", "--countdown-max", "9",
                           "--save-dir", tmp_path / "run2"],
                     env={"TWOPHASE_CACHE_DIR": str(tmp_path / "cache")}, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(f"{tmp_path / 'bad.tsv'}:2: the solution "
                                                                 "'3 4 -' is not accepted: it must use each of "
                                                                 "3 4 once (RPN, exact division) and equal 7")
