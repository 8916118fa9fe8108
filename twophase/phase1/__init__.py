"""Phase one: search without a graph. Beam search, sampling and greedy decoding (`search`), stochastic beam search
(`sbs`), the sampler's truncation and its one-uniform draw (`truncation`), the per-step checks read once at the end
(`stepchecks`), and the one-phase baseline that searches with its graph kept (`onephase`).

What it hands phase two is a `twophase.samples.Samples`; it imports nothing from phase two.
"""
