"""Rewards in TRL's signature (`twophase.trlcall`), several rewards with weights (`twophase.rewardsum`), and what
the objectives do with a reward's None (NaN): the candidate leaves its source's baseline and set."""
import math

import pytest
import torch

from twophase import objectives, rewards, rewardsum
from twophase.rewards import RewardError

HYPS = ["a b", "", "c"]
REFS = [["a b"], [], ["d"]]
CHAT = [{"role": "user", "content": "q"}]


def test_a_trl_reward_is_called_trls_way():
    seen = {}

    def fn(prompts, completions, completion_ids, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, level=level, rest=sorted(kwargs))
        return [1.0, None, 0.5]

    out = rewards.validated(fn, "trl")(HYPS, REFS, sources=["p", CHAT, "r"], level=[1, 2, 3],
                                       completion_ids=[[4, 5, 1], [1], [6]])
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 0.5  # None: no reward
    assert seen == {"prompts": ["p", CHAT, "r"], "ids": [[4, 5, 1], [1], [6]], "level": [1, 2, 3], "rest": [],
                    "completions": ["a b", [{"role": "assistant", "content": ""}], "c"]}


def test_trl_rewards_get_only_what_they_name_and_required_names_are_checked():
    def by_ids(completion_ids):  # "declares completion_ids": called TRL's way too
        return [float(len(i)) for i in completion_ids]

    assert rewards.validated(by_ids, "ids")(HYPS, REFS, sources=["p"] * 3, completion_ids=[[1], [], [2, 3]],
                                            other=[0] * 3) == [1.0, 0.0, 2.0]
    with pytest.raises(RewardError, match="reward 'ids' needs 'completion_ids', which the caller did not give"):
        rewards.validated(by_ids, "ids")(HYPS, REFS, sources=["p"] * 3)
    # None is a TRL reward's "no reward"; a twophase reward's None stays an error
    with pytest.raises(RewardError, match="non-real value at position 0"):
        rewards.validated(lambda h, r: [None] * len(h), "own")(HYPS, REFS)


def test_weighted_sum_is_trls_nansum():
    def one(prompts, completions, **kw):
        return [1.0, None, None]

    def two(prompts, completions, **kw):
        return [2.0, 4.0, None]

    total = rewardsum.WeightedSum([rewards.validated(one, "one"), rewards.validated(two, "two")], [1.0, 0.5],
                                  ["one", "two"])
    out = total(HYPS, REFS, sources=["p"] * 3)
    assert out[:2] == [2.0, 2.0] and math.isnan(out[2])  # a candidate no reward scores: NaN
    sums = rewardsum.statistics(total.last)
    got = rewardsum.mean_std(sums, total.names)
    assert got["reward/one/mean"] == 1.0 and got["reward/one/std"] is None  # one value: no std
    assert got["reward/two/mean"] == 3.0 and got["reward/two/std"] == pytest.approx(math.sqrt(2.0))


def test_from_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mine.py").write_text("def score(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    assert rewardsum.from_flags("exact", None) is not None and not hasattr(rewardsum.from_flags("exact", None), "last")
    both = rewardsum.from_flags("exact,mine:score,exact", "1,2,3")
    assert both.names == ["exact", "score", "exact_2"] and both.weights == [1.0, 2.0, 3.0]
    for spec, weights, message in [("exact,", None, "an empty reward name"),
                                   ("exact,edit", "1", "expected 2 finite numbers"),
                                   ("exact,edit", "1,inf", "expected 2 finite numbers"),
                                   ("exact,nope", None, "unknown reward 'nope'")]:
        with pytest.raises(RewardError, match=message):
            rewardsum.from_flags(spec, weights)


OWNER = torch.tensor([0, 0, 0, 1, 1, 2, 2])
R = torch.tensor([1.0, float("nan"), 0.0, 0.5, 0.25, float("nan"), float("nan")], dtype=torch.float64)
TOKENS = torch.tensor([[4, 1], [5, 1], [6, 1], [4, 1], [5, 1], [4, 1], [6, 1]])
SCORES = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.2, -1.0, -3.0], dtype=torch.float64)


@pytest.mark.parametrize("baseline", ["none", "mean", "loo", "greedy"])
def test_reinforce_leaves_unscored_samples_out(baseline):
    """The coefficients of the scored samples are REINFORCE's over the scored samples alone; the others get 0."""
    greedy = torch.tensor([0.5, float("nan"), 1.0], dtype=torch.float64)
    got = objectives.reinforce(R, OWNER, 3, baseline, greedy)
    keep = ~torch.isnan(R)
    g = torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)  # an unscored greedy decode: baseline 0
    want = objectives.reinforce(R[keep], OWNER[keep], 3, baseline, g)
    assert torch.equal(got[~keep], torch.zeros(int((~keep).sum()), dtype=torch.float64))
    assert torch.allclose(got[keep], want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.0])
def test_mrt_renormalises_over_the_scored_candidates(alpha):
    got = objectives.mrt(R, SCORES, OWNER, 3, alpha, tokens=TOKENS)
    keep = ~torch.isnan(R)
    want = objectives.mrt(R[keep], SCORES[keep], OWNER[keep], 3, alpha, tokens=TOKENS[keep])
    assert torch.all(got[~keep] == 0) and torch.allclose(got[keep], want, rtol=0, atol=1e-15)


def test_beam_refuses_unknown_scores():
    with pytest.raises(ValueError, match="search scores, which are unknown"):
        objectives.beam(R, torch.full_like(SCORES, float("nan")), OWNER, 3, tokens=TOKENS)
