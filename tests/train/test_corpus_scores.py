"""--reward bleu / chrf on TSV data: validation and test rows (metrics.jsonl, the progress lines, the closing
table) report corpus BLEU (and for chrf corpus chrF), each equal to sacrebleu's own corpus score over what
twophase-decode writes for the test sources, against the test file's references (several for a repeated source);
the progress lines name the metrics as the table does."""
import json

import pytest
import sacrebleu

from twophase.rewards import registry, weighted
from twophase.train import cli, decode

from taskfiles import write_task


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_task(d / "train.tsv", "copy", 300, seed=0, alphabet="abcdef", max_len=8)
    write_task(d / "valid.tsv", "copy", 8, seed=1, alphabet="abcdef", max_len=8)
    write_task(d / "test.tsv", "copy", 10, seed=2, alphabet="abcdef", max_len=8)
    with open(d / "test.tsv", "a", encoding="utf-8") as f:  # a second reference for the first test source
        first = (d / "test.tsv").read_text().splitlines()[0].split("\t")[0]
        f.write(f"{first}\t{' '.join(reversed(first.split()))}\n")
    argv = ["--train", str(d / "train.tsv"), "--valid", str(d / "valid.tsv"), "--test", str(d / "test.tsv"),
            "--hidden-size", "32", "--embed-dim", "16", "--batch-size", "8", "--mle-batch-size", "32", "--beam-size",
            "3", "--max-len", "10", "--lr", "0.03", "--mle-steps", "40", "--rl-steps", "1", "--reward", "chrf",
            "--no-compare-mle", "--eval-every", "40", "--log-every", "0", "--no-picture", "--save-dir", str(d / "run")]
    assert cli.main(argv) == 0
    return d


def test_corpus_scores_equal_sacrebleu_over_twophase_decode_s_outputs(run, capsys):
    capsys.readouterr()
    sources = {}
    for line in (run / "test.tsv").read_text().splitlines():  # in file order, references grouped by source
        src, tgt = line.split("\t")
        sources.setdefault(src, []).append(tgt)
    (run / "sources.txt").write_text("".join(s + "\n" for s in sources))
    assert decode.main(["--checkpoint", str(run / "run" / "checkpoint_last.pt"), "--input", str(run / "sources.txt"),
                        "--output", str(run / "out.txt")]) == 0  # its default beam: validation's
    hyps = (run / "out.txt").read_text().splitlines()
    refs = list(sources.values())
    streams = [[r[i] if i < len(r) else None for r in refs] for i in range(max(map(len, refs)))]
    bleu, chrf = sacrebleu.corpus_bleu(hyps, streams).score, sacrebleu.corpus_chrf(hyps, streams).score
    assert bleu > 0 and chrf > 0  # a model that has learnt something: the equality is not 0 == 0
    rows = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    [test] = [r for r in rows if r["phase"] == "test"]
    assert test["corpus_bleu"] == pytest.approx(bleu, abs=1e-9)
    assert test["corpus_chrf"] == pytest.approx(chrf, abs=1e-9)
    assert all("corpus_bleu" in r and "corpus_chrf" in r for r in rows if r["phase"] == "eval")


def test_progress_lines_and_the_table_name_the_same_scores(run, capsys):
    """The progress lines print the task's metrics (no G2P wer on TSV data) and the corpus scores in the
    table's scale; the table's labels carry the keys the lines print."""
    out = capsys.readouterr().out
    assert cli.main(["--save-dir", str(run / "run"), "--resume"]) == 0  # the finished run's table again
    table = capsys.readouterr().out
    rows = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    [test] = [r for r in rows if r["phase"] == "test"]
    assert "wer" not in test and set(test) >= {"word_acc", "per", "reward", "corpus_bleu", "corpus_chrf"}
    for label in ("test sequence accuracy (word_acc)", "test token error rate (per)", "test corpus BLEU",
                  "test corpus chrF"):
        assert label in table, table
    cell = [line for line in table.splitlines() if line.startswith("test corpus BLEU")][0].split()[-1]
    assert cell == f"{test['corpus_bleu']:.2f}"
    del out


def test_which_rewards_report_which_corpus_scores():
    assert registry.corpus_kinds(registry.get("bleu")) == ("bleu",)
    assert registry.corpus_kinds(registry.get("chrf")) == ("bleu", "chrf")
    assert registry.corpus_kinds(registry.get("edit")) == ()
    assert registry.corpus_kinds(weighted.from_flags("edit,bleu", None)) == ("bleu",)
    from types import SimpleNamespace
    from twophase.config import Config
    from twophase.errors import UsageError
    from twophase.train.recipe import resolve_best_metric
    task = SimpleNamespace(metrics=(), main_metric=None, spec="tsv")
    assert resolve_best_metric(Config(best_metric="corpus_bleu"), task, registry.get("bleu")) == "corpus_bleu"
    with pytest.raises(UsageError, match="reports reward$"):  # only a bleu or chrf reward reports it
        resolve_best_metric(Config(best_metric="corpus_bleu"), task, registry.get("edit"))


def test_shards_sum_to_the_whole_corpus():
    """Two processes' statistics, summed, give sacrebleu's score of the whole corpus (varying reference counts)."""
    hyps = ["the cat sat on the mat", "a dog barked", "hello world there", "x y z"]
    refs = [["the cat sat on a mat", "a cat sat on the mat"], ["the dog barked"], ["hello there world"], ["x y"]]
    streams = [[r[i] if i < len(r) else None for r in refs] for i in range(2)]
    for kind, whole in (("bleu", sacrebleu.corpus_bleu(hyps, streams).score),
                        ("chrf", sacrebleu.corpus_chrf(hyps, streams).score)):
        a = registry.corpus_statistics(kind, hyps[:1], refs[:1])
        b = registry.corpus_statistics(kind, hyps[1:], refs[1:])
        none = registry.corpus_statistics(kind, [], [])
        assert registry.corpus_score(kind, [x + y + z for x, y, z in zip(a, b, none)]) == pytest.approx(whole)
