"""Karel as Bunel et al. (issue 18): split statistics, the baselines, a random 5 of 6 pairs per training
presentation with cached grid arrays, and the execution-filtered top-1 over the beam."""
import json
import random

import numpy as np
import pytest

from twophase.tasks.karel import World, baselines, generate_dataset, stats
from twophase.tasks.karel.generate import Example as Generated
from twophase.tasks.karel.grids import PairSet, batch_grids, pair_array
from twophase.tasks.karel.task import Karel, as_example
from twophase.config import Config

SMALL = dict(rows=5, cols=5, max_tokens=20)
P = "DEF run m( {} m)"


def world(col, direction="E", row=0):
    return World.from_text(f"hero {row} {col} {direction}\n....\n....")


def move_task(n_pairs=6):
    """A task whose program is `move`: pair k moves the hero from (k % 2, 0) to (k % 2, 1), facing E or S."""
    pairs = tuple((world(0, "E", k % 2), world(1, "E", k % 2)) for k in range(n_pairs - 1))
    return Generated(P.format("move"), pairs + ((world(2, "E"), world(3, "E")),))


@pytest.fixture(scope="module")
def small():
    return generate_dataset(30, 6, 12, seed=5, cache_dir=None, **SMALL)


def test_split_stats_by_hand():
    programs = [P.format("move"), P.format("REPEAT R=2 r( move r)"),
                P.format("WHILE c( frontIsClear c) w( IF c( markersPresent c) i( move i) w) turnLeft")]
    got = stats.split_stats([Generated(p, ()) for p in programs])
    assert got["n"] == 3 and got["mean_tokens"] == pytest.approx((5 + 9 + 18) / 3)
    assert got["straight_line"] == pytest.approx(1 / 3)
    assert got["depths"] == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})
    table = stats.format_stats({"train": [Generated(p, ()) for p in programs]})
    assert table.splitlines()[1].split() == ["train", "3", "10.67", "33.3%", "33.3%", "33.3%", "33.3%"]


def test_enumeration_finds_the_first_consistent_straight_line_program():
    assert len(baselines.straight_line_programs()) == 780
    assert baselines.enumeration(move_task()) == P.format("move")
    turn = Generated("x", tuple((world(0, "E"), world(0, "W")) for _ in range(6)))
    assert baselines.enumeration(turn) == P.format("turnLeft turnLeft")  # the shortest, then ACTIONS order
    stuck = Generated("x", ((world(0, "E"), world(3, "E", 1)),) * 6)  # 4 actions cannot get there
    assert baselines.enumeration(stuck) is None


def test_retrieval_first_and_most_frequent_behaviour():
    train = [Generated(P.format(p), ()) for p in (
        "turnLeft", "move turnRight turnLeft move",  # the second: fails the spec (two moves)
        "REPEAT R=1 r( move r)", "IF c( frontIsClear c) i( move i)", "move", "WHILE c( noMarkersPresent c) w( move w)")]
    index = baselines.Retrieval(train, baselines.GeneratorParams(rows=2, cols=4))
    task = move_task()
    found = index.matches(task)
    assert [train[i].program for i in found][:3] == [P.format("REPEAT R=1 r( move r)"),
                                                     P.format("IF c( frontIsClear c) i( move i)"), P.format("move")]
    assert index.first(found) == P.format("REPEAT R=1 r( move r)")
    # REPEAT R=1 and move are one function; IF frontIsClear another (no crash at a wall): the pair wins.
    assert index.behaviour[2] == index.behaviour[4] != index.behaviour[3]
    assert index.frequent(found) == P.format("REPEAT R=1 r( move r)")
    assert index.first([]) is None and index.frequent([]) is None
    scores = baselines.score([index.first(found), None], [task, task])
    # The held-out pair (hero at column 2 moving to 3) passes with move: generalises.
    assert scores == {"generalization": 0.5, "spec_accuracy": 0.5, "exact_match": 0.0, "n": 2}


def test_baselines_report_is_cached_and_the_command_prints_it(small, tmp_path, monkeypatch, capsys):
    lines = baselines.cached_report(small, "k", tmp_path)
    assert lines[0].startswith("baselines (30 training programs)") and len(lines) == 4
    monkeypatch.setattr(baselines, "evaluate", lambda *a: pytest.fail("recomputed"))
    assert baselines.cached_report(small, "k", tmp_path) == lines
    figures = json.loads((tmp_path / f"k.baselines-v{baselines.VERSION}.json").read_text())
    assert set(figures) == {"valid", "test"} and figures["test"]["enumeration"]["n"] == 12
    monkeypatch.setenv("TWOPHASE_CACHE_DIR", str(tmp_path))
    assert baselines.main(["--splits", "nope"]) == 2 and "--splits" in capsys.readouterr().err


def test_present_shows_a_random_5_of_6_pairs_and_the_reward_reads_all_6_or_those(small):
    task = Karel(Config(task="karel"))
    shown_only = Karel(Config(task="karel", karel_reward_pairs="shown"))
    gen = small["train"][0]
    ex = as_example(gen, train=True)
    assert list(ex.source) == list(gen.spec) and ex.hidden["held_out"] == gen.held_out
    random.seed(0)
    views = [task.present([ex])[0] for _ in range(40)]
    held = {gen.pairs.index(v.hidden["held_out"]) for v in views}
    assert held == set(range(6))  # every pair is held out at some presentation
    for v in views:
        assert len(v.source) == 5 and v.fields["spec"] == gen.pairs and v.hidden["held_out"] not in v.source
        assert set(v.source) | {v.hidden["held_out"]} == set(gen.pairs) and v.references == ex.references
        np.testing.assert_array_equal(v.source.grids, np.stack([pair_array(p) for p in v.source]))
    random.seed(0)
    again = [shown_only.present([ex])[0] for _ in range(40)]
    assert [v.source for v in again] == [v.source for v in views]  # reproducible
    assert all(v.fields["spec"] is v.source for v in again)
    fixed = as_example(small["valid"][0])
    assert task.present([fixed]) == [fixed]  # validation and test keep their spec and held-out pair


def test_cached_grids_equal_rebuilt_ones(small):
    specs = [as_example(t).source for t in small["test"][:4]]
    got = batch_grids(specs)
    assert got.dtype == np.uint8 and got.shape == (4, 5, 32, 5, 5)
    assert specs[0].packed.shape == (5, 4, 5, 5)  # kept 8 channels to a byte
    np.testing.assert_array_equal(got, np.stack([[pair_array(p) for p in s] for s in specs]))
    np.testing.assert_array_equal(batch_grids([tuple(s) for s in specs]), got)  # plain tuples too
    sub = PairSet(small["test"][0].pairs).subset([4, 1])
    np.testing.assert_array_equal(sub.grids, np.stack([pair_array(small["test"][0].pairs[i]) for i in (4, 1)]))


def test_execution_filtered_top_1_over_the_nbest():
    task = Karel(Config(task="karel"))
    ex = as_example(move_task())
    wrong, move, also = P.format("turnLeft"), P.format("move"), P.format("REPEAT R=1 r( move r)")
    turn_spec = as_example(Generated("x", tuple((world(0, "E"), world(0, "N")) for _ in range(6))))
    tricky = as_example(Generated("x", move_task().spec + ((world(0, "E"), world(0, "N")),)))  # held-out: a turn
    nbest = [[wrong, move, also], [move, wrong], [P.format("move move"), "DEF run m("], [wrong], [wrong, move]]
    examples = [ex, ex, ex, turn_spec, tricky]
    sums = task.nbest_metric_sums(nbest, examples)
    # filtered: 1 (its second), 2 and 4 generalise; 5's filtered pick passes the spec, not the held-out pair
    assert sums == {**task.metric_sums([h[0] for h in nbest], examples), "filtered": 3, "in_beam": 4}
    scores = task.scores(sums)
    assert scores["generalization"] == 0.4 and scores["filtered_generalization"] == 0.6
    assert scores["spec_in_beam"] == 0.8
    assert "filtered_generalization" not in task.scores(task.metric_sums([move], [ex]))
