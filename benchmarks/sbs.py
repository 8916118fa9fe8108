"""Measurements of stochastic beam search and its estimators (docs/sbs.md), one thread:

    python -m benchmarks.sbs variance         # gradient error of each estimator against the enumerated truth
    python -m benchmarks.sbs cost             # time of the estimators' coefficients, K = 2 .. 64
    python -m benchmarks.sbs prefix --checkpoint RUN/checkpoint_last.pt       # candidates and prefix tree

variance: a tiny fp64 LSTM over 3 tokens + EOS, max length 3 (40 sequences, every one enumerated), one source,
fixed rewards r_y ~ U(0, 1); the true gradient g* = sum_y p_y r_y grad log p_y. Each of n draws gives an estimate
g = -B sum_i c_i grad log p_i (from the Jacobian of the 40 log p_y, so one draw costs no backward); reported:
E|g - g*|^2 / |g*|^2 (the relative mean squared error, bias included) and |mean g - g*|^2 / |g*|^2 (the
relative squared bias, which for an unbiased estimator is its noise over n, about mse / n).

prefix: a trained checkpoint's phase one on its first training sources: the candidates' distinct rows per
source, and the prefix tree's nodes against the token positions (what phase two decodes with sharing).

Letters: B sources, K candidates per source, M enumerated sequences, P parameters, n draws.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from twophase import objectives
from twophase.models.seq2seq import Seq2Seq
from twophase.objectives import estimators
from twophase.phase1.sbs import stochastic_beam_search
from twophase.phase1.search import beam_search, sample
from twophase.phase2 import prefixtree
from twophase.protocol import scoring_mode
from twophase.samples import Samples
from twophase.vocab import EOS, PAD

MAX_LEN = 3


def _tiny(scale: float) -> tuple[Seq2Seq, tuple]:
    torch.manual_seed(0)
    model = Seq2Seq(9, 6, embed_dim=8, hidden_size=16).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model.eval(), (torch.tensor([[5, 7]]), torch.tensor([2]))


def _space() -> torch.Tensor:
    """(M, MAX_LEN) every sequence over tokens 3, 4, 5 with EOS, or cut at MAX_LEN."""
    seqs = [list(w) + ([EOS] if n < MAX_LEN else []) for n in range(MAX_LEN + 1)
            for w in itertools.product([3, 4, 5], repeat=n)]
    return torch.tensor([q + [PAD] * (MAX_LEN - len(q)) for q in seqs])


def _jacobian(model, source, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(M,) p_y and (M, P) grad log p_y."""
    with scoring_mode(model):  # a graph through the encoder's nn.LSTM: training mode at dropout 0, as cuDNN needs
        log_p = model.sequence_log_probs(*source, rows, torch.zeros(len(rows), dtype=torch.long))
    params = [p for p in model.parameters()]
    J = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(lp, params, retain_graph=True,
                                                                          allow_unused=False)])
                     for lp in log_p])
    return log_p.detach().exp(), J


def _weights(s: Samples, c: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """(n, M) each draw's coefficients on the enumerated sequences, times -n (the estimate of grad E[r])."""
    index = {tuple(r): i for i, r in enumerate(rows.tolist())}
    at = torch.tensor([index[tuple(r + [PAD] * (MAX_LEN - len(r)))] for r in s.tokens.tolist()])
    return torch.zeros(n, len(rows), dtype=torch.float64).index_put_((s.owner, at), -n * c, accumulate=True)


def _estimates(kind: str, model, source, K: int, n: int, r: torch.Tensor, rows, seed: int) -> torch.Tensor:
    src, lens = source
    many = (src.repeat(n, 1), lens.repeat(n))
    g = torch.Generator().manual_seed(seed)
    if kind == "reinforce-loo":
        s = sample(model, many, K, MAX_LEN, generator=g)
    elif kind == "beam":
        s = beam_search(model, many, K, MAX_LEN)
    else:
        s = stochastic_beam_search(model, many, K, MAX_LEN, g)
    index = {tuple(x): i for i, x in enumerate(rows.tolist())}
    rew = r[torch.tensor([index[tuple(x + [PAD] * (MAX_LEN - len(x)))] for x in s.tokens.tolist()])]
    c = {"reinforce-loo": lambda: objectives.reinforce(rew, s.owner, n, "loo"),
         "beam": lambda: objectives.beam(rew, s.scores, s.owner, n, tokens=s.tokens),
         "unordered-set": lambda: estimators.unordered_set(rew, s.scores, s.owner, n),
         "priority": lambda: estimators.priority(rew, s.scores, s.threshold, s.owner, n),
         "priority-normalised": lambda: estimators.priority(rew, s.scores, s.threshold, s.owner, n, True)}[kind]()
    return _weights(s, c, rows, n)


def variance(n: int, seed: int, scales=(1.0, 12.0), ks=(2, 4, 8)) -> dict:
    """Prints the table; returns {(scale, K, kind): (relative mse, relative squared bias)}. Scale 1: a flat
    model; 12: peaked like a trained one (the top 8 of the 40 sequences hold 98%)."""
    rows = _space()
    r = torch.rand(len(rows), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    print(f"{len(rows)} sequences, rewards U(0,1), {n} draws per cell; relative MSE (relative squared bias)")
    kinds = ("reinforce-loo", "unordered-set", "priority", "priority-normalised", "beam")
    print("| model | K | " + " | ".join(kinds) + " |\n|---|---|" + "---|" * len(kinds))
    found = {}
    for scale in scales:
        model, source = _tiny(scale)
        p, J = _jacobian(model, source, rows)
        truth = (p * r) @ J  # (P,)
        norm = float(truth.pow(2).sum())
        top = float(p.max())
        for K in ks:
            cells = []
            for kind in kinds:
                est = _estimates(kind, model, source, K, n, r, rows, seed) @ J  # (n, P)
                mse = float((est - truth).pow(2).sum(1).mean()) / norm
                bias = float((est.mean(0) - truth).pow(2).sum()) / norm
                cells.append(f"{mse:.4g} ({bias:.2g})")
                found[scale, K, kind] = (mse, bias)
            print(f"| weights x{scale:g} (max p {top:.2f}) | {K} | " + " | ".join(cells) + " |")
    return found


def cost(B: int, repeats: int) -> None:
    print(f"coefficients of B={B} sources, CPU time, median of {repeats}, one thread")
    print("| K | unordered-set | priority | grid points M | log-ratio change on a 4x finer grid |\n"
          "|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for K in (2, 4, 8, 16, 32, 64):
        owner = torch.arange(B).repeat_interleave(K)
        lp = torch.log_softmax(torch.randn(B, 4 * K, generator=g, dtype=torch.float64) * 2, 1)[:, :K].reshape(-1)
        r = torch.rand(B * K, generator=g, dtype=torch.float64)
        kappa = torch.full((B * K,), -8.0, dtype=torch.float64)
        times = {}
        for name, fn in (("us", lambda: estimators.unordered_set(r, lp, owner, B)),
                         ("pr", lambda: estimators.priority(r, lp, kappa, owner, B))):
            fn()
            runs = []
            for _ in range(repeats):  # CPU time: the machine may be shared
                t = time.process_time()
                fn()
                runs.append(time.process_time() - t)
            times[name] = statistics.median(runs)
        fine = _finer(lambda: estimators.leave_out_ratios(lp.reshape(B, K)))
        coarse = estimators.leave_out_ratios(lp.reshape(B, K))
        drift = max(float((a - b).abs().max()) for a, b in zip(coarse, fine))
        print(f"| {K} | {times['us'] * 1e3:.2f} ms | {times['pr'] * 1e3:.3f} ms | "
              f"{len(estimators._grid(K, 'cpu'))} | {drift:.1e} |")


def _finer(fn):
    """fn() on a grid 4x finer and reaching 24 lower: the quadrature's own error, measured."""
    step, low = estimators.STEP, estimators.LOW
    estimators.STEP, estimators.LOW = step / 4, low - 24
    try:
        return fn()
    finally:
        estimators.STEP, estimators.LOW = step, low


def prefix(checkpoint: str, batches: int, K: int, seed: int) -> None:
    from twophase.train.decode import load_model  # the bench may read what training wrote
    model, task, saved = load_model(checkpoint, torch.device("cpu"))
    max_len = saved["max_len"]
    task.load_data()
    g = torch.Generator().manual_seed(seed)
    print(f"{checkpoint}: {batches} batches of 32 training sources, K={K}, max_len {max_len}")
    print("| sampler | distinct rows / K | nodes / positions | phase one (CPU) |\n|---|---|---|---|")
    for name in ("beam", "sample", "sbs"):
        distinct = nodes = positions = rows_total = 0
        seconds = 0.0
        for b in range(batches):
            source = task.collate(task.train[b * 32:(b + 1) * 32], torch.device("cpu"))
            t = time.process_time()
            if name == "beam":
                s = beam_search(model, source, K, max_len)
            elif name == "sample":
                s = sample(model, source, K, max_len, generator=g)
            else:
                s = stochastic_beam_search(model, source, K, max_len, g)
            seconds += time.process_time() - t
            distinct += len(objectives.distinct(s.owner, s.tokens)[1])
            rows_total += len(s)
            nodes += int(prefixtree.new_nodes(*_sorted(s)).sum())
            positions += int(s.lengths.sum())
        print(f"| {name} | {distinct / rows_total:.3f} | {nodes / positions:.3f} | "
              f"{seconds / batches * 1e3:.0f} ms/batch |")


def _sorted(s: Samples):
    order = prefixtree.sort_rows(s.tokens, s.owner, s.lengths)
    return s.tokens[order], s.owner[order], s.lengths[order]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sbs", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("variance", "cost", "prefix"))
    p.add_argument("--draws", type=int, default=4000, help="variance: draws per cell")
    p.add_argument("--checkpoint", help="prefix: a train.py checkpoint")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--beam-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "variance":
        variance(args.draws, args.seed)
    elif args.what == "cost":
        cost(32, 9)
    else:
        if not args.checkpoint:
            p.error("prefix needs --checkpoint")
        prefix(args.checkpoint, args.batches, args.beam_size, args.seed)


if __name__ == "__main__":
    main()
