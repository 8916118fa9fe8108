"""Prompt tables (`twophase.tasks.table`, `prompts`): JSONL, and CSV / parquet through `datasets`, with a prompt
column, optional references and extra columns that reach rewards by name; bad rows are FILE:LINE, exit 2; the
built-in LSTM trains on them (RL only without references)."""
import importlib.util
import json
import math

import pytest

from twophase.tasks.data import DataError
from twophase.tasks.table import read_table
from twophase.train import cli

from test_cli import _fails_with_one_line

RECORDER = '''import json
def reward(hypotheses, references, sources, level, **rest):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps({"refs": references, "sources": sources, "level": level, "rest": sorted(rest)}) + "\\n")
    return [float(len(h.split()) == l) for h, l in zip(hypotheses, level)]
'''


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_rows_references_and_columns(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "a  b", "completion": "x y", "level": 1},
        "",
        {"prompt": [{"role": "user", "content": "hi"}], "completion": ["p", "q  r"], "extra": [1, 2]},
        {"prompt": "c", "completion": [{"role": "assistant", "content": "z"}], "level": None}])
    rows = read_table(path)
    assert [r.where for r in rows] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert rows[0].prompt == "a  b" and rows[0].references == ["x y"]
    assert rows[1].conversational and rows[1].references == ["p", "q r"]
    assert rows[2].references == ["z"]
    # every row has every other column (None where it lacks it), as datasets fills them
    assert [r.fields for r in rows] == [{"level": 1, "extra": None}, {"level": None, "extra": [1, 2]},
                                        {"level": None, "extra": None}]


@pytest.mark.parametrize("line, message", [
    ("{bad", ":2: not JSON"),
    ("[1, 2]", ":2: expected a JSON object, found list"),
    ('{"text": "a"}', ":2: no 'prompt'"),
    ('{"prompt": "  "}', ":2: empty prompt"),
    ('{"prompt": [{"role": "user"}]}', ":2: 'prompt' must be a string or a list of"),
    ('{"prompt": "a", "completion": 3}', ":2: 'completion' must be a string"),
    ('{"prompt": "a", "completion": ""}', ":2: empty 'completion'"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, line])
    with pytest.raises(DataError) as info:
        read_table(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": "b", "target": "c"}], "both 'completion' and 'target'"),
    ([{"prompt": "a", "sources": "b"}], "column 'sources' is a keyword"),
    ([], "no data"),
])
def test_bad_tables(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        read_table(_jsonl(tmp_path / "d.jsonl", rows))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets is not installed")
def test_csv_and_parquet_through_datasets(tmp_path):
    import datasets
    (tmp_path / "d.csv").write_text("prompt,target,level\na b,x,1\n,y,2\n")
    with pytest.raises(DataError, match=r"d\.csv:3: no 'prompt'"):  # line 3: the header is line 1
        read_table(tmp_path / "d.csv")
    datasets.Dataset.from_dict({"prompt": ["a b", "c"], "level": [1, 2]}).to_parquet(str(tmp_path / "d.parquet"))
    rows = read_table(tmp_path / "d.parquet")
    assert [(r.prompt, r.references, r.fields) for r in rows] == [("a b", [], {"level": 1}), ("c", [], {"level": 2})]


def _lstm(tmp_path, *extra):
    return cli.main(["--train", "train.jsonl", "--valid", "valid.jsonl", "--save-dir", "run", "--reward", "rec:reward",
                     "--hidden-size", "8", "--embed-dim", "4", "--batch-size", "2", "--mle-batch-size", "2",
                     "--beam-size", "2", "--max-len", "5", "--eval-every", "2", *extra])


def test_the_lstm_trains_on_a_prompt_table(tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rec.py").write_text(RECORDER)
    rows = [{"prompt": p, "level": n} for p, n in [("a b", 1), ("b c", 2), ("c a", 1), ("a a", 2)]]
    _jsonl(tmp_path / "train.jsonl", rows)
    _jsonl(tmp_path / "valid.jsonl", rows[:2])
    assert _lstm(tmp_path, "--mle-steps", "0", "--rl-steps", "2") == 0  # no references: RL only
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert all(c["refs"] == [[]] * len(c["sources"]) and set(c["level"]) <= {1, 2} for c in calls)
    assert all(c["rest"] == ["completion_ids"] for c in calls)  # **kwargs: the ids too (start-up, RL, validation)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert evals and all(set(r) >= {"reward", "n"} and "word_acc" not in r for r in evals)
    # with references: MLE runs, and the metrics compare with them
    _jsonl(tmp_path / "train.jsonl", [{**r, "completion": r["prompt"]} for r in rows])
    _jsonl(tmp_path / "valid.jsonl", [{**r, "completion": r["prompt"]} for r in rows[:2]])
    assert _lstm(tmp_path, "--mle-steps", "2", "--rl-steps", "1", "--overwrite", "--no-compare-mle") == 0
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert all("word_acc" in r for r in evals)
    capsys.readouterr()
    _jsonl(tmp_path / "train.jsonl", [rows[0], {"prompt": [{"role": "user", "content": "a"}]}])
    _fails_with_one_line(["--train", "train.jsonl", "--valid", "valid.jsonl", "--save-dir", "run2", "--mle-steps",
                          "0", "--reward", "rec:reward"], capsys, "train.jsonl:2: a conversational prompt")
    _jsonl(tmp_path / "train.jsonl", [rows[0], {"prompt": "a b c d e f g"}])
    _fails_with_one_line(["--train", "train.jsonl", "--valid", "valid.jsonl", "--save-dir", "run2", "--mle-steps",
                          "0", "--reward", "rec:reward", "--max-src-len", "3"], capsys,
                         "train.jsonl:2: source has 7 tokens, more than --max-src-len 3")


def test_too_long_rows_are_skipped_and_counted(tmp_path):
    from twophase import tasks
    from twophase.config import Config
    _jsonl(tmp_path / "t.jsonl", [{"prompt": "a b"}, {"prompt": "a b c d"}, {"prompt": "c", "completion": "x y z"}])
    cfg = Config(train=str(tmp_path / "t.jsonl"), valid=str(tmp_path / "t.jsonl"), max_src_len=3, max_len=3,
                 too_long="skip")
    task = tasks.build(cfg)
    task.load_data()
    assert [e.source for e in task.train] == ["a b"] and task.metrics == ()
    assert "--train: skipped 2 rows longer than the limits (--too-long skip)" in task.notes


def test_reference_rewards_on_rows_without_references_stop_at_start_up(tmp_path, monkeypatch, capsys):
    """Prompt-only data with the default reward (--reward forgotten) or a built-in, or rows of which only some have
    a reference: one line naming the file (and the first row without one), exit 2, before any step; a sum with a
    reward that scores without references trains, the built-in giving None on the rows it cannot score."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rec.py").write_text(RECORDER)
    rows = [{"prompt": p, "level": n} for p, n in [("a b", 1), ("b c", 2), ("c a", 1), ("a a", 2)]]
    _jsonl(tmp_path / "bare.jsonl", rows)
    _jsonl(tmp_path / "some.jsonl", [{**r, "completion": r["prompt"]} if i != 2 else r for i, r in enumerate(rows)])
    _jsonl(tmp_path / "all.jsonl", [{**r, "completion": r["prompt"]} for r in rows])
    base = ["--save-dir", "run", "--mle-steps", "0", "--hidden-size", "8", "--embed-dim", "4", "--batch-size", "2",
            "--beam-size", "2", "--max-len", "5", "--eval-every", "2"]
    for data, extra, match in [
            (["bare.jsonl", "bare.jsonl"], [], "--reward edit (the task's default): edit compares candidates with "
                                               "references, and --train bare.jsonl has none (no completion/target): "
                                               "--reward is needed"),
            (["bare.jsonl", "bare.jsonl"], ["--reward", "bleu"], "--train bare.jsonl has none (no completion/target): "
                                                                 "give --reward"),
            (["bare.jsonl", "bare.jsonl"], ["--reward", "exact,rec:reward"], "exact compares candidates with "
                                                                             "references, and --train bare.jsonl has "
                                                                             "none: it would never score"),
            (["some.jsonl", "all.jsonl"], ["--reward", "chrf"], "some.jsonl:3: no reference (completion/target), "
                                                                "which --reward chrf compares candidates with (1 of 4 "
                                                                "rows of --train have none)"),
            (["all.jsonl", "some.jsonl"], ["--reward", "exact"], "some.jsonl:3: no reference (completion/target), "
                                                                 "which --reward exact compares candidates with (1 of "
                                                                 "4 rows of --valid have none)")]:
        _fails_with_one_line(["--train", data[0], "--valid", data[1], *base, *extra], capsys, match)
    assert cli.main(["--train", "some.jsonl", "--valid", "some.jsonl", *base, "--rl-steps", "1",
                     "--reward", "exact,rec:reward"]) == 0


def test_the_builtin_rewards_give_none_without_references():
    from twophase import rewards
    for name in ("bleu", "chrf", "exact", "edit"):
        reward = rewards.get(name)
        assert rewards.needs_references(reward)
        out = reward(["a b", "a b"], [["a b"], []])
        assert out[0] > 0.99 and math.isnan(out[1]), name
