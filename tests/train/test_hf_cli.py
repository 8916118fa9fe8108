"""`train.py --task tsv --hf-model DIR` end to end on tiny T5 and GPT-2 folders (save_pretrained of a random model
and the word-level tokenizer of hf_tiny): MLE, RL, validation, --compare-mle, the test split, hf_final, --resume,
twophase-decode, the strings a reward receives, and one-line refusals of bad folders and flags; hf_final on Marian,
BART and Llama folders too, and an export that would reload otherwise refused."""
import importlib.util
import json
import sys

import pytest
import torch

if importlib.util.find_spec("transformers") is None:  # only a missing extra skips: a broken install fails
    pytest.skip("transformers is not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import tasks  # noqa: E402
from twophase.tasks.base import Example  # noqa: E402
from twophase.train import cli, decode  # noqa: E402
from twophase.config import Config  # noqa: E402

import hf_tiny  # noqa: E402
from test_cli import _fails_with_one_line  # noqa: E402

WORDS = set(hf_tiny.WORDS)
# A reward plug-in in the run's working directory: it records every call, then scores exact matches.
RECORDER = '''import json
def reward(hyps, refs, sources):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps({"hyps": hyps, "refs": refs, "sources": sources}) + "\\n")
    return [float(h in r) for h, r in zip(hyps, refs)]
'''
TINY = ["--batch-size", "3", "--mle-batch-size", "6", "--beam-size", "2", "--max-len", "6", "--max-src-len", "8",
        "--eval-every", "3", "--reward", "recorder:reward"]


def _write_tsv(path, lines):
    path.write_text("".join(f"{s}\t{t}\n" for s, t in lines))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Both models' folders and the TSV files: reversed words; one training target holds a word the tokenizer
    does not know (z), which no candidate can spell."""
    d = tmp_path_factory.mktemp("hf")
    hf_tiny.save(d / "t5", "t5", seed=1)
    hf_tiny.save(d / "gpt2", "gpt2")
    for kind in ("marian", "bart"):
        hf_tiny.save(d / kind, kind, seed=2)
    hf_tiny.save(d / "llama", "llama")
    def reversed_(sources):
        return [(src, " ".join(reversed(src.split()))) for src in sources]
    _write_tsv(d / "train.tsv", reversed_(["a b c", "d e", "f", "g h a", "b d", "c e g", "h", "a f", "e b c",
                                           "g d"]) + [("a b", "z a")])
    _write_tsv(d / "valid.tsv", reversed_(["b a", "c d e", "f g"]))
    _write_tsv(d / "test.tsv", reversed_(["h g", "a c", "d"]))
    (d / "recorder.py").write_text(RECORDER)
    return d


def _run(folder, kind, *extra):
    argv = ["--train", "train.tsv", "--valid", "valid.tsv", "--hf-model", kind, "--save-dir", f"run_{kind}", *TINY]
    return cli.main(argv + list(extra))


@pytest.mark.parametrize("kind", ["t5", "gpt2"])
def test_hf_model_trains_saves_resumes_and_decodes(kind, folder, monkeypatch, capsys, one_thread):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    (folder / "calls.jsonl").unlink(missing_ok=True)
    assert _run(folder, kind, "--mle-steps", "3", "--rl-steps", "2", "--test", "test.tsv", "--compare-mle") == 0
    out = capsys.readouterr().out
    assert "1 of 11 training references read back otherwise" in out and "'z a' -> 'a'" in out
    save = folder / f"run_{kind}"
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"]) for r in rows if r["phase"] in ("mle", "rl")] == \
        [(1, "mle"), (2, "mle"), (3, "mle"), (4, "rl"), (5, "rl")]
    assert [(r["step"], r["after"]) for r in rows if r["phase"] == "eval"][:2] == [(3, "mle"), (5, "rl")]
    assert {r["model"] for r in rows if r["phase"] == "test"} == {"mle", "mle-continued", "rl"}
    assert all(r["n"] == 3 for r in rows if r["phase"] == "test")

    # The reward saw text: references and sources as in the files, candidates decoded without special tokens.
    calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    rl_calls = [c for c in calls if len(c["hyps"]) == 3 * 2]  # an RL step's B x K candidates
    assert rl_calls and all(c["sources"][i] in ("a b", *(r[0][::-1] for r in c["refs"]))
                            for c in rl_calls for i in range(6))
    hyps = [h for c in calls for h in c["hyps"]]
    assert all(set(h.split()) <= WORDS for h in hyps), hyps  # no <pad>, </s>, <s> or <unk> in any string
    assert any(h for c in rl_calls for h in c["hyps"])

    # hf_final is the final model (checkpoint_last.pt's parameters) and the tokenizer, loadable by transformers.
    auto = AutoModelForSeq2SeqLM if kind == "t5" else AutoModelForCausalLM
    final = auto.from_pretrained(save / "hf_final", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(save / "hf_final", local_files_only=True)
    assert tokenizer("a b", add_special_tokens=False)["input_ids"] == [4, 5]
    last = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert last["step"] == 5
    for name, p in final.state_dict().items():
        assert torch.equal(p, last["model"]["model." + name]), name

    # --resume to more RL steps continues the run; hf_final is rewritten from the new end.
    assert _run(folder, kind, "--mle-steps", "3", "--rl-steps", "3", "--test", "test.tsv", "--resume") == 0
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] in ("mle", "rl")] == [1, 2, 3, 4, 5, 6]
    last = torch.load(save / "checkpoint_last.pt", weights_only=True)
    final = auto.from_pretrained(save / "hf_final", local_files_only=True)
    assert last["step"] == 6 and all(torch.equal(p, last["model"]["model." + n]) for n, p in final.state_dict().items())

    other = "gpt2" if kind == "t5" else "t5"
    capsys.readouterr()  # from_pretrained's progress bars
    _fails_with_one_line(["--train", "train.tsv", "--valid", "valid.tsv", "--hf-model", other, "--save-dir",
                          f"run_{kind}", "--resume", *TINY], capsys, f"was trained with --hf-model {folder / kind}")

    # twophase-decode reads the folder recorded in the checkpoint, or --hf-model (the run's hf_final holds both).
    (folder / "in.txt").write_text("a b c\n\nd\n")
    capsys.readouterr()
    outputs = []
    for extra in ([], ["--hf-model", str(save / "hf_final")]):
        assert decode.main(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", "in.txt",
                            "--output", "out.txt", "--beam-size", "2", *extra]) == 0
        outputs.append((folder / "out.txt").read_text())
    lines = outputs[0].split("\n")
    assert outputs[0] == outputs[1] and len(lines) == 4 and lines[1] == "" and set(outputs[0].split()) <= WORDS
    assert capsys.readouterr().err == ""

    # Decoding checks its input as training did: --max-src-len, and the model's positions (GPT-2: 64).
    (folder / "long.txt").write_text("a\n" + " ".join(["a"] * 9) + "\n")
    _fails_with_one_line(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", "long.txt"], capsys,
                         f"long.txt:2: source has {9 + (kind == 't5')} tokens, more than the training limit of "
                         "--max-src-len 8",  # T5's tokenizer appends </s>
                         entry=decode.main)
    if kind == "gpt2":
        _fails_with_one_line(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", "in.txt", "--max-len",
                              "62"], capsys, "in.txt:1: source has 3 tokens; with --max-len 62 the model needs 65 "
                              "positions, more than its 64", entry=decode.main)


@pytest.mark.parametrize("kind", ["marian", "bart", "llama"])
def test_hf_final_is_the_model_it_trained(kind, folder, monkeypatch, capsys, one_thread):
    """hf_final reloaded with from_pretrained is the trained checkpoint, parameter by parameter and in its logits,
    for the families beside T5 and GPT-2 (above). Marian's sinusoidal position tables require grad under
    transformers 5 but its save_pretrained drops them (from_pretrained rebuilds them): they are not trained."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    assert _run(folder, kind, "--mle-steps", "4", "--rl-steps", "1", "--no-compare-mle", "--lr", "0.05") == 0
    save = folder / f"run_{kind}"
    assert "base_model" not in torch.load(save / "checkpoint_last.pt", weights_only=True)  # nothing frozen it needs
    trained, task, _ = decode.load_model(str(save / "checkpoint_last.pt"), torch.device("cpu"))
    auto = AutoModelForCausalLM if kind == "llama" else AutoModelForSeq2SeqLM
    final = auto.from_pretrained(save / "hf_final", local_files_only=True).eval()
    mine = dict(trained.model.named_parameters())
    assert all(torch.equal(p, mine[name]) for name, p in final.named_parameters())
    source = task.collate([Example("a b c", ["c b a"]), Example("d e", ["e d"])], torch.device("cpu"))
    prefix = {} if kind == "llama" else {"decoder_input_ids": torch.tensor([[0, 6, 5], [0, 8, 1]])}
    with torch.no_grad():
        got, want = final(**source, **prefix).logits, trained.model(**source, **prefix).logits
    assert torch.equal(got, want), (got - want).abs().max()
    start = (hf_tiny.causal(kind) if kind == "llama" else hf_tiny.seq2seq(kind, seed=2)).float()
    assert not torch.equal(final.get_input_embeddings().weight, start.get_input_embeddings().weight)  # trained


def test_an_export_that_reloads_otherwise_is_refused(folder, monkeypatch, capsys, one_thread):
    """Trained as before the fix (the position tables too), hf_final would reload as another model: the export
    is read back with from_pretrained, found to differ and refused in one line; the checkpoint keeps the model."""
    from twophase.models.hf import seq2seq
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(seq2seq, "freeze_unsaved", lambda model: [])
    argv = ["--train", "train.tsv", "--valid", "valid.tsv", "--hf-model", "marian", "--save-dir", "run_unfrozen",
            *TINY, "--mle-steps", "2", "--rl-steps", "0"]
    _fails_with_one_line(argv, capsys, "hf_final: reloaded with from_pretrained, its parameter "
                                      "model.encoder.embed_positions.weight differs from the trained model's")
    save = folder / "run_unfrozen"
    assert not (save / "hf_final").exists() and not (save / ".hf_final.tmp").exists()
    assert torch.load(save / "checkpoint_last.pt", weights_only=True)["step"] == 2


def test_ids_and_strings_of_the_task(folder):
    """Seq2seq targets: the tokenizer's encoding without its final eos (the row's eos is the model's); sources keep
    their special tokens; candidates decode up to eos without special tokens; unknown source words are named."""
    task = tasks.build(Config(train="train.tsv", valid="valid.tsv", hf_model=str(folder / "t5")))
    assert type(task).__name__ == "HFTSV" and task.spec == "tsv"
    assert task.target_ids(Example("a b", ["c d", "e"])) == [[6, 7], [8]]
    source = task.collate([Example("a  b"), Example("c")], "cpu")
    assert source["input_ids"].tolist() == [[4, 5, hf_tiny.EOS], [6, hf_tiny.EOS, 0]]
    assert source["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert task.detokenize([hf_tiny.BOS, 6, 3, 7, hf_tiny.EOS, 8, 0]) == "c d"
    assert task.unknown_source_tokens("a z b") == ["z"]
    causal = tasks.build(Config(train="train.tsv", valid="valid.tsv", hf_model=str(folder / "gpt2"),
                                max_src_len=8, max_len=6))
    assert causal.target_ids(Example("a b", ["c d"])) == [[6, 7]]
    assert causal.collate([Example("a b")], "cpu")["input_ids"].tolist() == [[4, 5]]


def _folder_without_tokenizer(tmp_path, _):
    hf_tiny.causal("gpt2").save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _unsupported_folder(tmp_path, _):
    from transformers import ViTConfig
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(
        tmp_path / "vit")
    hf_tiny.tokenizer().save_pretrained(tmp_path / "vit")
    return tmp_path / "vit"


@pytest.mark.parametrize("make,flags,match", [
    (lambda tmp, f: tmp / "nope", [], "nope: no such directory"),
    (lambda tmp, f: f / "train.tsv", [], "train.tsv: not a directory (a model's save_pretrained folder is"),
    (_folder_without_tokenizer, [], "no tokenizer (tokenizer_config.json or tokenizer.json)"),
    (_unsupported_folder, [], "model type 'vit' has no causal language model"),
    (lambda tmp, f: f / "gpt2", [], "the model has 64 positions, fewer than --max-src-len 200 + --max-len 32"),
    (lambda tmp, f: f / "t5", ["--hidden-size", "32"], "--hf-model: --hidden-size sets the built-in LSTM"),
    (lambda tmp, f: f / "t5", ["--bidirectional"], "--hf-model: --bidirectional sets the built-in LSTM"),
    (lambda tmp, f: f / "t5", ["--char-target"], "--hf-model: --char-target splits text"),
    (lambda tmp, f: f / "t5", ["--task", "karel"], "--hf-model trains on --train/--valid files (--task tsv), not"),
])
def test_bad_hf_model_input_exits_2_with_one_line(make, flags, match, folder, tmp_path, capsys):
    argv = ["--train", str(folder / "train.tsv"), "--valid", str(folder / "valid.tsv"), "--hf-model",
            str(make(tmp_path, folder)), "--save-dir", str(tmp_path / "run"), *flags]
    capsys.readouterr()  # save_pretrained's progress bar
    _fails_with_one_line(argv, capsys, match)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_hf_model_needs_tsv_files_and_transformers(folder, tmp_path, capsys, monkeypatch):
    _fails_with_one_line(["--hf-model", str(folder / "t5"), "--save-dir", str(tmp_path)], capsys,
                         "--hf-model needs --train and --valid files")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the extra were not installed
    _fails_with_one_line(["--train", str(folder / "train.tsv"), "--valid", str(folder / "valid.tsv"),
                          "--hf-model", str(folder / "t5"), "--save-dir", str(tmp_path)], capsys,
                         "--hf-model needs transformers")
