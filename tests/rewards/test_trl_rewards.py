"""Rewards in TRL's signature (`twophase.rewards.trlstyle`), several rewards with weights
(`twophase.rewards.weighted`), and what
the objectives do with a reward's None (NaN): the candidate leaves its source's baseline and set."""
import math

import pytest
import torch

from twophase import objectives, rewards
from twophase.rewards import weighted
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

    total = weighted.WeightedSum([rewards.validated(one, "one"), rewards.validated(two, "two")], [1.0, 0.5],
                                  ["one", "two"])
    out = total(HYPS, REFS, sources=["p"] * 3)
    assert out[:2] == [2.0, 2.0] and math.isnan(out[2])  # a candidate no reward scores: NaN
    sums = weighted.statistics(total.last)
    got = weighted.mean_std(sums, total.names)
    assert got["reward/one/mean"] == 1.0 and got["reward/one/std"] is None  # one value: no std
    assert got["reward/two/mean"] == 3.0 and got["reward/two/std"] == pytest.approx(math.sqrt(2.0))


def test_from_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mine.py").write_text("def score(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    assert weighted.from_flags("exact", None) is not None and not hasattr(weighted.from_flags("exact", None), "last")
    both = weighted.from_flags("exact,mine:score,exact", "1,2,3")
    assert both.names == ["exact", "score", "exact_2"] and both.weights == [1.0, 2.0, 3.0]
    for spec, weights, message in [("exact,", None, "an empty reward name"),
                                   ("exact,edit", "1", "expected 2 finite numbers"),
                                   ("exact,edit", "1,inf", "expected 2 finite numbers"),
                                   ("exact,nope", None, "unknown reward 'nope'")]:
        with pytest.raises(RewardError, match=message):
            weighted.from_flags(spec, weights)


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


# --objective policy and the SBS estimators: TRL's nanmean/nanstd treatment of a None (NaN) reward.
K = 4
R_GROUPS = torch.tensor([1.0, float("nan"), 0.0, 0.5,  # one None
                         float("nan")] * 1 + [2.0, float("nan"), float("nan"),  # one scored reward
                         float("nan")] * 1 + [float("nan")] * 3 +  # none scored
                        [0.25, 1.0, 0.75, 0.0], dtype=torch.float64)  # all scored
OWNER_GROUPS = torch.arange(4).repeat_interleave(K)


def _trls_advantages(rewards, scale):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, multi_objective_aggregation="sum_then_normalize"
    with one reward: nanmean per group, its own nanstd, nan_to_num (lines transcribed, its nanstd called)."""
    from trl.trainer.utils import nanstd
    mean = torch.nanmean(rewards.view(-1, K), dim=1).repeat_interleave(K, dim=0)
    std = nanstd(rewards.view(-1, K), dim=1).repeat_interleave(K, dim=0) if scale != "batch" else \
        nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_policy_advantages_treat_none_as_trl(scale):
    from twophase.objectives.policy import advantages
    pytest.importorskip("trl")
    got = advantages(R_GROUPS, OWNER_GROUPS, 4, "mean", scale)
    # TRL's nanstd forms Bessel's correction count / (count - 1) in float32 (an int64 division): 1e-7 relative
    torch.testing.assert_close(got, _trls_advantages(R_GROUPS, scale), rtol=1e-6, atol=1e-12)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["mean", "loo", "none"])
def test_policy_advantages_of_unscored_rows_are_0_and_the_rest_as_without_them(baseline, scale):
    from twophase.objectives.policy import advantages
    keep = ~torch.isnan(R_GROUPS)
    got = advantages(R_GROUPS, OWNER_GROUPS, 4, baseline, scale)
    want = advantages(R_GROUPS[keep], OWNER_GROUPS[keep], 4, baseline, scale)
    assert torch.equal(got[~keep], torch.zeros(int((~keep).sum()), dtype=torch.float64))
    torch.testing.assert_close(got[keep], want, rtol=1e-13, atol=1e-13)


def test_zero_std_groups_read_the_scored_rewards_only():
    from twophase.objectives.policy import zero_std_groups
    # one None among different rewards; a single scored one; none scored; all scored, different
    assert zero_std_groups(R_GROUPS, OWNER_GROUPS, 4).tolist() == [False, True, True, False]
    r = torch.tensor([1.0, float("nan"), 1.0, 1.0], dtype=torch.float64)
    assert zero_std_groups(r, torch.zeros(4, dtype=torch.long), 1).tolist() == [True]


def test_sequence_loss_averages_over_the_scored_rows_as_reinforce():
    from twophase.objectives.policy import advantages, policy_loss
    keep = ~torch.isnan(R_GROUPS)
    N = len(R_GROUPS)
    loss = policy_loss(advantages(R_GROUPS, OWNER_GROUPS, 4, "mean", "none"), torch.zeros(N, 3),
                       lengths=torch.full((N,), 3), loss_type="sequence", num_sources=4, owner=OWNER_GROUPS,
                       scored=keep)
    # at rho = 1 the sequence's weight on log p is -A * scale: reinforce's coefficient
    torch.testing.assert_close(-loss.advantages * loss.scale, objectives.reinforce(R_GROUPS, OWNER_GROUPS, 4, "mean"),
                               rtol=1e-13, atol=1e-15)


def test_policy_loss_without_token_scores_says_what_is_missing():
    from twophase import Samples
    from twophase.objectives.policy import policy_loss
    s = Samples.from_completions([[4, 5], [6]], [0, 0], pad_id=0, eos_id=1)  # no token_logps
    with pytest.raises(ValueError, match="old_token_logps .*Samples.token_scores.*token_logps"):
        policy_loss(torch.zeros(2, dtype=torch.float64), s.token_scores, lengths=s.lengths)


SBS_LP = torch.log(torch.tensor([0.3, 0.2, 0.15, 0.1, 0.25, 0.2, 0.05, 0.4, 0.1, 0.3, 0.2, 0.1, 0.3, 0.2, 0.1, 0.05],
                                dtype=torch.float64))
SBS_KAPPA = torch.tensor([-1.0, -1.5, float("-inf"), -2.0], dtype=torch.float64).repeat_interleave(K)


@pytest.mark.parametrize("objective", ["priority", "self-normalised", "unordered-set"])
def test_sbs_estimators_leave_an_unscored_candidate_out_as_if_removed(objective):
    """A source with a None equals the same source without that candidate; an unscored candidate gets 0; a source
    none of whose candidates is scored gets 0 everywhere (no NaN)."""
    from twophase.objectives import estimators

    def coef(r, lp, kappa, owner):
        if objective == "unordered-set":
            return estimators.unordered_set(r, lp, owner, 4)
        return estimators.priority(r, lp, kappa, owner, 4, normalise=objective == "self-normalised")
    keep = ~torch.isnan(R_GROUPS)
    got = coef(R_GROUPS, SBS_LP, SBS_KAPPA, OWNER_GROUPS)
    want = coef(R_GROUPS[keep], SBS_LP[keep], SBS_KAPPA[keep], OWNER_GROUPS[keep])
    assert torch.equal(got[~keep], torch.zeros(int((~keep).sum()), dtype=torch.float64))
    torch.testing.assert_close(got[keep], want, rtol=1e-10, atol=1e-13)
    assert (got[keep] != 0).any()
