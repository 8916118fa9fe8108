"""--grammar: the Karel model under its DSL grammar keeps the protocol's exactness through its one-pass score (the
fast path), a run with it never produces a syntax error, the checkpoint records it and twophase-decode follows
it, and bad uses are refused in one line."""
import json

import pytest
import torch

from twophase import beam_search, protocol, rescore_backward, sample
from twophase.constraints import Constrained, teacher_forced_allowed
from twophase.models.karel import KarelModel
from twophase.phase2.rescoring import shares_prefixes
from twophase.tasks.karel.dsl import VOCAB, try_parse
from twophase.tasks.karel.grammar import karel_grammar
from twophase.train import cli, decode
from twophase.train.checkpoint import load
from twophase.vocab import SPECIALS, Vocab

pytestmark = pytest.mark.usefixtures("one_thread")
VOC = Vocab(list(SPECIALS) + list(VOCAB))
R, C, MAX_LEN = 3, 4, 10


def constrained_karel(seed=0):
    torch.manual_seed(seed)
    model = KarelModel(len(VOC), R, C, embed_dim=6, hidden_size=12, channels=(4, 5), dropout=0.3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return Constrained(model, karel_grammar(VOC, MAX_LEN))  # in training mode, as the trainer leaves it


def grids(B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(B, 2, 32, R, C, generator=g) < 0.3).double()  # (B, P, 32, R, C)


def test_karel_model_under_its_grammar_is_exact_through_the_one_pass_score():
    c, source = constrained_karel(), grids()
    assert callable(c.score) and callable(c.advance) and not shares_prefixes(c)  # rows, one LSTM pass each
    s = beam_search(c, source, 4, MAX_LEN)
    drawn = sample(c, source, 4, MAX_LEN, generator=torch.Generator().manual_seed(3))
    for rows in (s, drawn):
        assert all(try_parse(VOC.decode(r)) is not None for r in rows.tokens.tolist())
        with torch.no_grad(), protocol.scoring_mode(c):
            enc = c.encode(source)
            torch.testing.assert_close(c.score(enc, rows.tokens, rows.owner), rows.scores, rtol=0, atol=1e-10)
            torch.testing.assert_close(protocol.step_score(c, enc, rows.tokens, rows.owner), rows.scores,
                                       rtol=0, atol=1e-10)
            assert teacher_forced_allowed(c, rows.tokens, rows.owner).all()
    coef = torch.linspace(-1.0, 2.0, len(s), dtype=torch.float64)
    c.zero_grad(set_to_none=True)
    with protocol.scoring_mode(c):
        (coef * protocol.step_score(c, c.encode(source), s.tokens, s.owner)).sum().backward()  # through step
    want = [p.grad.clone() for p in c.parameters()]
    for chunk in (1, 100):
        c.zero_grad(set_to_none=True)
        rescore_backward(c, source, s, coef, chunk)
        for p, w in zip(c.parameters(), want):
            torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-12)


def _argv(run, *extra):
    return ["--task", "karel", "--train-size", "8", "--valid-size", "3", "--hidden-size", "8", "--embed-dim", "4",
            "--mle-steps", "2", "--rl-steps", "1", "--mle-batch-size", "4", "--batch-size", "2", "--beam-size", "2",
            "--rescore-chunk", "3", "--eval-beam", "2", "--eval-every", "10", "--no-compare-mle", "--save-dir",
            str(run), *extra]


def test_a_karel_run_under_the_grammar_makes_no_syntax_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TWOPHASE_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert cli.main(_argv(run, "--export", "last")) == 0  # the recipe's default: --grammar on
    assert (run / "model_final.pt").is_file()  # read back through the model the task builds, without the grammar
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] in ("eval", "test")]
    assert evals and all(r["syntax_error_rate"] == 0 for r in evals)
    assert load(str(run / "checkpoint_last.pt"))["config"]["grammar"] == "on"
    grid = "\n".join(["........"] * 8)
    (tmp_path / "in.txt").write_text(json.dumps([[f"hero 0 0 E\n{grid}", f"hero 0 1 E\n{grid}"]]) + "\n")
    base = ["--checkpoint", str(run / "checkpoint_last.pt"), "--input", str(tmp_path / "in.txt"), "--beam-size", "3"]
    for extra, longest in (([], 30), (["--max-len", "8"], 7), (["--grammar", "off"], None)):
        assert decode.main(base + ["--output", str(tmp_path / "out.txt"), *extra]) == 0
        program = (tmp_path / "out.txt").read_text().strip()
        if longest:  # the checkpoint's grammar: a program, within the length
            assert try_parse(program) is not None and len(program.split()) <= longest
    assert decode.main(base + ["--max-len", "5"]) == 2
    assert capsys.readouterr().err.strip().endswith("cannot hold the shortest Karel program (5 tokens and EOS)")
    # resuming under another setting is refused
    assert cli.main(_argv(run, "--resume", "--grammar", "off")) == 2
    assert "--grammar on, not off" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--max-len", "7"], "training references are not in the task's grammar within --max-len"),
    (["--max-len", "4"], "--grammar on: --max-len 4 cannot hold the shortest Karel program"),
])
def test_bad_uses_are_one_line_errors(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.setenv("TWOPHASE_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(_argv(tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_task_without_grammar_refuses_the_flag(tmp_path, capsys):
    train = tmp_path / "t.tsv"
    train.write_text("a b\tx y\nc\tz\n")
    argv = ["--train", str(train), "--valid", str(train), "--grammar", "on", "--save-dir", str(tmp_path / "r"),
            "--mle-steps", "1", "--rl-steps", "0"]
    assert cli.main(argv) == 2
    assert "--grammar on: task 'tsv' declares no grammar" in capsys.readouterr().err
