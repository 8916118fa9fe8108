"""Objectives equal hand-computed coefficients, and the renormalised ones equal autograd's derivative of the
expected reward they stand for, over each source's set of distinct candidates."""
import math

import pytest
import torch

from twophase import objectives

T = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731

# Two sources: source 0 has three candidates, source 1 has two.
OWNER = torch.tensor([0, 0, 0, 1, 1])
R = T(1.0, 0.5, 0.0, 0.2, 0.8)
S = T(-1.0, -2.0, -3.0, -0.5, -1.5)
TOK = torch.tensor([[4, 2, 0], [5, 2, 0], [6, 7, 2], [4, 2, 0], [5, 2, 0]])  # (N, T): distinct per source


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
    got = objectives.beam(R, S, OWNER, 2, tokens=TOK)
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
    got = objectives.mrt(R, S, OWNER, 2, alpha=alpha, tokens=TOK)
    torch.testing.assert_close(got, s.grad, rtol=1e-12, atol=1e-15)


def test_mrt_alpha_one_is_beam():
    torch.testing.assert_close(objectives.mrt(R, S, OWNER, 2, 1.0, tokens=TOK),
                               objectives.beam(R, S, OWNER, 2, tokens=TOK))


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_duplicates_are_one_candidate_by_hand(alpha):
    """Source 0 sampled y twice and z once; source 1 has y once (another source: another candidate) and w.
    Q is over {y, z} and {y, w}; y's coefficient is shared by its two rows."""
    owner = torch.tensor([0, 0, 0, 1, 1])
    tokens = torch.tensor([[4, 2, 0], [4, 2, 0], [5, 6, 2], [4, 2, 0], [7, 2, 0]])
    r, s = T(1.0, 1.0, 0.0, 0.2, 0.8), T(-1.0, -1.0, -3.0, -0.5, -1.5)
    got = objectives.mrt(r, s, owner, 2, alpha, tokens=tokens)
    qy = math.exp(-alpha) / (math.exp(-alpha) + math.exp(-3 * alpha))
    e0 = qy * 1.0
    q1 = [math.exp(-0.5 * alpha), math.exp(-1.5 * alpha)]
    q1 = [q / sum(q1) for q in q1]
    e1 = q1[0] * 0.2 + q1[1] * 0.8
    cy = -alpha * qy * (1.0 - e0) / 2
    want = [cy / 2, cy / 2, -alpha * (1 - qy) * (0.0 - e0) / 2,
            -alpha * q1[0] * (0.2 - e1) / 2, -alpha * q1[1] * (0.8 - e1) / 2]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    if alpha == 1.0:
        torch.testing.assert_close(objectives.beam(r, s, owner, 2, tokens=tokens), got)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_duplicates_give_the_deduplicated_objective(alpha):
    """Rows that repeat a candidate share its log p, so the surrogate's gradient with respect to a distinct
    candidate's score is the sum of its rows' coefficients: autograd's derivative of the expected reward over
    the distinct candidates. The coefficients also equal those computed on one row per candidate."""
    g = torch.Generator().manual_seed(0)
    owner_u = torch.tensor([0, 0, 0, 1, 1, 2])  # (U,)
    tokens_u = torch.tensor([[4, 2, 0, 0], [4, 5, 2, 0], [6, 4, 5, 2], [4, 2, 0, 0], [7, 7, 2, 0], [5, 2, 0, 0]])
    r_u = torch.rand(6, generator=g, dtype=torch.float64)
    s_u = (-3 * torch.rand(6, generator=g, dtype=torch.float64)).requires_grad_(True)
    loss = -sum((torch.softmax(alpha * s_u[owner_u == b], 0) * r_u[owner_u == b]).sum() for b in range(3)) / 3
    loss.backward()
    rows = torch.tensor([2, 0, 1, 0, 3, 4, 0, 5, 5, 4, 2])  # (N,) each row's candidate, in shuffled order
    got = objectives.mrt(r_u[rows], s_u.detach()[rows], owner_u[rows], 3, alpha, tokens=tokens_u[rows])
    per_candidate = objectives.group_sum(got, rows, 6)
    torch.testing.assert_close(per_candidate, s_u.grad, rtol=1e-12, atol=1e-15)
    copies = torch.bincount(rows, minlength=6).to(torch.float64)
    torch.testing.assert_close(got, (s_u.grad / copies)[rows], rtol=1e-12, atol=1e-15)  # equal shares
    once = objectives.mrt(r_u, s_u.detach(), owner_u, 3, alpha, tokens=tokens_u)
    torch.testing.assert_close(once, s_u.grad, rtol=1e-12, atol=1e-15)


def test_reinforce_counts_every_sample():
    """Duplicate samples are independent draws: each keeps its own -(r - b) / (B K)."""
    got = objectives.reinforce(T(1.0, 1.0, 0.0), torch.tensor([0, 0, 0]), 1, "none")
    assert got.tolist() == pytest.approx([-1 / 3, -1 / 3, 0.0])


def test_renormalised_objectives_need_matching_tokens():
    with pytest.raises(TypeError):
        objectives.beam(R, S, OWNER, 2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="tokens must be"):
        objectives.mrt(R, S, OWNER, 2, tokens=TOK[:4])


def test_group_softmax_is_stable_for_very_negative_scores():
    q = objectives.group_softmax(T(-1000.0, -1001.0, -5000.0), torch.tensor([0, 0, 1]), 2)
    assert q.tolist() == pytest.approx([1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1)), 1.0])


def test_mix_weights_each_part():
    got = objectives.mix(T(1.0, 2.0), T(-4.0), mle_weight=0.25)
    assert got.tolist() == pytest.approx([0.75, 1.5, -1.0])
