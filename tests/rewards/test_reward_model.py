"""A Hugging Face sequence-classification model as the reward (`twophase.rewards.hfmodel`): its scores against
direct calls of the model (one text at a time, unpadded, versus the reward's right-padded batches), as TRL's
GRPOTrainer builds the texts (prompt + completion; TRL's own chat-template function for chat prompts) and as text
pairs for encoder-decoder tasks; one-line refusals of folders that are not reward models; and tiny runs trained
with it, alone and beside another reward through --reward-weights."""
import importlib.util
import json
import os
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("transformers") is None:  # only a missing extra skips: a broken install fails
    pytest.skip("transformers is not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import rewards  # noqa: E402
from twophase.rewards import RewardError, hfmodel, weighted  # noqa: E402
from twophase.train import cli  # noqa: E402

import hf_tiny  # noqa: E402
from test_cli import _fails_with_one_line  # noqa: E402

CHAT = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
# Prompts of unequal lengths, with and without a space before the completion (TRL adds none).
PROMPTS = ["a b ", "c", "d e f g h ", "h g ", "e"]
COMPLETIONS = ["c d", "a", "", "b b b b", "f g h"]


def _pair_tokenizer():
    """The word-level tokenizer with a cross-encoder's pair template: <s> A </s> B </s>, B's type ids 1."""
    from tokenizers import processors

    tok = hf_tiny.tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", hf_tiny.BOS),
                                                                              ("</s>", hf_tiny.EOS)])
    return tok


def _classifier(kind: str, num_labels: int = 1, seed: int = 0):
    """A random sequence classifier: 'gpt2' (reads the last token that is not padding) or 'bert' (reads [CLS])."""
    import transformers as T

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = T.GPT2Config(vocab_size=hf_tiny.VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                              bos_token_id=hf_tiny.EOS, eos_token_id=hf_tiny.EOS, num_labels=num_labels,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = T.GPT2ForSequenceClassification(config)
    else:
        config = T.BertConfig(vocab_size=hf_tiny.VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, max_position_embeddings=64, type_vocab_size=2,
                              pad_token_id=hf_tiny.PAD, num_labels=num_labels, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
        model = T.BertForSequenceClassification(config)
    with torch.no_grad():  # varied scores: a tiny random head is close to 0 everywhere
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return model.eval()


def _save(folder, kind: str, num_labels: int = 1, tokenizer=None, chat: bool = False) -> str:
    tok = tokenizer or (_pair_tokenizer() if kind == "bert" else hf_tiny.tokenizer())
    if chat:
        tok.chat_template = CHAT
    _classifier(kind, num_labels).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _direct(folder, *texts, add_special_tokens: bool) -> float:
    """The model's logit for one text (or text pair), loaded afresh and called directly, without padding (as a
    batch of one: a single empty string as the pair would be read as no pair)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        inputs = tok(*[[t] for t in texts], add_special_tokens=add_special_tokens, return_tensors="pt")
        return model(**inputs).logits[0, 0].item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    no_pad = hf_tiny.tokenizer()
    no_pad.pad_token = None  # TRL pads with eos then
    return {"gpt2": _save(d / "gpt2", "gpt2", chat=True), "bert": _save(d / "bert", "bert"),
            "gpt2_eos": _save(d / "gpt2_eos", "gpt2", tokenizer=no_pad), "root": d}


@pytest.mark.parametrize("name", ["gpt2", "gpt2_eos"])
def test_a_causal_tasks_reward_is_the_models_logit_of_prompt_plus_completion(name, folders, monkeypatch):
    monkeypatch.setattr(hfmodel, "BATCH", 2)  # several batches, each padded to its own longest text
    reward = rewards.get(f"hf:{folders[name]}", device="cpu", causal=True)
    got = reward(COMPLETIONS, [[]] * len(COMPLETIONS), sources=PROMPTS)
    want = [_direct(folders[name], p + c, add_special_tokens=False) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert len(set(round(w, 4) for w in want)) == len(want)  # the texts are told apart
    assert reward(COMPLETIONS[:1], [[]], sources=PROMPTS[:1]) == pytest.approx(want[:1], rel=1e-6, abs=1e-6)


def test_an_encoder_decoder_tasks_reward_scores_source_and_hypothesis_as_a_text_pair(folders, monkeypatch):
    monkeypatch.setattr(hfmodel, "BATCH", 3)
    reward = rewards.get(folders["bert"], device="cpu")  # a folder without hf: is a reward model too
    got = reward(COMPLETIONS, [["a"]] * len(COMPLETIONS), sources=PROMPTS)
    want = [_direct(folders["bert"], p, c, add_special_tokens=True) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    # a pair, not the concatenation: the hypothesis' tokens carry type id 1
    assert want != pytest.approx([_direct(folders["bert"], p + c, add_special_tokens=True)
                                  for p, c in zip(PROMPTS, COMPLETIONS)], rel=1e-6, abs=1e-6)


def test_chat_prompts_are_rendered_with_the_reward_tokenizers_template_as_trl_does(folders):
    from transformers import AutoTokenizer
    from trl.data_utils import apply_chat_template

    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    reward = rewards.get(f"hf:{folders['gpt2']}", causal=True)
    got = reward(COMPLETIONS, [[]] * len(COMPLETIONS), sources=prompts)
    tok = AutoTokenizer.from_pretrained(folders["gpt2"], local_files_only=True)
    texts = [apply_chat_template({"messages": p + [{"role": "assistant", "content": c}]}, tok)["text"]
             for p, c in zip(prompts, COMPLETIONS)]
    assert got == pytest.approx([_direct(folders["gpt2"], t, add_special_tokens=False) for t in texts],
                                rel=1e-6, abs=1e-6)
    with pytest.raises(RewardError, match="conversational prompts need a chat template"):
        rewards.get(f"hf:{folders['gpt2_eos']}", causal=True)(COMPLETIONS[:1], [[]], sources=prompts[:1])


def test_the_reward_model_runs_without_a_graph_in_evaluation_mode(folders):
    reward = rewards.get(f"hf:{folders['bert']}")
    model = reward.__wrapped__.model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append((torch.is_inference_mode_enabled(),
                                                                   out.logits.shape)))
    reward(["a b", "c"], [[], []], sources=["d", "e f"])
    assert seen == [(True, torch.Size([2, 1]))]


def test_weighted_with_another_reward_named_by_the_folder_as_trl_names_reward_models(folders):
    spec = f"hf:{folders['gpt2']},edit"
    total = weighted.from_flags(spec, "0.5,2", causal=True)
    assert total.names == ["gpt2", "edit"]
    refs = [["c d"], ["b"], ["a"], ["b b"], ["f g h"]]
    got = total(COMPLETIONS, refs, sources=PROMPTS)
    model = [_direct(folders["gpt2"], p + c, add_special_tokens=False) for p, c in zip(PROMPTS, COMPLETIONS)]
    edit = rewards.edit(COMPLETIONS, refs)
    assert got == pytest.approx([0.5 * m + 2 * e for m, e in zip(model, edit)], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("make, match", [
    (lambda d: d / "absent", "no such directory"),
    (lambda d: _save(d / "two", "gpt2", num_labels=2), "num_labels=2"),
    (lambda d: _lm(d / "lm"), "not a sequence-classification model (GPT2LMHeadModel)"),
    (lambda d: _without_tokenizer(d / "no_tok"), "no tokenizer"),
    (lambda d: _headless(d / "headless"), "the folder's weights lack score.weight"),
])
def test_a_folder_that_is_not_a_reward_model_is_refused_in_one_line(make, match, folders, capsys, tmp_path):
    folder = make(tmp_path)
    capsys.readouterr()  # transformers' progress bars while saving
    with pytest.raises(RewardError, match=re.escape(f"--reward hf:{folder}: ") + ".*" + re.escape(match)):
        rewards.get(f"hf:{folder}")
    _fails_with_one_line(["--reward", f"hf:{folder}", "--save-dir", str(tmp_path / "run")], capsys, match)


def _lm(folder):
    hf_tiny.save(folder, "gpt2")
    return folder


def _headless(folder):
    """A classifier's folder whose weights lack its head (a base model's saved under a classifier's config)."""
    from safetensors.torch import load_file, save_file

    _save(folder, "gpt2")
    weights = load_file(folder / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _without_tokenizer(folder):
    _classifier("gpt2").save_pretrained(folder)
    return folder


def test_rewards_does_not_import_transformers_until_a_reward_model_is_built():
    code = "import sys, twophase.rewards; twophase.rewards.get('edit'); print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


TINY = ["--batch-size", "3", "--mle-batch-size", "6", "--beam-size", "2", "--max-len", "6", "--max-src-len", "8",
        "--eval-every", "2", "--mle-steps", "2", "--rl-steps", "2"]


def _tsv(path, pairs):
    path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs))


def test_a_reward_models_folder_is_recorded_as_an_absolute_path(folders, monkeypatch):
    """What a run records of --reward: a folder as hf:ABSOLUTE (resumed from anywhere), a reward's name as
    given even where a folder of that name holds a config.json (the reward wins, as rewards.get finds it)."""
    d = folders["root"]
    monkeypatch.chdir(d)
    (d / "edit").mkdir(exist_ok=True)
    (d / "edit" / "config.json").write_text("{}")
    assert weighted.recorded("hf:bert, edit,bert,tests.x:fn") == \
        f"hf:{d / 'bert'},edit,hf:{d / 'bert'},tests.x:fn"
    assert weighted.recorded(f"hf:{d / 'bert'}") == f"hf:{d / 'bert'}"
    assert weighted.recorded("bleu,,edit") == "bleu,,edit"  # an empty name is from_flags' to refuse


def test_a_folder_whose_path_holds_a_comma_is_one_reward(folders, monkeypatch):
    """The comma-separated list keeps a reward model's folder whole where its path holds a comma, in what a run
    records and in what it builds."""
    d = folders["root"]
    odd = d / "rm,v2"
    if not odd.exists():
        shutil.copytree(folders["bert"], odd)
    monkeypatch.chdir(d)
    assert weighted.names("edit,rm,v2, hf:rm,v2,exact") == ["edit", "rm,v2", "hf:rm,v2", "exact"]
    assert weighted.recorded("edit,rm,v2") == f"edit,hf:{odd}"
    total = weighted.from_flags(f"hf:{odd},edit", None)
    assert total.names == ["rm,v2", "edit"]
    refs = [["c d"], ["b"], ["a"], ["b b"], ["f g h"]]
    model = [_direct(odd, s, h, add_special_tokens=True) for s, h in zip(PROMPTS, COMPLETIONS)]
    assert total(COMPLETIONS, refs, sources=PROMPTS) == pytest.approx(
        [m + e for m, e in zip(model, rewards.edit(COMPLETIONS, refs))], rel=1e-6, abs=1e-6)
    assert weighted.names("bleu,,edit") == ["bleu", "", "edit"]  # an empty name stays from_flags' to refuse


@pytest.mark.parametrize("kind", ["lstm", "gpt2"])
def test_a_tiny_run_trains_with_a_reward_model_beside_edit(kind, folders, monkeypatch, one_thread):
    """An encoder-decoder (the built-in LSTM, the BERT pair model) and a causal LM (--hf-model GPT-2, the GPT-2
    classifier): each step's rewards are the models' scores weighted beside edit's."""
    d = folders["root"]
    monkeypatch.chdir(d)
    pairs = [(s, " ".join(reversed(s.split()))) for s in ["a b c", "d e", "f", "g h a", "b d", "c e g", "h", "a f"]]
    _tsv(d / "train.tsv", pairs)
    _tsv(d / "valid.tsv", pairs[:3])
    seen = []
    original = hfmodel.RewardModel.__call__

    def recording(self, hypotheses, references, sources):  # the calls the run makes, for the check below
        out = original(self, hypotheses, references, sources)
        seen.append((self.causal, hypotheses, sources, out))
        return out

    monkeypatch.setattr(hfmodel.RewardModel, "__call__", recording)
    model = ["--hf-model", str(_lm(d / "policy"))] if kind == "gpt2" else ["--hidden-size", "16", "--embed-dim", "8"]
    rm = folders["gpt2" if kind == "gpt2" else "bert"]
    save = d / f"run_{kind}"
    assert cli.main(["--train", "train.tsv", "--valid", "valid.tsv", *model, *TINY, "--save-dir", str(save),
                     "--reward", f"hf:{os.path.basename(rm)},edit", "--reward-weights", "1,0.5", "--overwrite"]) == 0
    assert json.loads((save / "config.json").read_text())["config"]["reward"] == f"hf:{rm},edit"  # absolute
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    name = "gpt2" if kind == "gpt2" else "bert"
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [3, 4]
    evals = [r for r in rows if r["phase"] == "eval"]
    assert evals and all(math.isfinite(r[f"reward/{name}/mean"]) for r in evals)
    causal, hyps, sources, out = next(c for c in seen if len(c[1]) == 3 * 2)  # an RL step's B x K candidates
    assert causal == (kind == "gpt2")
    texts = [(s + h,) if causal else (s, h) for s, h in zip(sources, hyps)]
    assert out == pytest.approx([_direct(rm, *t, add_special_tokens=not causal) for t in texts],
                                rel=1e-5, abs=1e-6)
