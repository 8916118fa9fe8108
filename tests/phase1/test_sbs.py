"""Stochastic beam search and its estimators: the law of the drawn sets (chi-square against the exact law without
replacement, which wrong laws fail), distinct rows scored as teacher forcing scores them, for every model; the
leave-out ratios against exact enumeration; both estimators unbiased (by enumeration of every set, and by Monte
Carlo for priority's threshold); phase two's gradient exact; the trainer's flags end to end."""
import itertools
from collections import Counter
from fractions import Fraction

import pytest
import torch

import foreign_models as fm
from conftest import rnn_graph_mode, take_grads, tiny_model, toy_batch
from test_protocol import _assert_same, _check_rows, _log_probs, _reference_grads
from twophase import Samples, protocol, rescore_backward, stochastic_beam_search
from benchmarks import sbs as bench
from twophase.objectives import estimators
from twophase.phase1 import sbs, search
from twophase.phase1.onephase import one_phase_backward, one_phase_stochastic_beam_search
from twophase.train import cli
from twophase.config import Config
from twophase.vocab import EOS, PAD

from taskfiles import write_task

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN, K = 3, 2


def _space_model():
    """A flat tiny LSTM over tokens {3, 4} and EOS: 15 sequences of length <= 3 (8 cut at max_len), so the 105
    unordered pairs all have visible mass; 3 prefixes at depth one, more than K, so pruning matters."""
    model = tiny_model(tgt_vocab=5, seed=3)
    with torch.no_grad():
        model.out.weight.mul_(0.3)
    return model, toy_batch(lengths=(2,))


def _space(model, source, max_len=MAX_LEN):
    """(M, max_len) every sequence, and its exact (M,) probabilities under the model."""
    seqs = [list(w) + ([EOS] if n < max_len else []) for n in range(max_len + 1)
            for w in itertools.product([3, 4], repeat=n)]
    rows = torch.tensor([q + [PAD] * (max_len - len(q)) for q in seqs])
    with torch.no_grad():
        p = model.sequence_log_probs(*source, rows, torch.zeros(len(rows), dtype=torch.long)).exp()
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12)
    return rows, p


def _ordered_law(p: list[float], k: int) -> dict[tuple, float]:
    """P(first k draws without replacement are exactly this sequence of items)."""
    law = {}
    for order in itertools.permutations(range(len(p)), k):
        pr, used = 1.0, 0.0
        for i in order:
            pr, used = pr * p[i] / (1 - used), used + p[i]
        law[order] = pr
    return law


def _draws(s: Samples, rows: torch.Tensor) -> list[list[int]]:
    """Each source's rows as indices into rows."""
    index = {tuple(r): i for i, r in enumerate(rows.tolist())}
    groups: dict[int, list[int]] = {}
    for o, r in zip(s.owner.tolist(), s.tokens.tolist()):
        groups.setdefault(o, []).append(index[tuple(r + [PAD] * (rows.shape[1] - len(r)))])
    return list(groups.values())


def _chi2(observed: Counter, expected: dict, n: int) -> float:
    """Pearson's statistic; a draw outside the law's support (a repeated sequence) makes it infinite."""
    if set(observed) - set(expected):
        return float("inf")
    return sum((observed[c] - n * q) ** 2 / (n * q) for c, q in expected.items())


def _limit(df: int) -> float:
    """The chi-square quantile at p = 1e-4 (Wilson-Hilferty); seeded, so each outcome is fixed anyway."""
    return df * (1 - 2 / (9 * df) + 3.719 * (2 / (9 * df)) ** 0.5) ** 3


def _law_statistics(draw, n=6000):
    """(chi2 of the unordered sets, its limit, chi2 of the first draws, its limit) for n sources' draws."""
    model, (src, lens) = _space_model()
    rows, p = _space(model, (src, lens))
    drawn = _draws(draw(model, (src.repeat(n, 1), lens.repeat(n)), K, MAX_LEN, torch.Generator().manual_seed(0)),
                   rows)
    assert len(drawn) == n
    sets: dict[frozenset, float] = {}
    for order, q in _ordered_law(p.tolist(), K).items():
        sets[frozenset(order)] = sets.get(frozenset(order), 0.0) + q
    assert min(sets.values()) * n > 5  # every cell populated enough for chi-square
    observed = Counter(frozenset(d) if len(set(d)) == K else tuple(d) for d in drawn)
    first = Counter(d[0] for d in drawn)
    return (_chi2(observed, sets, n), _limit(len(sets) - 1),
            _chi2(first, dict(enumerate(p.tolist())), n), _limit(len(p) - 1))


@pytest.mark.parametrize("compact_at, block_bytes", [(2.0, search.BLOCK_BYTES), (0.0, 40000)])
def test_drawn_sets_follow_the_law_without_replacement(compact_at, block_bytes, monkeypatch):
    """The 6000 sources' pairs against the exact law of unordered pairs drawn without replacement (105 cells),
    and their first rows against p (an ordered sample's first draw is a plain draw from p), with the beam's
    compaction and blocks of 500 sources or without."""
    monkeypatch.setattr(search, "COMPACT_AT", compact_at)
    monkeypatch.setattr(search, "BLOCK_BYTES", block_bytes)
    chi_sets, limit_sets, chi_first, limit_first = _law_statistics(stochastic_beam_search)
    assert chi_sets < limit_sets and chi_first < limit_first, (chi_sets, limit_sets, chi_first, limit_first)


def test_wrong_laws_fail_the_chi_square(monkeypatch):
    """The test above has power: fresh unconditioned Gumbels at each step (the beam prunes on noise unrelated
    to the leaves') and K samples with replacement both fail it."""
    def unconditioned(phi, parent, noise):
        return torch.where(torch.isfinite(phi) & torch.isfinite(parent[..., None]), phi + noise,
                           torch.full_like(phi, float("-inf")))
    with monkeypatch.context() as m:
        m.setattr(sbs, "conditional_gumbels", unconditioned)
        chi_sets, limit_sets, chi_first, limit_first = _law_statistics(stochastic_beam_search)
    assert chi_sets > 5 * limit_sets and chi_first > limit_first
    chi_sets, limit_sets, *_ = _law_statistics(lambda m, s, k, t, g: search.sample(m, s, k, t, generator=g))
    assert chi_sets == float("inf")


@pytest.mark.parametrize("name", fm.NAMES + ("scored-transformer", "lstm"))
def test_rows_are_distinct_and_scored_as_teacher_forcing_scores_them(name):
    if name == "lstm":
        model, source = tiny_model().train(), toy_batch()
    else:
        model, source = fm.make(name), fm.sources(name)
    s = stochastic_beam_search(model, source, 5, 4, torch.Generator().manual_seed(0))
    assert model.training  # evaluation mode undone
    if name != "lstm":
        _check_rows(model, s, 4)
    with torch.no_grad(), protocol.scoring_mode(model):
        enc = model.encode(source)
        torch.testing.assert_close(protocol.score(model, enc, s.tokens, s.owner), s.scores, rtol=0, atol=1e-9)
    assert s.owner.tolist() == sorted(s.owner.tolist())
    for b in set(s.owner.tolist()):
        rows = (s.owner == b).nonzero().squeeze(1)
        assert len({tuple(r) for r in s.tokens[rows].tolist()}) == len(rows) == 5  # distinct, K of them
        g = s.perturbed[rows]
        assert torch.all(g[:-1] > g[1:]) and torch.all(g > s.threshold[rows]) and torch.isfinite(g).all()
        assert torch.unique(s.threshold[rows]).numel() == 1
    assert s.perturbed.dtype == s.threshold.dtype == torch.float64
    sub = s.select(torch.tensor([len(s) - 1, 0]))
    assert torch.equal(sub.perturbed, s.perturbed[[len(s) - 1, 0]])
    refs = Samples.of_targets(s.tokens[:2], torch.tensor([0, 1]), model.pad_id, model.eos_id)
    both = Samples.cat([s, refs], model.pad_id)  # reference rows carry no perturbation: NaN
    assert torch.equal(both.threshold[:len(s)], s.threshold) and torch.isnan(both.perturbed[len(s):]).all()


def test_a_space_smaller_than_k_is_returned_whole():
    model, source = _space_model()
    rows, p = _space(model, source, max_len=2)  # 7 sequences
    s = stochastic_beam_search(model, source, 10, 2, torch.Generator().manual_seed(1))
    assert sorted(_draws(s, rows)[0]) == list(range(7))
    assert torch.isneginf(s.threshold).all()
    assert torch.equal(estimators.log_inclusion(s.scores, s.threshold), torch.zeros(7, dtype=torch.float64))


def _exact_ratios(p: list[Fraction]):
    """R(S, s) and R2(s, s') by summing the probabilities of every order, in exact arithmetic."""
    def unordered(items, mass):  # P of drawing `items` first (any order) from D renormalised by `mass`
        total = Fraction(0)
        for order in itertools.permutations(items):
            pr, used = Fraction(1), Fraction(0)
            for i in order:
                pr, used = pr * (p[i] / mass) / (1 - used), used + p[i] / mass
            total += pr
        return total
    k = range(len(p))

    def P(out):
        return unordered([j for j in k if j not in out], 1 - sum(p[j] for j in out))
    r1 = [P({s}) / P(set()) for s in k]
    r2 = [[Fraction(1) if s == t else P({s, t}) / P({s}) for t in k] for s in k]
    return r1, r2


@pytest.mark.parametrize("probs", [[0.3], [0.2, 0.5], [1.16e-3, 0.815, 4.16e-7], [0.05, 0.1, 0.02, 0.3],
                                   [0.4, 0.3, 0.2, 0.0999999], [1e-9, 2e-9, 5e-10], [0.25, 0.25, 0.25, 0.25]])
def test_leave_out_ratios_equal_exact_enumeration(probs):
    r1, r2 = _exact_ratios([Fraction(x) for x in probs])
    lp = torch.tensor([probs], dtype=torch.float64).log()
    got1, got2 = estimators.leave_out_ratios(lp)
    want1 = torch.tensor([[float(x) for x in r1]], dtype=torch.float64).log()
    want2 = torch.tensor([[[float(x) for x in row] for row in r2]], dtype=torch.float64).log()
    torch.testing.assert_close(got1, want1, rtol=0, atol=1e-9)
    torch.testing.assert_close(got2, want2, rtol=0, atol=1e-9)


def test_unordered_set_coefficients_equal_the_ratio_matrix_formula():
    """The O(K M) leave-one-out sums give the paper's formula written with the whole (K, K) matrix R2: sources of
    1 to 6 candidates (padding), rewards of both signs, probabilities from 1e-30 to 0.6."""
    g = torch.Generator().manual_seed(3)
    counts = [1, 2, 3, 6, 4]
    owner = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts))
    lp = torch.log_softmax(torch.randn(len(counts), 8, generator=g, dtype=torch.float64) * 3, 1)
    lp[3, 5] = -69.0  # p = 1e-30
    scores = torch.cat([lp[b, :k] for b, k in enumerate(counts)])
    r = torch.randn(len(owner), generator=g, dtype=torch.float64) * 2 - 1
    got = estimators.unordered_set(r, scores, owner, len(counts))
    want = []
    for b, k in enumerate(counts):
        rows = (owner == b).nonzero().squeeze(1)
        log_r1, log_r2 = estimators.leave_out_ratios(scores[rows][None])
        p, rb = scores[rows].exp(), r[rows]
        base = (p[None, :] * log_r2[0].exp() * rb[None, :]).sum(1) if k > 1 else torch.zeros(1, dtype=torch.float64)
        want.append(-p * log_r1[0].exp() * (rb - base) / len(counts))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-9, atol=1e-14)


def _rewards(n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


@pytest.mark.parametrize("k", [2, 3])
def test_unordered_set_estimator_is_unbiased_by_enumeration(k):
    """Over every unordered set S of the 15 sequences, sum_S P(S) c_y(S) = -p_y (r_y - E[r]) (the estimate of
    grad E[r] plus its baseline, whose expectation is E[r] grad sum p = 0), and so the expected gradient through
    the model equals -grad E[r], the true gradient, exactly."""
    model, source = _space_model()
    rows, p = _space(model, source)
    r = _rewards(len(rows))
    sets: dict[frozenset, float] = {}
    for order, q in _ordered_law(p.tolist(), k).items():
        sets[frozenset(order)] = sets.get(frozenset(order), 0.0) + q
    members = torch.tensor([sorted(S) for S in sets])  # (n_sets, k)
    weight = torch.tensor(list(sets.values()), dtype=torch.float64)  # (n_sets,) P(S)
    n_sets = len(members)
    flat = members.reshape(-1)
    owner = torch.arange(n_sets).repeat_interleave(k)
    c = estimators.unordered_set(r[flat], p[flat].log(), owner, n_sets) * n_sets  # one set per "source"
    W = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, flat, weight[owner] * c)  # (M,)
    torch.testing.assert_close(W, -p * (r - (p * r).sum()), rtol=1e-9, atol=1e-13)
    owner_all = torch.zeros(len(rows), dtype=torch.long)
    with rnn_graph_mode(model):
        log_p = model.sequence_log_probs(*source, rows, owner_all)
    (W * log_p).sum().backward(retain_graph=True)
    got = take_grads(model)
    (-(log_p.exp() * r).sum()).backward()
    _assert_same(got, take_grads(model))


def test_priority_estimator_is_unbiased_by_monte_carlo():
    """With the sampler's own thresholds, the mean over 6000 draws of sum_{y in S} (p_y / q_y) [y] is p_y for
    each of the 15 sequences (within 5 standard errors); weighting with the K-th perturbed score as kappa (the
    smallest kept instead of the largest left out) is visibly biased."""
    model, (src, lens) = _space_model()
    rows, p = _space(model, (src, lens))
    n = 6000
    s = stochastic_beam_search(model, (src.repeat(n, 1), lens.repeat(n)), K, MAX_LEN,
                               torch.Generator().manual_seed(2))
    index = torch.tensor([d for ds in _draws(s, rows) for d in ds])  # (N,) each row's sequence
    last = s.perturbed.reshape(n, K)[:, -1].repeat_interleave(K)  # (N,) the K-th perturbed score
    for kappa, unbiased in ((s.threshold, True), (last, False)):
        c = -estimators.priority(torch.ones(len(s), dtype=torch.float64), s.scores, kappa, s.owner, n) * n
        est = torch.zeros(n, len(rows), dtype=torch.float64).index_put_((s.owner, index), c)  # (n, M)
        z = (est.mean(0) - p) / (est.std(0) / n ** 0.5)
        assert bool((z.abs() < 5).all()) == unbiased, z


def test_self_normalised_priority_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    lp = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64)
    kappa = torch.full((3,), -1.5, dtype=torch.float64)
    q = 1 - torch.exp(-torch.exp(lp - kappa))
    w = (lp.exp() / q) / (lp.exp() / q).sum()
    owner = torch.zeros(3, dtype=torch.long)
    torch.testing.assert_close(estimators.priority(r, lp, kappa, owner, 2, normalise=True),
                               -w * (r - (w * r).sum()) / 2)
    torch.testing.assert_close(estimators.priority(r, lp, kappa, owner, 2), -(lp.exp() / q) * r / 2)


@pytest.mark.parametrize("objective", ["unordered-set", "priority"])
@pytest.mark.parametrize("name", fm.NAMES)
def test_phase_two_gradient_is_exact_and_one_phase_agrees(name, objective):
    model, source = fm.make(name), fm.sources(name)
    s = stochastic_beam_search(model, source, 3, 4, torch.Generator().manual_seed(7))
    one, log_p = one_phase_stochastic_beam_search(model, source, 3, 4, torch.Generator().manual_seed(7))
    assert torch.equal(one.tokens, s.tokens)  # the same draws
    torch.testing.assert_close(one.perturbed, s.perturbed, rtol=0, atol=1e-12)
    r = _rewards(len(s))
    B = len(set(s.owner.tolist()))
    c = (estimators.unordered_set(r, s.scores, s.owner, B) if objective == "unordered-set"
         else estimators.priority(r, s.scores, s.threshold, s.owner, B))
    want, total = _reference_grads(model, source, s, c)
    assert any(float(g.abs().sum()) > 0 for g in want)
    for chunk in (1, 4):
        assert rescore_backward(model, source, s, c, chunk_size=chunk) == pytest.approx(total, abs=1e-10)
        _assert_same(take_grads(model), want)
    one_phase_backward(log_p, c)
    _assert_same(take_grads(model), want)
    with torch.no_grad(), protocol.scoring_mode(model):  # the reference's own scores, for the record
        torch.testing.assert_close(_log_probs(model, source, s.tokens, s.owner), s.scores, rtol=0, atol=1e-9)


@pytest.mark.parametrize("objective", ["unordered-set", "priority"])
def test_trainer_runs_sbs_end_to_end(objective, tmp_path):
    write_task(tmp_path / "train.tsv", "reverse", 40, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 8, seed=1)
    argv = ["--train", str(tmp_path / "train.tsv"), "--valid", str(tmp_path / "valid.tsv"), "--mle-steps", "2",
            "--rl-steps", "3", "--sampler", "sbs", "--objective", objective, "--no-compare-mle", "--hidden-size",
            "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size", "3",
            "--rescore-chunk", "5", "--max-len", "8", "--save-dir", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    import json
    rl = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in rl if x["phase"] == "rl"]
    assert len(rl) == 3 and all(x["skipped"] == 0 and x["candidates"] == 12 for x in rl), rl
    assert any(x["grad_norm"] > 0 for x in rl)


def test_without_replacement_objectives_need_sbs(capsys, tmp_path):
    for flags in (["--objective", "priority"], ["--objective", "unordered-set", "--sampler", "sample"]):
        code = cli.main(flags + ["--save-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "needs --sampler sbs" in err, err
    Config(objective="unordered-set", sampler="sbs", beam_size=1).validate()  # REINFORCE without a baseline
    assert "biased" in Config(objective="reinforce", sampler="sbs").warnings()[0]


def test_bench_variance_reproduces_the_documented_ordering(capsys):
    """`python -m benchmarks.sbs variance` on one cell with 300 draws: on the peaked model at K = 4 the
    unordered set estimator's error is well below REINFORCE-loo's (docs/sbs.md: 0.66 against 4.39 at 4,000 draws),
    and the beam's error is its bias."""
    found = bench.variance(300, 0, scales=(12.0,), ks=(4,))
    assert found[12.0, 4, "unordered-set"][0] < 0.5 * found[12.0, 4, "reinforce-loo"][0]
    mse, bias = found[12.0, 4, "beam"]
    assert mse == pytest.approx(bias, rel=1e-9)
    assert "| weights x12" in capsys.readouterr().out
