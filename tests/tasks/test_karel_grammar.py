"""The Karel DSL grammar in tensors (twophase.tasks.karel.grammar) against the DSL's own parser: generated
programs are accepted, random and mutated token strings are accepted exactly when the parser accepts them, every
prefix a constrained sampler writes is a valid prefix, and the max-length cut neither strands a search
mid-program nor excludes a program that fits (an exhaustive enumeration at max_len 10)."""
import random

import pytest
import torch

from twophase import beam_search, sample
from twophase.constraints import Constrained
from twophase.tasks.karel.dsl import VOCAB, KarelSyntaxError, parse, try_parse
from twophase.tasks.karel.generate import GeneratorParams, sample_program
from twophase.tasks.karel.grammar import karel_grammar
from twophase.vocab import BOS, EOS, PAD, SPECIALS, Vocab

VOC = Vocab(list(SPECIALS) + list(VOCAB))

pytestmark = pytest.mark.usefixtures("one_thread")


def accepts(programs: list[list[str]], max_len: int) -> list[bool]:
    """Whether the automaton takes every token of each program, then eos (all programs at once)."""
    g = karel_grammar(VOC, max_len)
    rows = [VOC.encode(p) + [EOS] for p in programs]
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (T - len(r)) for r in rows])  # (n, T)
    scored = torch.arange(T)[None, :] < torch.tensor([len(r) for r in rows])[:, None]  # (n, T)
    state, ok = g.start(torch.zeros(len(rows), dtype=torch.long)), torch.ones(len(rows), dtype=torch.bool)
    for t in range(T):
        took = g.allowed(state).gather(1, ids[:, t:t + 1]).squeeze(1)  # (n,)
        ok &= took | ~scored[:, t]
        state = g.advance(state, ids[:, t])
    return ok.tolist()


def is_valid_prefix(tokens: list[str]) -> bool:
    """The parser's word: a complete program, or one that only ended too early."""
    try:
        parse(tokens)
        return True
    except KarelSyntaxError as err:
        return str(err).startswith("program ends after")


def test_every_generated_program_is_accepted_and_the_cut_is_tight():
    rng, p = random.Random(0), GeneratorParams()
    programs = [sample_program(rng, p).tokens() for _ in range(300)]
    assert all(accepts(programs, max(len(t) for t in programs) + 1))
    by_length = {}
    for tokens in programs:
        if len(tokens) <= p.max_tokens:  # the data's programs: the cut at exactly their length
            by_length.setdefault(len(tokens), []).append(tokens)
    assert len(by_length) > 10
    for n, group in by_length.items():
        assert all(accepts(group, n + 1))  # fits exactly: tokens and eos
        if n + 1 > 6:
            assert not any(accepts(group, n))  # one position short


def _mutated(rng: random.Random, tokens: list[str]) -> list[str]:
    tokens = list(tokens)
    i = rng.randrange(len(tokens))
    op = rng.randrange(3)
    if op == 0:
        del tokens[i]
    elif op == 1:
        tokens.insert(i, rng.choice(VOCAB))
    else:
        tokens[i] = rng.choice(VOCAB)
    return tokens


def test_random_token_strings_are_accepted_iff_the_parser_accepts_them():
    rng, p = random.Random(1), GeneratorParams()
    cases = [[rng.choice(VOCAB) for _ in range(rng.randint(0, 12))] for _ in range(100)]
    cases += [["DEF", "run", "m("] + [rng.choice(VOCAB) for _ in range(rng.randint(1, 10))] + ["m)"]
              for _ in range(100)]
    cases += [_mutated(rng, sample_program(rng, p).tokens()) for _ in range(200)]
    verdicts = [try_parse(t) is not None for t in cases]
    assert 20 < sum(verdicts) < len(cases) - 20  # both outcomes well represented
    assert accepts(cases, 100) == verdicts


class Uniform(torch.nn.Module):
    """Every token but PAD and BOS equally likely: a constrained sampler then roams the whole grammar."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, vocab: int):
        super().__init__()
        self.V = vocab

    def encode(self, source):
        return source  # (B, 1)

    def init_state(self, enc, owner):
        return enc[owner]

    def step(self, enc, owner, prev, state):
        logits = torch.zeros(len(owner), self.V, dtype=torch.float64)
        logits[:, [PAD, BOS]] = float("-inf")
        return state, logits.log_softmax(-1)


@pytest.mark.parametrize("max_len", [8, 31])
def test_every_prefix_of_a_constrained_sample_is_a_valid_prefix(max_len):
    c = Constrained(Uniform(len(VOC)), karel_grammar(VOC, max_len))
    s = sample(c, torch.zeros(2, 1), 150, max_len, generator=torch.Generator().manual_seed(0))
    assert len(s) == 300
    programs = set()
    for row, n in zip(s.tokens.tolist(), s.lengths.tolist()):
        assert row[n - 1] == EOS, row  # never cut off by max_len
        tokens = VOC.decode(row)
        assert try_parse(tokens) is not None, tokens
        assert all(is_valid_prefix(tokens[:k]) for k in range(len(tokens)))
        programs.add(" ".join(tokens))
    assert len(programs) > 100
    beam = beam_search(c, torch.zeros(1, 1), 40, max_len)
    assert len(beam) == 40 and all(try_parse(VOC.decode(r)) is not None for r in beam.tokens.tolist())


def test_the_automaton_enumerates_exactly_the_programs_that_fit():
    """At max_len 10 (at most 9 tokens) the programs are DEF run m( BODY m) with BODY 1-5 actions, or one REPEAT
    of one action: 5 + 25 + 125 + 625 + 3125 + 20 * 5 = 4005. Expanded breadth-first, every allowed path must
    end in one of them (no dead ends) and each must appear once."""
    g = karel_grammar(VOC, 10)
    state, prefixes, done = g.start(torch.zeros(1, dtype=torch.long)), [[]], []
    for _ in range(10):
        if not prefixes:
            break
        allowed = g.allowed(state)  # (n, V)
        row, tok = allowed.nonzero(as_tuple=True)
        assert set(row.tolist()) == set(range(len(prefixes)))  # every open prefix goes on
        state = g.advance({k: v[row] for k, v in state.items()}, tok)
        ended = tok == EOS
        done += [prefixes[r] for r in row[ended].tolist()]
        keep = (~ended).nonzero().squeeze(1)
        prefixes = [prefixes[r] + [t] for r, t in zip(row[keep].tolist(), tok[keep].tolist())]
        state = {k: v[keep] for k, v in state.items()}
    assert not prefixes
    texts = [" ".join(VOC.decode(p)) for p in done]
    assert len(texts) == len(set(texts)) == 4005
    assert all(try_parse(t) is not None for t in texts)


def test_max_len_outside_the_grammar_is_refused():
    with pytest.raises(ValueError, match="--max-len 5 cannot hold"):
        karel_grammar(VOC, 5)
    with pytest.raises(ValueError, match="at most 400"):
        karel_grammar(VOC, 401)
