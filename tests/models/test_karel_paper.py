"""--karel-model paper (Bunel et al.'s IOs2Seq, `twophase.models.karel_paper`): the protocol's exactness checks
(search scores = one-pass score = step score, exhaustive beam = brute force, chunked gradient exact over rows and
over the prefix tree), invariance to the order of the pairs, its flags, its checkpoints (old ones still load),
and `--preset karel-paper`."""
import pytest
import torch

from conftest import take_grads
from test_protocol import _all_sequences, _assert_same, _check_rows, _references
from twophase import Samples, beam_search, objectives, protocol, rescore_backward, sample
from benchmarks import karel as bench_karel
from twophase.models.karel import KarelModel
from twophase.models.karel_paper import PAPER_SIZES, KarelPaperModel
from twophase.tasks import TaskError
from twophase.tasks.karel.task import Karel
from twophase.train import checkpoint, cli, decode, startpoint
from twophase.config import Config

pytestmark = pytest.mark.usefixtures("one_thread")
V, R, C, B, P = 7, 3, 4, 3, 4


def tiny(seed=0, vocab=V, layers=2):
    torch.manual_seed(seed)
    model = KarelPaperModel(vocab, R, C, embed_dim=5, hidden_size=6, channels=4, blocks=1, pair_dim=5,
                            layers=layers, dropout=0.3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # peaked, varied distributions
    return model  # left in training mode: search and phase two must switch dropout off themselves


def grids(n=B, pairs=P, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, pairs, 32, R, C, generator=g) < 0.3).double()  # (B, P, 32, R, C)


class StepOnly(torch.nn.Module):
    """The same model without `score`: phase two then decodes the prefix tree with `step`, depth by depth, and
    the state's (N, P, L, H) rows are gathered node by node."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.pad_id, self.bos_id, self.eos_id = model.pad_id, model.bos_id, model.eos_id

    def encode(self, source):
        return self.model.encode(source)

    def init_state(self, enc, owner):
        return self.model.init_state(enc, owner)

    def step(self, enc, owner, prev, state):
        return self.model.step(enc, owner, prev, state)


@pytest.mark.parametrize("kind", ["beam", "sample"])
def test_search_scores_equal_one_pass_and_step_scores(kind):
    model, source = tiny(), grids()
    if kind == "beam":
        s = beam_search(model, source, 4, 6)
    else:
        s = sample(model, source, 4, 6, generator=torch.Generator().manual_seed(3))
    _check_rows(model, s, 6)
    assert model.training
    with torch.no_grad(), protocol.scoring_mode(model):
        enc = model.encode(source)
        torch.testing.assert_close(model.score(enc, s.tokens, s.owner), s.scores, rtol=0, atol=1e-10)
        torch.testing.assert_close(protocol.step_score(model, enc, s.tokens, s.owner), s.scores, rtol=0, atol=1e-10)
    assert (s.scores > -1e3).all()  # finite: no banned token was ever scored


def test_exhaustive_beam_equals_brute_force():
    model, source, max_len = tiny(vocab=6), grids(n=2), 3
    rows = _all_sequences(model, max_len)  # 3 generable tokens: 40 sequences
    s = beam_search(model, source, beam_size=1 + 3 + 9, max_len=max_len)  # every prefix shorter than max_len
    for b in range(2):
        with torch.no_grad(), protocol.scoring_mode(model):
            lp = model.score(model.encode(source), rows, torch.full((len(rows),), b))
        best = lp.topk(13)
        got = s.select(torch.nonzero(s.owner == b).squeeze(1))
        torch.testing.assert_close(got.scores, best.values, rtol=0, atol=1e-9)
        have = {tuple(r) + (model.pad_id,) * (max_len - len(r)) for r in got.tokens.tolist()}
        assert have == {tuple(rows[i].tolist()) for i in best.indices.tolist()}


@pytest.mark.parametrize("prefix_tree", [False, True])
def test_chunked_gradient_is_exact_at_every_chunk_size(prefix_tree):
    model, source = tiny(), grids()
    cand = beam_search(model, source, 3, 5)
    refs = _references(model, B)
    s = Samples.cat([cand, refs], model.pad_id)
    c = torch.cat([objectives.beam(torch.rand(len(cand), dtype=torch.float64, generator=torch.Generator()
                                              .manual_seed(5)), cand.scores, cand.owner, B, tokens=cand.tokens),
                   0.3 * objectives.mle(refs.owner, B)])
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        total = (c * model.score(model.encode(source), s.tokens, s.owner)).sum()
    total.backward()
    want = take_grads(model)
    assert float(want[0].abs().sum()) > 0  # the CNN's gradient crosses phase two's boundary
    runner = StepOnly(model) if prefix_tree else model
    for chunk in [*range(1, len(s), 2), len(s)]:
        stats = {}
        value = rescore_backward(runner, source, s, c, chunk_size=chunk, oom_retry=bool(chunk % 4 == 1),
                                 stats=stats)
        assert value == pytest.approx(float(total.detach()), abs=1e-10)
        _assert_same(take_grads(model), want)
    assert (stats["nodes"] < stats["positions"]) == prefix_tree  # one chunk: the tree shares prefixes, rows do not
    assert model.training


def test_indifferent_to_the_order_of_the_pairs():
    model, source = tiny(), grids()
    order = torch.tensor([2, 0, 3, 1])
    s = beam_search(model, source, 4, 6)
    t = beam_search(model, source[:, order], 4, 6)
    assert torch.equal(s.tokens, t.tokens) and torch.equal(s.owner, t.owner)
    torch.testing.assert_close(t.scores, s.scores, rtol=0, atol=1e-12)
    # and with gradients: the same parameter gradient
    c = torch.linspace(-1.0, 1.0, len(s), dtype=torch.float64)
    grads = []
    for src in (source, source[:, order]):
        rescore_backward(model, src, s, c, chunk_size=4)
        grads.append(take_grads(model))
    _assert_same(grads[1], grads[0])


def test_flags_size_the_model_and_bad_ones_are_refused():
    cfg = Config(task="karel", karel_model="paper", hidden_size=12, embed_dim=7, dropout=0.1, karel_channels=6,
                 karel_blocks=3, karel_pair_dim=9, karel_layers=1)
    task = Karel(cfg)
    model = task.build_model()
    assert isinstance(model, KarelPaperModel)
    assert model.config == dict(vocab_size=len(task.vocab), rows=8, cols=8, embed_dim=7, hidden_size=12,
                                channels=6, blocks=3, pair_dim=9, layers=1, dropout=0.1)
    assert model.lstm.num_layers == 1 and len(model.encoder.blocks) == 3 and model.init_h.shape == (1, 12)
    assert isinstance(Karel(Config(task="karel", hidden_size=12)).build_model(), KarelModel)  # pooled: the default
    with pytest.raises(TaskError, match="--karel-layers sizes --karel-model paper"):
        Karel(Config(task="karel", karel_layers=3))
    with pytest.raises(TaskError, match="--karel-channels must be even"):
        Karel(Config(task="karel", karel_model="paper", karel_channels=5))


def test_bad_karel_flags_exit_2_in_one_line(tmp_path, capsys):
    assert cli.main(["--task", "karel", "--karel-blocks", "3", "--save-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--karel-blocks sizes --karel-model paper" in err
    with pytest.raises(SystemExit) as stop:
        cli.main(["--task", "karel", "--karel-model", "transformer"])
    assert stop.value.code == 2


def test_paper_sizes_have_the_papers_parameter_count():
    """At their sizes on their 18x18 worlds and 52 tokens: the 12.45 M parameters of GandRL's IOs2Seq."""
    model = KarelPaperModel(52, 18, 18, **PAPER_SIZES)
    assert sum(p.numel() for p in model.parameters()) == 12_452_852


def test_preset_runs_saves_and_loads(tmp_path, monkeypatch, capsys):
    """--preset karel-paper with its sizes turned down: a run, its checkpoint rebuilt by decoding, and an old
    checkpoint (no --karel-* flags in its config) still loads as the pooled model."""
    parser = cli.build_parser()
    args = parser.parse_args(["--task", "karel", "--preset", "karel-paper"])
    parser.set_defaults(**startpoint.recipe_defaults(args))
    cfg = cli.config_from_args(parser.parse_args(["--task", "karel", "--preset", "karel-paper"]))
    assert (cfg.karel_model, cfg.hidden_size, cfg.embed_dim, cfg.karel_channels, cfg.karel_blocks,
            cfg.karel_pair_dim, cfg.karel_layers) == ("paper", 256, 256, 64, 2, 512, 2)
    assert (cfg.lr, cfg.mle_batch_size, cfg.beam_size, cfg.eval_beam, cfg.batch_size, cfg.rl_lr) == \
        (1e-4, 128, 64, 64, 16, 1e-5)
    assert cli.main(["--preset", "karel-paper", "--save-dir", str(tmp_path / "x")]) == 2
    assert "--preset karel-paper is a recipe for --task karel" in capsys.readouterr().err

    monkeypatch.setenv("TWOPHASE_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    small = ["--hidden-size", "8", "--embed-dim", "6", "--karel-channels", "4", "--karel-blocks", "1",
             "--karel-pair-dim", "8", "--mle-steps", "2", "--rl-steps", "1", "--mle-batch-size", "4",
             "--batch-size", "2", "--beam-size", "3", "--eval-beam", "2", "--train-size", "24", "--valid-size", "6"]
    assert cli.main(["--task", "karel", "--preset", "karel-paper", *small, "--no-compare-mle",
                     "--save-dir", str(run)]) == 0
    # the step costs' bench runs the same recipe (its numbers are docs/karel.md's; here it only has to run)
    rows = bench_karel.measure(["--preset", "karel-paper", *small], steps=1, rl_beams=[2], eval_tasks=3)
    assert [(r["kind"], r.get("beam")) for r in rows] == [("mle", None), ("rl", 2), ("eval", 2)]
    assert all(r["model"] == "paper" and r["cpu_s"] >= 0 for r in rows)
    path = run / "checkpoint_last.pt"
    model, task, saved = decode.load_model(str(path), torch.device("cpu"))
    assert isinstance(model, KarelPaperModel) and saved["karel_model"] == "paper"
    assert (model.config["hidden_size"], model.config["channels"], model.config["layers"]) == (8, 4, 2)
    state = checkpoint.load(path)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state["model"][name])

    old = dict(state, config={k: v for k, v in state["config"].items() if not k.startswith("karel_")})
    pooled = KarelModel(len(task.vocab), 8, 8, embed_dim=6, hidden_size=8, channels=(32, 32))
    old["model"] = pooled.state_dict()
    checkpoint.save_atomic(old, tmp_path / "old.pt")
    model, _, _ = decode.load_model(str(tmp_path / "old.pt"), torch.device("cpu"))
    assert isinstance(model, KarelModel)
    assert all(torch.equal(v, pooled.state_dict()[k]) for k, v in model.state_dict().items())
