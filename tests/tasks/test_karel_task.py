"""--task karel: the model follows the protocol exactly, the execution reward never reads the held-out pair, the
metrics on hand-made hypotheses, and a tiny end-to-end run (data generated into a temporary cache)."""
import json
from pathlib import Path

import pytest
import torch

from twophase import beam_search, protocol, rescore_backward, rewards
from twophase.models.karel import KarelModel
from twophase.tasks.base import Example
from twophase.tasks.karel import World
from twophase.tasks.karel.reward import ExecutionReward
from twophase.tasks.karel.task import Karel
from twophase.train import cli, decode
from twophase.config import Config
from twophase.rewards.calls import score

pytestmark = pytest.mark.usefixtures("one_thread")
V, R, C = 9, 3, 4


ROOT = Path(__file__).resolve().parents[2]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = KarelModel(V, R, C, embed_dim=6, hidden_size=12, channels=(4, 5), dropout=0.3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # peaked, varied distributions
    return model  # left in training mode: search and phase two must switch dropout off themselves


def constrained_model(max_len: int, scale: float = 1.0):
    """`Constrained` over a tiny float64 Karel model of the DSL's real vocabulary, under the DSL grammar
    (`--grammar on`); weights times `scale` (3.0: peaked, varied distributions, as `tiny_model`)."""
    from twophase.constraints import Constrained
    from twophase.tasks.karel.dsl import VOCAB
    from twophase.tasks.karel.grammar import karel_grammar
    from twophase.vocab import SPECIALS, Vocab
    voc = Vocab(list(SPECIALS) + list(VOCAB))
    torch.manual_seed(0)
    inner = KarelModel(len(voc), R, C, embed_dim=6, hidden_size=12, channels=(4, 5)).double()
    with torch.no_grad():
        for p in inner.parameters():
            p.mul_(scale)
    return Constrained(inner, karel_grammar(voc, max_len))


def grids(B=3, P=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(B, P, 32, R, C, generator=g) < 0.3).double()  # (B, P, 32, R, C)


def test_search_scores_equal_teacher_forced_log_probs_and_specials_never_proposed():
    model, source = tiny_model(), grids()
    s = beam_search(model, source, 4, 6)
    with protocol.scoring_mode(model):
        enc = model.encode(source)
        one_pass = model.score(enc, s.tokens, s.owner)
        stepped = protocol.step_score(model, enc, s.tokens, s.owner)
    torch.testing.assert_close(one_pass, s.scores.to(one_pass.dtype), rtol=0, atol=1e-10)
    torch.testing.assert_close(stepped, one_pass, rtol=0, atol=1e-10)
    assert not ((s.tokens == model.bos_id).any() or (s.tokens[:, 0] == model.pad_id).any())
    assert (s.scores > -1e3).all()  # finite: no banned token was ever scored


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_gradient_equals_one_backward(chunk):
    model, source = tiny_model(), grids()
    s = beam_search(model, source, 3, 5)
    c = torch.linspace(-1.0, 2.0, len(s), dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        want_loss = (c * model.score(model.encode(source), s.tokens, s.owner)).sum()
    want_loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss = rescore_backward(model, source, s, c, chunk)
    assert loss == pytest.approx(float(want_loss.detach()), abs=1e-9)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-10)
    assert any(float(w.abs().sum()) > 0 for w in want[:4])  # the CNN's gradient crossed phase two's boundary


def world(col, direction):
    return World.from_text(f"hero 0 {col} {direction}\n...")


MOVE, IFELSE = "DEF run m( move m)", "DEF run m( IFELSE c( frontIsClear c) i( move i) ELSE e( turnLeft e) m)"


class Untouchable:
    """A held-out pair that fails any use: the reward must never receive it."""

    def __getattr__(self, name):
        raise AssertionError("the reward read held_out")

    def __iter__(self):
        raise AssertionError("the reward read held_out")


def hand_made(poison_held_out=False):
    spec = ((world(0, "E"), world(1, "E")),)  # move and IFELSE both pass it
    held_1 = (world(1, "E"), world(2, "E"))  # move and IFELSE both pass it
    held_2 = (world(2, "E"), world(2, "N"))  # wall ahead: move crashes, IFELSE turns left
    ex1 = Example(spec, [MOVE], {"spec": spec}, hidden={"held_out": Untouchable() if poison_held_out else held_1})
    ex2 = Example(spec, [IFELSE], {"spec": spec}, hidden={"held_out": Untouchable() if poison_held_out else held_2})
    hyps = [MOVE, MOVE, IFELSE, "DEF run m( move", "DEF run m( move move move m)", "DEF run m( turnLeft m)"]
    return hyps, [ex1, ex2, ex2, ex1, ex1, ex1]


def test_reward_passes_the_spec_only_and_never_reads_held_out():
    fn = ExecutionReward()
    reward = rewards.get("twophase.tasks.karel.reward:karel")
    assert Karel.default_reward == "twophase.tasks.karel.reward:karel"
    hyps, examples = hand_made(poison_held_out=True)
    assert score(reward, hyps, examples) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # the same through a fresh instance, to read its counters
    assert score(rewards.validated(fn, "k"), hyps, examples) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert fn.counts == {"candidates": 6, "ok": 3, "syntax_error": 1, "runtime_error": 1, "wrong": 1}
    assert fn.rates() == {"passed": 0.5, "syntax_error": 1 / 6, "runtime_error": 1 / 6}
    seen = {}  # a reward taking every keyword still gets no held-out pair
    greedy_kw = rewards.validated(lambda h, r, **kw: seen.update(kw) or [0.0] * len(h), "all")
    score(greedy_kw, hyps, examples)
    assert set(seen) == {"sources", "spec"}


def test_metrics_on_hand_made_hypotheses():
    task = Karel(Config(task="karel"))
    hyps, examples = hand_made()
    scores = task.scores(task.metric_sums(hyps, examples))
    assert scores == {"generalization": 2 / 6, "exact_match": 2 / 6, "spec_accuracy": 3 / 6,
                      "syntax_error_rate": 1 / 6, "runtime_error_rate": 1 / 6, "n": 6}
    assert task.main_metric == "generalization" and {m.key for m in task.metrics} >= set(scores) - {"n"}


def test_refuses_data_files(capsys, tmp_path):
    assert cli.main(["--task", "karel", "--train", "a.tsv", "--valid", "b.tsv", "--save-dir", str(tmp_path)]) == 2
    assert "--task karel generates its data" in capsys.readouterr().err


def test_tiny_end_to_end_run_and_decode(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TWOPHASE_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    argv = ["--task", "karel", "--train-size", "24", "--valid-size", "6", "--hidden-size", "16", "--embed-dim", "8",
            "--mle-steps", "3", "--rl-steps", "2", "--mle-batch-size", "8", "--batch-size", "4", "--beam-size", "3",
            "--max-len", "31", "--rescore-chunk", "5", "--eval-beam", "2", "--no-compare-mle", "--save-dir", str(run),
            "--include-reference", "--test-beam", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "24 train / 6 valid / 12 test tasks generated" in out and "generalization (top-1)" in out
    table = out.splitlines()
    table = table[next(i for i, line in enumerate(table) if line.rstrip().endswith("RL") and "end of MLE" in line):]
    rows = table[:next(i for i, line in enumerate(table) if line.startswith("peak memory"))]
    assert len({len(line) for line in rows}) == 1, rows  # the long labels ("valid passes the 5 spec pairs") fit
    assert "test generalization (filtered) @3" in out and "baselines (24 training programs)" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] in ("eval", "test")]
    assert [r["phase"] for r in evals] == ["eval", "eval", "test"] and evals[-1]["n"] == 12
    assert all({"generalization", "exact_match", "syntax_error_rate", "reward", "filtered_generalization"} <= set(r)
               for r in evals)
    assert {"generalization@3", "spec_in_beam@3"} <= set(evals[-1])
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [4, 5]
    assert (tmp_path / "cache" / "karel").is_dir()  # the data went to the cache it was told
    # decode: a JSON line of [input, output] pairs of the training grid size gives one program line
    grid = "\n".join(["........"] * 8)
    example = (ROOT / "examples" / "karel_input.jsonl").read_text()  # the documented example input
    (tmp_path / "in.txt").write_text(json.dumps([[f"hero 0 0 E\n{grid}", f"hero 0 1 E\n{grid}"]]) + "\n\n" + example)
    args = ["--checkpoint", str(run / "checkpoint_last.pt"), "--input", str(tmp_path / "in.txt"), "--beam-size", "2"]
    assert decode.main(args + ["--output", str(tmp_path / "out.txt")]) == 0
    got = (tmp_path / "out.txt").read_text().split("\n")
    assert len(got) == 4 and got[0] and got[2] and got[1] == got[3] == ""
    (tmp_path / "bad.txt").write_text(example + json.dumps([["hero 0 0 E\n...", "hero 0 0 E\n..."]]) + "\n")
    assert decode.main(["--checkpoint", str(run / "checkpoint_last.pt"), "--input", str(tmp_path / "bad.txt")]) == 2
    assert "bad.txt:2: karel source: expected one or more pairs of 8x8 worlds" in capsys.readouterr().err


def test_specifications_of_different_sizes_batch_exactly():
    """A one-pair and a two-pair specification in one batch: each encodes as it does alone (the short one repeats
    its pair, which the model's maximum over pairs ignores)."""
    task = Karel(Config(task="karel"))
    one = Example(((world(0, "E"), world(1, "E")),))
    two = Example(((world(0, "E"), world(1, "E")), (world(1, "E"), world(2, "N"))))
    rows, cols = world(0, "E").rows, world(0, "E").cols
    torch.manual_seed(0)
    model = KarelModel(len(task.vocab), rows, cols, embed_dim=6, hidden_size=12, channels=(4, 5), dropout=0.0)
    with torch.no_grad():
        together = model.encode(task.collate([one, two], "cpu"))["spec"]
        alone = [model.encode(task.collate([ex], "cpu"))["spec"][0] for ex in (one, two)]
    torch.testing.assert_close(together, torch.stack(alone))
