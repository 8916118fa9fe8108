"""--objective distill end to end: a tiny LSTM teacher trained here, a narrower student distilled from its
checkpoint with references mixed in, resumed bit-identically, through twophase.fit too; --grad-accum's step
normalised by its whole generation's tokens as TRL's (against a float64 autograd); its flags refused in one line
where they would do nothing or where the teacher cannot teach (another vocabulary)."""
import json

import pytest
import torch

import twophase
from conftest import take_grads
from taskfiles import write_task
from test_cli import _fails_with_one_line
from test_distillation import jsd, step_distributions
from twophase import protocol
from twophase.train import cli, recipe, steps
from twophase.train.steps.parts import Gradient

TINY = ["--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size", "3", "--rescore-chunk",
        "5", "--max-len", "8", "--eval-every", "100", "--save-every", "100", "--lr", "0.05", "--rl-lr", "0.01"]
DISTILL = ["--objective", "distill", "--sampler", "sample", "--temperature", "0.7", "--distill-beta", "0.5",
           "--include-reference", "--hidden-size", "12"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    write_task(d / "train.tsv", "reverse", 120, seed=0)
    write_task(d / "valid.tsv", "reverse", 9, seed=1)
    flags = ["--train", str(d / "train.tsv"), "--valid", str(d / "valid.tsv")]
    teacher = d / "teacher"
    assert cli.main([*flags, *TINY, "--hidden-size", "24", "--mle-steps", "8", "--rl-steps", "0",
                     "--no-compare-mle", "--save-dir", str(teacher)]) == 0
    return flags, str(teacher / "checkpoint_last.pt"), d


def _rl_rows(save):
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "rl" and "loss" in r]


def test_distils_a_checkpoint_with_compare_mle_and_resumes(data, tmp_path, one_thread, monkeypatch):
    """A relative --teacher is recorded as an absolute path: --resume from another directory finds it."""
    flags, teacher, d = data
    run = [*flags, *TINY, *DISTILL, "--mle-steps", "3"]
    full = tmp_path / "full"
    assert cli.main([*run, "--teacher", teacher, "--rl-steps", "3", "--save-dir", str(full)]) == 0  # --compare-mle
    rl = _rl_rows(full)
    assert len(rl) == 3 and all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rl)
    part = tmp_path / "part"
    monkeypatch.chdir(d)
    assert cli.main([*run, "--teacher", "teacher/checkpoint_last.pt", "--rl-steps", "2", "--no-compare-mle",
                     "--save-dir", str(part)]) == 0
    assert json.loads((part / "config.json").read_text())["config"]["teacher"] == teacher
    monkeypatch.chdir(tmp_path)
    assert cli.main([*run, "--rl-steps", "3", "--no-compare-mle", "--save-dir", str(part), "--resume"]) == 0
    a = torch.load(full / "checkpoint_last.pt", weights_only=True)["model"]
    b = torch.load(part / "checkpoint_last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fit_distils_too(data, tmp_path, one_thread):
    flags, teacher, d = data
    result = twophase.fit(twophase.Config(train=flags[1], valid=flags[3], objective="distill", teacher=teacher,
                                          hidden_size=12, embed_dim=8, batch_size=4, mle_batch_size=8, beam_size=2,
                                          max_len=8, mle_steps=2, rl_steps=2, compare_mle=False, eval_every=100,
                                          save_every=100, save_dir=str(tmp_path / "fit")))
    assert result is not None and (tmp_path / "fit" / "checkpoint_last.pt").is_file()
    header = result.table.splitlines()[0].split()  # the column is named after what the phase did
    assert header[-1] == "distilled" and "RL" not in header, result.table


def test_grad_accum_divides_by_the_whole_generations_tokens(data, tmp_path, one_thread, monkeypatch):
    """--grad-accum 2: TRL generates once per accumulation and divides every micro-batch's summed divergence by
    the generation's scored tokens (num_items_in_batch). The step's gradient equals a float64 autograd of the
    divergence summed over both batches' rows (references mixed in) over their tokens together; the batches'
    token counts differ, so a per-batch normaliser (each batch's tokens times 2) would not."""
    flags, teacher, _ = data
    cfg = twophase.Config(train=flags[1], valid=flags[3], objective="distill", teacher=teacher, hidden_size=12,
                          embed_dim=8, batch_size=3, grad_accum=2, beam_size=3, sampler="sample", temperature=0.7,
                          distill_beta=0.5, include_reference=True, max_len=8, rescore_chunk=5, compare_mle=False,
                          save_dir=str(tmp_path))
    tr = recipe.setup(cfg).trainer  # its steps, taken directly
    tr.model.double(), tr.parts.teacher.double()
    seen, grads = [], []
    backward = tr.rl.gradient.backward

    def recorded(p, settings, source, rows, coef, graph):
        seen.append((source, rows))
        return backward(p, settings, source, rows, coef, graph)

    tr.rl.gradient = Gradient(tr.rl.gradient.section, tr.rl.gradient.search, recorded)
    monkeypatch.setattr(steps.parts, "update", lambda p, settings, loss: grads.append(take_grads(tr.model))
                        or {"grad_norm": 0.0, "skipped": 0})
    loss = tr.rl_step()["loss"]

    student, teacher_model = tr.model, tr.parts.teacher
    allowed = ~student.banned  # banned tokens: probability 0 in both, left out (kl_div would read 0 * (-inf))
    total, tokens = 0.0, []
    with protocol.scoring_mode(student), protocol.scoring_mode(teacher_model):
        for source, rows in seen:
            ls = step_distributions(student, student.encode(source), rows.tokens, rows.owner)
            with torch.no_grad():
                lt = step_distributions(teacher_model, teacher_model.encode(source), rows.tokens, rows.owner)
            mask = protocol.target_mask(rows.tokens, student.pad_id, student.eos_id)
            total = total + jsd(ls[..., allowed], lt[..., allowed], 0.5, 0.7)[mask].sum()
            tokens.append(int(mask.sum()))
    assert len(seen) == 2 and tokens[0] != tokens[1]
    want_loss = total / sum(tokens)
    want_loss.backward()
    assert loss == pytest.approx(want_loss.item(), rel=1e-9)
    for got, want in zip(grads[0], take_grads(student)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("extra,match", [
    (["--objective", "distill"], "--objective distill needs --teacher PATH"),
    (["--teacher", "x.pt"], "--teacher applies to --objective distill only"),
    (["--distill-beta", "0.5"], "--distill-beta applies to --objective distill only"),
    (["--objective", "distill", "--teacher", "x.pt", "--distill-beta", "2"], "--distill-beta"),
    (["--objective", "distill", "--teacher", "x.pt", "--mle-weight", "0.5"], "does not take --mle-weight"),
    (["--objective", "policy", "--sampler", "sample", "--include-reference"],
     "--include-reference applies to --objective beam or distill only"),
])
def test_bad_flags_exit_2_with_one_line(data, extra, match, capsys, tmp_path):
    flags, _, _ = data
    _fails_with_one_line([*flags, *TINY, *extra, "--mle-steps", "1", "--rl-steps", "1", "--no-compare-mle",
                          "--save-dir", str(tmp_path / "x")], capsys, match)


def test_teacher_of_another_vocabulary_is_refused(data, tmp_path, capsys, one_thread):
    flags, teacher, d = data
    write_task(d / "other.tsv", "reverse", 60, seed=5, alphabet="abcd")
    other = tmp_path / "other"
    assert cli.main(["--train", str(d / "other.tsv"), "--valid", flags[3], *TINY, "--hidden-size", "12",
                     "--mle-steps", "1", "--rl-steps", "0", "--no-compare-mle", "--save-dir", str(other)]) == 0
    capsys.readouterr()
    _fails_with_one_line([*flags, *TINY, *DISTILL, "--teacher", str(other / "checkpoint_last.pt"), "--mle-steps",
                          "1", "--rl-steps", "1", "--save-dir", str(tmp_path / "x")], capsys, "vocabulary")


def test_a_folder_that_is_no_model_is_refused_before_loading(data, tmp_path, capsys):
    flags, _, _ = data
    (tmp_path / "empty").mkdir()
    _fails_with_one_line([*flags, *TINY, *DISTILL, "--teacher", str(tmp_path / "empty"), "--mle-steps", "1",
                          "--rl-steps", "1", "--save-dir", str(tmp_path / "x")], capsys,
                         f"--teacher {tmp_path / 'empty'}: no config.json")


def test_a_hugging_face_folder_teaches_a_t5_student(tmp_path, one_thread, monkeypatch):
    """--hf-model student, --teacher a wider T5 folder of the same tokenizer: one MLE and two RL steps."""
    pytest.importorskip("transformers")
    import hf_tiny

    hf_tiny.save(tmp_path / "student", "t5", seed=1)
    teacher = hf_tiny.seq2seq("t5", seed=2, width=24)
    teacher.save_pretrained(tmp_path / "teacher")
    lines = [("a b c", "c b a"), ("d e", "e d"), ("f g h", "h g f"), ("b d", "d b"), ("g a", "a g")]
    for name in ("train.tsv", "valid.tsv"):
        (tmp_path / name).write_text("".join(f"{s}\t{t}\n" for s, t in lines))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--train", "train.tsv", "--valid", "valid.tsv", "--hf-model", "student", "--teacher",
                     "teacher", "--objective", "distill", "--sampler", "sample", "--distill-beta", "0",
                     "--batch-size", "3", "--mle-batch-size", "5", "--beam-size", "2", "--max-len", "6",
                     "--mle-steps", "1", "--rl-steps", "2", "--no-compare-mle", "--eval-every", "100",
                     "--save-dir", "run"]) == 0
    rl = _rl_rows(tmp_path / "run")
    assert len(rl) == 2 and all(r["loss"] > 0 for r in rl)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A T5 and a GPT-2 folder, made outside any test's captured stderr (transformers' log handler keeps the
    stream it first sees)."""
    pytest.importorskip("transformers")
    import hf_tiny

    d = tmp_path_factory.mktemp("hf")
    hf_tiny.save(d / "t5", "t5", seed=1)
    hf_tiny.causal("gpt2", seed=1).save_pretrained(d / "gpt2")
    return d


def test_teachers_of_another_kind_are_refused_naming_the_pairs_that_work(data, hf_folders, tmp_path, capsys):
    """An LSTM checkpoint for a T5 student, a T5 folder for an LSTM student, a causal LM folder for a T5 student:
    each one line naming the teacher's kind, the student's and the pairs that work, before any step."""
    flags, teacher, d = data
    tmp_path = hf_folders
    t5_student = [*flags, "--hf-model", str(tmp_path / "t5"), "--objective", "distill", "--sampler", "sample",
                  "--batch-size", "3", "--beam-size", "2", "--max-len", "12", "--mle-steps", "0", "--rl-steps", "1",
                  "--no-compare-mle"]
    capsys.readouterr()  # the folders' saving
    pairs = "a built-in LSTM checkpoint teaches a built-in LSTM student"
    for argv, kinds in [
            ([*t5_student, "--teacher", teacher], "a built-in LSTM cannot teach this run's model, a Hugging Face "
                                                  "encoder-decoder"),
            ([*flags, *TINY, *DISTILL, "--teacher", str(tmp_path / "t5"), "--mle-steps", "0", "--rl-steps", "1"],
             "a Hugging Face encoder-decoder cannot teach this run's model, a built-in LSTM"),
            ([*t5_student, "--teacher", str(tmp_path / "gpt2")], "a Hugging Face causal LM cannot teach this run's "
                                                                  "model, a Hugging Face encoder-decoder")]:
        _fails_with_one_line([*argv, "--save-dir", str(tmp_path / "x")], capsys, kinds)
        _fails_with_one_line([*argv, "--save-dir", str(tmp_path / "x")], capsys, pairs)
        assert not (tmp_path / "x" / "metrics.jsonl").exists()
