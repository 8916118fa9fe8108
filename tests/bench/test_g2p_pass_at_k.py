"""benchmarks.g2p_pass_at_k's count against hand-counted lists."""
from benchmarks.g2p_pass_at_k import pass_at_k


def test_pass_at_k_counts_any_pronunciation_within_the_first_k():
    right = [{("R", "EH1", "D"), ("R", "IY1", "D")},  # read: two pronunciations, both right
             {("K", "AE1", "T")},
             {("D", "AO1", "G")}]
    nbest = [["R IY1 D", "R EH1 D"],  # the second pronunciation, first: right at k = 1
             ["K AH0 T", "K AE1  T", "K AE1 T"],  # tokens compared, not spacing: right from k = 2
             ["D AA1 G"]]  # a list shorter than k, never right
    assert pass_at_k(nbest, right, [1, 2, 3]) == {1: 1 / 3, 2: 2 / 3, 3: 2 / 3}
