"""Coming from TRL, end to end through `train.py --hf-model` (docs/trl.md): a JSONL prompt dataset without
references and with an extra column, a reward in TRL's signature reading that column plus a second weighted
reward, LoRA adapters on a tiny GPT-2 (trained, checkpointed, resumed bit-exactly, saved, decoded) and the same
data on a tiny T5; chat prompts through a chat template; each new flag's bad input in one line."""
import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None:
    pytest.skip("transformers and peft are not installed (pip install twophase[hf])", allow_module_level=True)

from twophase.train import cli, decode  # noqa: E402

import hf_tiny  # noqa: E402
from test_cli import _fails_with_one_line  # noqa: E402

# TRL-style rewards in the run's working directory: `wanted` reads the dataset's column and records its calls.
REWARDS = '''import json
def wanted(prompts, completions, completion_ids, wanted, **kwargs):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "ids": completion_ids,
                            "wanted": wanted, "keys": sorted(kwargs)}) + "\\n")
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if not t else float(w in t.split()) for t, w in zip(text, wanted)]
def short(prompts, completions, **kwargs):
    return [-0.1 * len((c if isinstance(c, str) else c[0]["content"]).split()) for c in completions]
'''
CHAT = ("{% for m in messages %}<s> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<s>{% endif %}")
FLAGS = ["--reward", "rw:wanted,rw:short", "--reward-weights", "1,0.5", "--mle-steps", "0", "--batch-size", "3",
         "--beam-size", "3", "--sampler", "sample", "--objective", "reinforce", "--max-len", "6", "--max-src-len", "10",
         "--eval-every", "2", "--lora-r", "4"]
PROMPTS = [("a b c", "c"), ("d e", "e"), ("f", "f"), ("g h a", "a"), ("b d", "d"), ("c e g", "g")]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl")
    hf_tiny.save(d / "gpt2", "gpt2")
    hf_tiny.save(d / "t5", "t5", seed=1)
    hf_tiny.save(d / "chat", "gpt2")
    tok = hf_tiny.tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(d / "chat")
    _jsonl(d / "train.jsonl", [{"prompt": p, "wanted": w} for p, w in PROMPTS])
    _jsonl(d / "valid.jsonl", [{"prompt": p, "wanted": w} for p, w in PROMPTS[:3]])
    _jsonl(d / "chat.jsonl", [{"prompt": [{"role": "user", "content": p}], "wanted": w} for p, w in PROMPTS])
    (d / "rw.py").write_text(REWARDS)
    return d


def _train(kind, save, *extra, data="train.jsonl"):
    return cli.main(["--train", data, "--valid", "valid.jsonl" if data == "train.jsonl" else data, "--hf-model", kind,
                     "--save-dir", save, *FLAGS, *extra])


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompt_only_lora_gpt2_trains_resumes_bit_exactly_and_decodes(folder, monkeypatch, capsys, one_thread):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    assert _train("gpt2", "straight", "--rl-steps", "4") == 0
    out = capsys.readouterr().out
    # a user's own data: no MLE control unless asked (nor a note that it cannot run)
    assert "validation reports the reward only" in out and "--compare-mle" not in out
    assert "trainable" in out
    rl = [r for r in _rows(folder / "straight" / "metrics.jsonl") if r["phase"] == "rl"]
    evals = [r for r in _rows(folder / "straight" / "metrics.jsonl") if r["phase"] == "eval"]
    assert len(rl) == 4 and all({"reward/wanted/mean", "reward/wanted/std", "reward/short/mean"} <= r.keys()
                                for r in rl + evals)
    # the TRL reward got prompts, completion strings, completion ids (eos included where produced), the column
    calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    step = next(c for c in calls if len(c["completions"]) == 9)
    assert set(step["prompts"]) <= {p for p, _ in PROMPTS} and set(step["wanted"]) <= {w for _, w in PROMPTS}
    assert all(isinstance(c, str) for c in step["completions"]) and "completion_ids" not in step["keys"]
    assert all(ids == [] or ids[-1] == hf_tiny.EOS or len(ids) == 6 for ids in step["ids"])

    # resumed from step 2 to 4: the adapters and the optimizer equal the uninterrupted run's, bit for bit
    assert _train("gpt2", "resumed", "--rl-steps", "2") == 0
    assert _train("gpt2", "resumed", "--rl-steps", "4", "--resume") == 0
    a = torch.load(folder / "straight" / "checkpoint_last.pt", weights_only=True)
    b = torch.load(folder / "resumed" / "checkpoint_last.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys() and all("lora_" in k for k in a["model"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in a["model"].items() if "lora_B" in k)  # trained

    # hf_final holds the adapters: peft loads them onto the folder's model, as the checkpoint has them
    base = AutoModelForCausalLM.from_pretrained(folder / "gpt2", local_files_only=True)
    adapted = PeftModel.from_pretrained(base, folder / "straight" / "hf_final")
    theirs = {k: v for k, v in adapted.base_model.model.state_dict().items() if "lora_" in k}
    assert {"model." + k.replace(".default", "") for k in theirs} <= {k.replace(".default", "") for k in a["model"]}
    assert all(torch.equal(v.double(), a["model"]["model." + k].double()) for k, v in theirs.items())

    (folder / "in.txt").write_text("a b c\nd\n")
    assert decode.main(["--checkpoint", str(folder / "straight" / "checkpoint_last.pt"), "--input", "in.txt",
                        "--output", "out.txt"]) == 0
    assert len((folder / "out.txt").read_text().splitlines()) == 2


def test_same_data_trains_t5_and_merge_lora_saves_a_plain_model(folder, monkeypatch, one_thread):
    from transformers import AutoModelForSeq2SeqLM
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    assert _train("t5", "t5run", "--rl-steps", "2", "--merge-lora") == 0
    merged = AutoModelForSeq2SeqLM.from_pretrained(folder / "t5run" / "hf_final", local_files_only=True)
    assert not any("lora" in k for k in merged.state_dict())


def test_chat_prompts_render_with_the_template_and_rewards_get_messages(folder, monkeypatch, one_thread):
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    (folder / "calls.jsonl").unlink(missing_ok=True)
    assert _train("chat", "chatrun", "--rl-steps", "1", data="chat.jsonl") == 0
    step = next(json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()
                if len(json.loads(line)["completions"]) == 9)
    assert all(p[0]["role"] == "user" for p in step["prompts"])
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in step["completions"])
    (folder / "chat_in.txt").write_text("a b\n")  # decoded as one user message, through the template
    assert decode.main(["--checkpoint", str(folder / "chatrun" / "checkpoint_last.pt"), "--input", "chat_in.txt",
                        "--output", "chat_out.txt"]) == 0
    assert len((folder / "chat_out.txt").read_text().splitlines()) == 1


@pytest.mark.parametrize("extra, match", [
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-r"),
    (["--merge-lora"], "--merge-lora needs --lora-r"),
    (["--lora-r", "2", "--lora-target-modules", "nowhere"], "peft cannot adapt"),
    (["--lora-r", "2", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--reward-weights", "1,2,3"], "--reward-weights 1,2,3: expected 2 finite numbers"),
    (["--reward-weights", "1,x"], "expected comma-separated numbers"),
    (["--top-p", "1.5", "--sampler", "sample"], "--top-p must be in (0, 1]"),
    (["--top-k", "2"], "apply to --sampler sample only"),
    (["--min-len", "6", "--sampler", "sample"], "--min-len 6 leaves no room"),
    (["--one-phase"], "unrecognized arguments: --one-phase"),  # a baseline of benchmarks, no training flag
    (["--mle-steps", "3"], "--mle-steps 3: task 'tsv' has no references"),
    (["--mle-weight", "0.5", "--mle-steps", "0"], "--mle-weight 0.5: task 'tsv' has no references"),
])
def test_bad_new_flags_are_one_line(folder, monkeypatch, capsys, extra, match):
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    argv = ["--train", "train.jsonl", "--valid", "valid.jsonl", "--hf-model", "gpt2", "--save-dir", "bad",
            "--overwrite", "--reward", "rw:wanted,rw:short", "--rl-steps", "1", "--max-len", "6", "--max-src-len", "10",
            *extra]
    if "--mle-steps" not in extra:
        argv += ["--mle-steps", "0"]
    _fails_with_one_line(argv, capsys, match)


def test_truncated_sampling_with_reinforce_is_warned_once():
    from twophase.config import Config
    warned = Config(sampler="sample", objective="reinforce", top_p=0.9).warnings()
    assert len(warned) == 1 and "biased" in warned[0] and "--top-p" in warned[0]
    assert Config(sampler="sample", objective="beam", top_p=0.9).warnings() == []


def test_lora_needs_hf_model(capsys):
    _fails_with_one_line(["--lora-r", "4"], capsys, "--lora-r adapts a Hugging Face model: it needs --hf-model")


def test_lora_with_references_runs_mle_the_comparison_and_resumes_it(folder, monkeypatch, one_thread):
    """With a completion column: MLE on the adapters, RL, --compare-mle and --test; resumed to more RL steps, the
    comparison restarts from checkpoint_mle_end.pt, which holds the adapters alone."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    rows = [{"prompt": p, "completion": w, "wanted": w} for p, w in PROMPTS]
    _jsonl(folder / "ref_train.jsonl", rows)
    _jsonl(folder / "ref_valid.jsonl", rows[:3])
    argv = ["--train", "ref_train.jsonl", "--valid", "ref_valid.jsonl", "--test", "ref_valid.jsonl", "--hf-model",
            "gpt2", "--save-dir", "refrun", *FLAGS, "--mle-steps", "2", "--mle-batch-size", "3", "--compare-mle"]
    assert cli.main(argv + ["--rl-steps", "2"]) == 0
    assert cli.main(argv + ["--rl-steps", "3", "--resume"]) == 0
    rows = _rows(folder / "refrun" / "metrics.jsonl")
    assert [r["phase"] for r in rows if r["phase"] in ("mle", "rl")] == ["mle", "mle", "rl", "rl", "rl"]
    assert {r["model"] for r in rows if r["phase"] == "test"} == {"mle", "mle-continued", "rl"}
    assert all("word_acc" in r for r in rows if r["phase"] == "eval")
    branch = torch.load(folder / "refrun" / "checkpoint_mle_end.pt", weights_only=True)
    assert all("lora_" in k for k in branch["model"])


@pytest.mark.parametrize("objective", [["--sampler", "sample", "--objective", "policy"],
                                       ["--sampler", "sbs", "--objective", "priority"],
                                       ["--sampler", "sbs", "--objective", "unordered-set"]])
def test_the_docs_wanted_reward_and_its_nones_train_every_objective(folder, monkeypatch, one_thread, objective):
    """docs/trl.md's `wanted` alone (None for an empty completion, so some candidates go unscored): every RL step
    has a finite loss and a gradient, none is skipped, and the run ends 0."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    save = "nones_" + objective[-1]
    assert cli.main(["--train", "train.jsonl", "--valid", "valid.jsonl", "--hf-model", "gpt2", "--save-dir", save,
                     "--reward", "rw:wanted", "--mle-steps", "0", "--rl-steps", "3", "--batch-size", "3",
                     "--beam-size", "3", "--max-len", "6", "--max-src-len", "10", "--eval-every", "3",
                     "--seed", "2", *objective]) == 0
    rl = [r for r in _rows(folder / save / "metrics.jsonl") if r["phase"] == "rl"]
    assert len(rl) == 3 and all(r["skipped"] == 0 and r["loss"] is not None and r["grad_norm"] > 0 for r in rl)
    assert any(r.get("unscored") for r in rl)


def test_a_reward_that_scores_nothing_is_warned_once_and_reports_no_reward(folder, monkeypatch, capsys, one_thread):
    """A TRL reward reading a misspelt column (None for every candidate): one warning, not silence; validation's
    and the closing table's reward are '-' (nothing measured), not 0.0000, and no checkpoint is called best."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    (folder / "misspelt.py").write_text("def wanted(completions, **kwargs):\n"
                                         "    return [None if kwargs.get('wnated') is None else 1.0 for c in completions]\n")
    assert cli.main(["--train", "train.jsonl", "--valid", "valid.jsonl", "--hf-model", "gpt2", "--save-dir", "nothing",
                     "--reward", "misspelt:wanted", "--mle-steps", "0", "--rl-steps", "3", "--batch-size", "3",
                     "--beam-size", "3", "--max-len", "6", "--max-src-len", "10", "--eval-every", "2",
                     "--sampler", "sample", "--objective", "policy"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("scored none of the 9 candidates of RL step 1") == 1
    evals = [r for r in _rows(folder / "nothing" / "metrics.jsonl") if r["phase"] == "eval"]
    assert evals and all(r["reward"] is None for r in evals)
    assert "valid reward=-" in captured.out and "0.0000" not in captured.out and "best reward" not in captured.out
