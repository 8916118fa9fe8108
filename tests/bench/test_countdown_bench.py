"""benchmarks.countdown's shuffled-reward control: each source keeps its count of right candidates, but which
candidates get the reward no longer follows the checker."""
from benchmarks.countdown import shuffled
from twophase.tasks.countdown.rpn import accepts


def test_shuffled_rewards_keep_each_sources_count_and_lose_which_candidate():
    sources = ["3 7 25 = 250"] * 4 + ["2 5 = 10"] * 2
    hyps = ["3 7 + 25 *", "25 3 7 + *", "3 7 * 25 +", "3 25 * 7 -", "2 5 *", "2 5 +"]
    right = [accepts(h, *((3, 7, 25), 250) if s.startswith("3") else ((2, 5), 10)) for h, s in zip(hyps, sources)]
    assert right == [True, True, False, False, True, False]
    hits = [0] * len(hyps)
    for _ in range(400):
        out = shuffled(hyps, [[]] * len(hyps), sources)
        assert sum(out[:4]) == 2 and sum(out[4:]) == 1  # each source's rewards, permuted among its own rows
        hits = [h + r for h, r in zip(hits, out)]
    assert all(120 < h < 280 for h in hits)  # every row is rewarded about half the time, right or not
