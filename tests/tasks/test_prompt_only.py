"""Prompt-only data (a prompt table without references) on the built-in LSTM: the output vocabulary a reward
needs (--target-vocab FILE), and what train.py says about such data (the table's format, the rows without a
reference, the start-up check, the MLE phase it cannot run)."""
import json

import pytest

from twophase import tasks
from twophase.config import Config
from twophase.train import cli

REWARD = '''def has_yes(hypotheses, references, sources):
    return [float("yes" in h.split()) for h in hypotheses]


def broken(hypotheses, references):
    return [float("nan")] * len(hypotheses)
'''
SIZES = ["--hidden-size", "8", "--embed-dim", "4", "--batch-size", "2", "--beam-size", "2", "--max-len", "4",
         "--eval-every", "1", "--eval-beam", "1", "--no-compare-mle"]


@pytest.fixture
def prompts(tmp_path, monkeypatch):
    """train.jsonl / valid.jsonl of prompts alone (no "yes" among their words), a reward module, the folder the
    working directory."""
    for split, words in (("train", ["a b", "b c", "c a", "a"]), ("valid", ["b", "c a"])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    (tmp_path / "yes_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _task(**more):
    task = tasks.build(Config(train="train.jsonl", valid="valid.jsonl", **more))
    task.load_data()
    return task


def test_the_output_vocabulary_is_the_prompts_unless_given(prompts):
    assert "yes" not in _task().tgt_vocab.stoi  # the prompts' tokens: a reward wanting "yes" could never be earned
    (prompts / "outputs.txt").write_text("yes no\nmaybe\n")
    given = _task(target_vocab="outputs.txt").tgt_vocab.stoi
    assert {"yes", "no", "maybe"} <= set(given) and "a" not in given  # in place of the prompts'
    (prompts / "empty.txt").write_text("\n")
    with pytest.raises(tasks.data.DataError, match=r"^--target-vocab empty\.txt: no tokens"):
        _task(target_vocab="empty.txt")
    with pytest.raises(tasks.data.DataError, match=r"^--target-vocab: missing\.txt: "):
        _task(target_vocab="missing.txt")


def test_target_vocab_adds_to_the_references_tokens(tmp_path):
    for split in ("train", "valid"):
        (tmp_path / f"{split}.tsv").write_text("a b\tx y\n")
    (tmp_path / "more.txt").write_text("yes\n")
    task = tasks.build(Config(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "valid.tsv"),
                              target_vocab=str(tmp_path / "more.txt")))
    task.load_data()
    assert {"x", "y", "yes"} <= set(task.tgt_vocab.stoi)


def test_a_run_can_earn_a_token_only_the_target_vocab_holds(prompts, capsys):
    (prompts / "outputs.txt").write_text("yes no\n")
    assert cli.main(["--train", "train.jsonl", "--valid", "valid.jsonl", "--save-dir", "run", "--reward",
                     "yes_reward:has_yes", "--target-vocab", "outputs.txt", "--mle-steps", "0", "--rl-steps", "2",
                     *SIZES, "--beam-size", "4", "--sampler", "sample", "--objective", "reinforce"]) == 0
    out = capsys.readouterr().out
    assert "\ntask tsv (JSONL prompts): 4 train / 2 valid sources" in out
    assert "no training or validation row has a reference (completion/target)" in out
    rows = [json.loads(line) for line in (prompts / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("reward_mean", 0) > 0 for r in rows if r["phase"] == "rl")  # "yes" sampled and rewarded
    assert cli.main(["--save-dir", "g2p", "--task", "g2p", "--target-vocab", "outputs.txt"]) == 2  # the built-in data's task
    assert "--target-vocab: task 'g2p' does not read this flag" in capsys.readouterr().err


def test_what_train_py_says_about_prompt_only_data(prompts, capsys):
    base = ["--train", "train.jsonl", "--valid", "valid.jsonl", "--save-dir", "run", *SIZES]
    assert cli.main(base + ["--reward", "yes_reward:has_yes"]) == 2  # the MLE phase of the default recipe
    err = capsys.readouterr().err
    assert "has no references to train MLE on" in err and "reads the sources" not in err, err
    assert "--mle-steps 4000 (the default): " in err and "--mle-steps 0" in err and err.count("\n") == 1
    assert cli.main(base + ["--reward", "yes_reward:broken", "--mle-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "(start-up check: an empty hypothesis)" in err and "references scored" not in err, err
