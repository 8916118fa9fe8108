import pytest

from twophase.tasks.metrics import evaluate


def test_exact_match_with_any_reference_counts_right():
    scores = evaluate([["R", "EH1", "D"], ["K", "AE1", "T"]],
                      [[["R", "IY1", "D"], ["R", "EH1", "D"]], [["K", "AE1", "T"]]])
    assert scores == {"word_acc": 1.0, "wer": 0.0, "per": 0.0, "n": 2}


def test_per_with_substitution_and_deletion():
    # word 1: one substitution against a 3-token reference; word 2: one deletion against a 4-token reference.
    scores = evaluate([["K", "AA1", "T"], ["D", "AO1", "G"]],
                      [[["K", "AE1", "T"]], [["D", "AO1", "G", "Z"]]])
    assert scores["word_acc"] == 0.0
    assert scores["wer"] == 1.0
    assert scores["per"] == pytest.approx(2 / 7)
    assert scores["n"] == 2


def test_per_uses_closest_reference():
    # distance 2 to the first reference, 1 to the second: the second (length 2) counts.
    scores = evaluate([["A", "B"], ["X"]], [[["C", "D", "E"], ["A", "C"]], [["X"]]])
    assert scores["word_acc"] == 0.5
    assert scores["wer"] == 0.5
    assert scores["per"] == pytest.approx(1 / 3)


def test_per_ties_take_the_longest_reference():
    # one edit from both references; the longer gives the lower rate.
    scores = evaluate([["A", "B"]], [[["A"], ["A", "B", "C"]]])
    assert scores["per"] == pytest.approx(1 / 3)


def test_evaluate_accepts_tuples_and_rejects_mismatches():
    assert evaluate([("A",)], [[("A",)]])["word_acc"] == 1.0
    with pytest.raises(ValueError):
        evaluate([["A"]], [])
    with pytest.raises(ValueError):
        evaluate([], [])
    with pytest.raises(ValueError):
        evaluate([["A"]], [[]])


def test_stress_free_word_error_rate():
    from twophase.tasks.metrics import stress_free_correct, without_stress

    assert without_stress("HH AH0 L OW1".split()) == "HH AH L OW".split()
    hyps = ["HH AH1 L OW1".split(), "HH EH0 L OW1".split(), "K AE1 T".split()]
    refs = [["HH AH0 L OW1".split()], ["HH AH0 L OW1".split()], ["K AE1 T S".split(), "K AE2 T".split()]]
    assert stress_free_correct(hyps, refs) == 2  # stress alone differs in the first and third; a phoneme in the second


def test_g2p_reports_the_stress_free_wer_beside_the_wer():
    from twophase.tasks import Example
    from twophase.tasks.text import G2P

    task = G2P.__new__(G2P)  # its metrics only: no data
    batch = [Example("hello", ["HH AH0 L OW1"]), Example("cat", ["K AE1 T"])]
    sums = task.metric_sums(["HH AH1 L OW1", "K AE1 T"], batch)
    scores = task.scores({k: 2 * v for k, v in sums.items()})  # shards add up
    assert scores["wer"] == 0.5 and scores["wer_nostress"] == 0.0 and scores["n"] == 4
