"""Objectives equal hand-computed coefficients, and the renormalised ones equal autograd's derivative of the
expected reward they stand for."""
import math

import pytest
import torch

from twophase import objectives

T = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731

# Two sources: source 0 has three candidates, source 1 has two.
OWNER = torch.tensor([0, 0, 0, 1, 1])
R = T(1.0, 0.5, 0.0, 0.2, 0.8)
S = T(-1.0, -2.0, -3.0, -0.5, -1.5)


def test_mle_averages_references_then_sources():
    assert objectives.mle(OWNER, 2).tolist() == pytest.approx([-1 / 6] * 3 + [-1 / 4] * 2)


@pytest.mark.parametrize("baseline,b", [
    ("none", [0, 0, 0, 0, 0]),
    ("mean", [0.5, 0.5, 0.5, 0.5, 0.5]),
    ("loo", [0.25, 0.5, 0.75, 0.8, 0.2]),
    ("greedy", [0.9, 0.9, 0.9, 0.1, 0.1]),
])
def test_reinforce_by_hand(baseline, b):
    got = objectives.reinforce(R, OWNER, 2, baseline, greedy_rewards=T(0.9, 0.1))
    k = [3, 3, 3, 2, 2]
    want = [-(r - bi) / (2 * ki) for r, bi, ki in zip(R.tolist(), b, k)]
    assert got.tolist() == pytest.approx(want)


def test_reinforce_loo_single_sample_has_no_baseline():
    got = objectives.reinforce(T(0.7, 0.4), torch.tensor([0, 1]), 2, "loo")
    assert got.tolist() == pytest.approx([-0.35, -0.2])


def test_reinforce_rejects_unknown_baseline_and_missing_greedy():
    with pytest.raises(ValueError, match="unknown baseline"):
        objectives.reinforce(R, OWNER, 2, "median")
    with pytest.raises(ValueError, match="greedy_rewards"):
        objectives.reinforce(R, OWNER, 2, "greedy")


def test_beam_by_hand():
    got = objectives.beam(R, S, OWNER, 2)
    z0 = math.exp(-1) + math.exp(-2) + math.exp(-3)
    q0 = [math.exp(-1) / z0, math.exp(-2) / z0, math.exp(-3) / z0]
    e0 = q0[0] * 1.0 + q0[1] * 0.5
    z1 = math.exp(-0.5) + math.exp(-1.5)
    q1 = [math.exp(-0.5) / z1, math.exp(-1.5) / z1]
    e1 = q1[0] * 0.2 + q1[1] * 0.8
    want = [-q0[0] * (1.0 - e0) / 2, -q0[1] * (0.5 - e0) / 2, -q0[2] * (0.0 - e0) / 2,
            -q1[0] * (0.2 - e1) / 2, -q1[1] * (0.8 - e1) / 2]
    assert got.tolist() == pytest.approx(want)


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.005])
def test_renormalised_coefficients_are_the_derivative_of_the_loss(alpha):
    """c_i = d(loss)/d(log p_i) for loss = -(1/B) sum_b E_{Q_b}[r], Q_b ∝ p^alpha: autograd checks the algebra."""
    s = S.clone().requires_grad_(True)
    loss = 0.0
    for b in range(2):
        m = OWNER == b
        loss = loss - (torch.softmax(alpha * s[m], 0) * R[m]).sum() / 2
    loss.backward()
    got = objectives.mrt(R, S, OWNER, 2, alpha=alpha)
    torch.testing.assert_close(got, s.grad, rtol=1e-12, atol=1e-15)


def test_mrt_alpha_one_is_beam():
    torch.testing.assert_close(objectives.mrt(R, S, OWNER, 2, 1.0), objectives.beam(R, S, OWNER, 2))


def test_group_softmax_is_stable_for_very_negative_scores():
    q = objectives.group_softmax(T(-1000.0, -1001.0, -5000.0), torch.tensor([0, 0, 1]), 2)
    assert q.tolist() == pytest.approx([1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1)), 1.0])


def test_mix_weights_each_part():
    got = objectives.mix(T(1.0, 2.0), T(-4.0), mle_weight=0.25)
    assert got.tolist() == pytest.approx([0.75, 1.5, -1.0])
