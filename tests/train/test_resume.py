"""A run's lineage: --resume takes the checkpoint's configuration and refuses flags that would change the run
(the declared table of the resume rules, config.rules.RULES), --resume-from any checkpoint (later ones set
aside, never deleted), --init-from, --eval-only, --export, config.json, and save-dir failures in one line."""
import json
import shutil
from pathlib import Path
from dataclasses import asdict, fields
from types import SimpleNamespace

import pytest
import torch

from twophase.train import cli, recipe, startpoint, steps
from twophase.config import rules
from twophase.train.checkpoint import load, save_atomic
from twophase.config import Config

from taskfiles import task_dir

TINY = ["--hidden-size", "8", "--embed-dim", "4", "--batch-size", "3", "--mle-batch-size", "4", "--beam-size", "3",
        "--rescore-chunk", "5", "--max-len", "7", "--eval-beam", "1"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_dir(tmp_path_factory, 24, 4)


def _argv(task, save, *flags):
    return ["--train", str(task / "train.tsv"), "--valid", str(task / "valid.tsv"), "--save-dir", str(save), *TINY,
            *flags]


def _one_line(capsys, *needles):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _files(save):
    return {p.relative_to(save).as_posix(): p.read_bytes() for p in sorted(save.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(task, tmp_path_factory):
    """A finished run (2 MLE + 2 RL steps, compared with MLE continued), every step checkpoint kept."""
    save = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "2", "--rl-steps", "2", "--save-every", "1",
                          "--keep-last", "10", "--compare-mle")) == 0
    return save


# ---- 1-2. --resume: the checkpoint's configuration, and the table of what may change
def test_a_finished_run_resumed_without_its_flags_loses_nothing(finished, capsys):
    capsys.readouterr()
    before = {k: v for k, v in _files(finished).items() if k.endswith(".pt")}
    assert cli.main(["--save-dir", str(finished), "--resume"]) == 0  # no data, model or step flags
    out = capsys.readouterr().out
    assert "[mle]" not in out and "end of MLE" in out  # the closing table again, no step taken
    after = {k: v for k, v in _files(finished).items() if k.endswith(".pt")}
    assert after == before  # not one checkpoint rewritten or deleted (RL's step checkpoints included)
    assert {"checkpoint_step00000003.pt", "checkpoint_step00000004.pt"} <= set(after)
    assert json.loads((finished / "config.json").read_text())["config"]["hidden_size"] == 8


@pytest.mark.parametrize("flags, needle", [
    (["--objective", "mrt"], "--objective beam, not mrt"),
    (["--beam-size", "4"], "--beam-size 3, not 4"),
    (["--mle-steps", "5"], "--mle-steps 2, not 5: the MLE phase ended at step 2"),
    (["--rl-steps", "1"], "--rl-steps 2, not 1: --rl-steps may only grow"),
    (["--reward", "exact"], "--reward edit, not exact"),
    (["--seed", "2"], "--seed 1, not 2"),
    (["--grad-accum", "2"], "--grad-accum 1, not 2"),
])
def test_flags_that_change_the_run_are_refused(finished, capsys, flags, needle):
    capsys.readouterr()
    before = _files(finished)
    assert cli.main(["--save-dir", str(finished), "--resume", *flags]) == 2
    _one_line(capsys, needle, str(finished / "checkpoint_last.pt"))
    assert _files(finished) == before


def test_an_interrupted_rl_run_resumed_with_another_objective_is_refused(task, tmp_path, capsys):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "1", "--rl-steps", "1", "--objective", "mrt",
                          "--no-compare-mle")) == 0
    capsys.readouterr()
    assert cli.main(["--save-dir", str(save), "--resume", "--rl-steps", "2", "--objective", "beam"]) == 2
    _one_line(capsys, "--objective mrt, not beam")
    # extending and observing flags may change: one more RL step, validated every step
    assert cli.main(["--save-dir", str(save), "--resume", "--rl-steps", "2", "--eval-every", "1", "--log-every",
                     "1", "--keep-last", "5", "--rescore-chunk", "2", "--threads", "1"]) == 0
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"]) for r in rows if r["phase"] in ("mle", "rl")] == [(1, "mle"), (2, "rl"), (3, "rl")]
    assert load(save / "checkpoint_last.pt")["config"]["objective"] == "mrt"


def test_the_rule_table_covers_every_flag():
    """Every declared flag exists; every flag not declared is fixed; each rule does what the table says."""
    names = {f.name for f in fields(Config)}
    assert set(rules.RULES) <= names
    assert rules.rule("a_flag_added_later") == rules.FIXED
    saved_cfg = Config(task="tsv", train="t.tsv", valid="v.tsv", reward="edit", best_metric="reward")
    saved = asdict(saved_cfg)
    state = {"step": 5, "mle_end": 4}  # in RL
    for f in fields(Config):
        old = saved[f.name]
        new = (not old if isinstance(old, bool) else old + 1 if isinstance(old, int) else old * 2 + 1
               if isinstance(old, float) else f"other-{old}")
        kind = rules.rule(f.name)
        cfg = SimpleNamespace(**{**saved, f.name: new})  # the values compared, not necessarily a valid Config
        if kind == rules.FREE or (kind == rules.GROW and new > old):
            rules.check(cfg, saved, state, "ck.pt")
        else:  # fixed, or --mle-steps of a finished MLE phase
            with pytest.raises(ValueError, match=f"--{f.name.replace('_', '-')} ") as info:
                rules.check(cfg, saved, state, "ck.pt")
            assert "ck.pt was trained with" in str(info.value) and rules.show(new) in str(info.value)
    grow = Config(**{**saved, "rl_steps": saved["rl_steps"] - 1})
    with pytest.raises(ValueError, match="may only grow"):
        rules.check(grow, saved, state, "ck.pt")
    # --mle-steps may change while the MLE phase runs, never below the steps taken
    in_mle = {"step": 3, "mle_end": saved["mle_steps"]}
    rules.check(Config(**{**saved, "mle_steps": 3}), saved, in_mle, "ck.pt")
    with pytest.raises(ValueError, match="taken 3 MLE steps"):
        rules.check(Config(**{**saved, "mle_steps": 2}), saved, in_mle, "ck.pt")


def test_the_docs_table_is_the_declared_table():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "runs.md").read_text()
    for kind in (rules.FREE, rules.GROW, rules.PHASE):
        [row] = [line for line in text.splitlines() if line.startswith(f"| {kind} |")]
        listed = {flag[2:].replace("-", "_") for flag in row.split("|")[2].strip(" `").split()}
        assert listed == {name for name, k in rules.RULES.items() if k == kind}, kind


def test_karel_train_size_changed_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TWOPHASE_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert cli.main(["--task", "karel", "--train-size", "6", "--valid-size", "2", "--hidden-size", "8", "--embed-dim",
                     "4", "--mle-steps", "1", "--rl-steps", "0", "--mle-batch-size", "4", "--max-len", "31",
                     "--eval-beam", "1", "--save-dir", str(run)]) == 0
    recipe = json.loads((run / "config.json").read_text())["recipe"]
    assert recipe == startpoint.recipe_defaults(Config(task="karel")) and recipe  # the task's recipe, recorded
    capsys.readouterr()
    assert cli.main(["--save-dir", str(run), "--resume", "--train-size", "7"]) == 2
    _one_line(capsys, "--train-size 6, not 7")
    assert cli.main(["--save-dir", str(run), "--resume", "--valid-size", "3"]) == 2
    _one_line(capsys, "--valid-size 2, not 3")


# ---- 11. --resume-from any checkpoint; the crash checkpoint; files that are not checkpoints
def test_resume_where_only_the_crash_checkpoint_exists(task, tmp_path, capsys):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "2", "--rl-steps", "0", "--keep-last", "0")) == 0
    (save / "checkpoint_last.pt").rename(save / "checkpoint_crash.pt")  # what a run stopped by bad steps leaves
    (save / "checkpoint_best.pt").unlink()
    capsys.readouterr()
    assert cli.main(["--save-dir", str(save), "--resume"]) == 2
    _one_line(capsys, f"--resume-from {save / 'checkpoint_crash.pt'} continues from it")
    assert cli.main(["--resume-from", str(save / "checkpoint_crash.pt"), "--mle-steps", "3"]) == 0
    assert load(save / "checkpoint_last.pt")["step"] == 3


def test_resume_from_an_earlier_step_sets_the_later_checkpoints_aside(finished, tmp_path, capsys):
    import shutil
    save = tmp_path / "run"
    shutil.copytree(finished, save)
    before = _files(save)
    capsys.readouterr()
    assert cli.main(["--resume-from", str(save / "checkpoint_step00000001.pt")]) == 0
    assert "moved to" in capsys.readouterr().out
    aside = save / "after_step1"
    for name in ("checkpoint_step00000002.pt", "checkpoint_step00000004.pt", "checkpoint_last.pt",
                 "checkpoint_mle_end.pt", "metrics.jsonl"):
        assert (aside / name).read_bytes() == before[name], name  # the abandoned branch, whole
    assert load(save / "checkpoint_last.pt")["step"] == 4  # the run redone from step 1
    assert (save / "checkpoint_step00000001.pt").read_bytes() == before["checkpoint_step00000001.pt"]
    capsys.readouterr()
    assert cli.main(["--resume-from", str(save / "checkpoint_step00000001.pt"), "--save-dir", str(tmp_path)]) == 2
    _one_line(capsys, f"continues the run in {save}")


# ---- 12. config.json, --init-from, --eval-only, --export
def test_config_json_is_written_and_updated_on_resume(task, tmp_path):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "1", "--rl-steps", "0")) == 0
    doc = json.loads((save / "config.json").read_text())
    assert doc["config"] == load(save / "checkpoint_last.pt")["config"] and doc["started_from"] is None
    assert doc["config"]["task"] == "tsv" and doc["config"]["reward"] == "edit"  # resolved
    assert cli.main(["--save-dir", str(save), "--resume", "--mle-steps", "2"]) == 0
    doc = json.loads((save / "config.json").read_text())
    assert doc["config"]["mle_steps"] == 2 and doc["config"]["resume"] and doc["started_from"].endswith("last.pt")
    assert not list(save.glob(".*.tmp"))


def test_init_from_starts_a_new_run_from_the_model(finished, tmp_path, capsys):
    source = finished / "checkpoint_last.pt"
    new = tmp_path / "rl"
    # no model or data flags: the checkpoint's (hidden 8); a learning rate of 0 leaves its weights as they were
    assert cli.main(["--init-from", str(source), "--save-dir", str(new), "--mle-steps", "0", "--rl-steps", "1",
                     "--rl-lr", "0", "--beam-size", "2", "--no-compare-mle"]) == 0
    state, old = load(new / "checkpoint_last.pt"), load(source)
    assert state["step"] == 1 and state["config"]["hidden_size"] == 8 and state["config"]["init_from"] == str(source)
    assert all(torch.equal(state["model"][k], old["model"][k]) for k in old["model"])
    assert [s["step"] for s in state["optimizer"]["state"].values()][0] == 1  # a fresh optimizer
    assert cli.main(["--save-dir", str(new), "--resume", "--rl-steps", "2"]) == 0  # the new run resumes as any
    assert load(new / "checkpoint_last.pt")["step"] == 2
    capsys.readouterr()
    assert cli.main(["--save-dir", str(new), "--resume", "--eval-only"]) == 0  # its own model, not the source's
    assert capsys.readouterr().out.splitlines()[0] == f"{new / 'checkpoint_last.pt'} (step 2):"
    assert state["config"]["lr_decay"] == 1.0  # the recipe of the checkpoint's task (tsv), not the default g2p's
    assert cli.main(["--init-from", str(source), "--save-dir", str(finished), "--overwrite"]) == 2
    _one_line(capsys, "whose run --overwrite would delete")
    assert source.exists()
    capsys.readouterr()
    assert cli.main(["--init-from", str(source), "--save-dir", str(tmp_path / "other"), "--hidden-size", "16"]) == 2
    _one_line(capsys, "its model was built with --hidden-size 8, not 16")
    assert not (tmp_path / "other").exists()


def test_eval_only_writes_nothing(finished, task, capsys):
    before = _files(finished)
    capsys.readouterr()
    assert cli.main(["--save-dir", str(finished), "--resume", "--eval-only", "--test", str(task / "valid.tsv"),
                     "--eval-beam", "2"]) == 0  # evaluation flags are its own: only the model must match
    out = capsys.readouterr().out
    source, header, *rows = out.strip().splitlines()
    assert source == f"{finished / 'checkpoint_last.pt'} (step 4):"
    assert header.split() == ["valid", "test"] and any(r.startswith("reward") for r in rows)
    assert _files(finished) == before
    assert cli.main(["--init-from", str(finished / "checkpoint_step00000001.pt"), "--eval-only"]) == 0
    assert _files(finished) == before
    assert cli.main(["--eval-only"]) == 2
    _one_line(capsys, "--eval-only evaluates a checkpoint")


def test_export_best_hands_the_best_checkpoint_to_the_task(finished, tmp_path, monkeypatch):
    import shutil
    save = tmp_path / "run"
    shutil.copytree(finished, save)
    best = load(save / "checkpoint_best.pt")
    best["model"] = {k: v + 1 for k, v in best["model"].items()}  # unlike the last model
    save_atomic(best, save / "checkpoint_best.pt")
    exported = {}
    for export in ("best", "last"):
        cfg, start = cli.parse(["--save-dir", str(save), "--resume", "--export", export])
        tr = recipe.setup(cfg, start)
        monkeypatch.setattr(tr.trainer.task, "save_final", lambda model, d: exported.update({export: model.state_dict()}))
        cli.save_final(tr)
    assert all(torch.equal(exported["best"][k], best["model"][k]) for k in best["model"])
    last = load(save / "checkpoint_last.pt")["model"]
    assert all(torch.equal(exported["last"][k], last[k]) for k in last)


def test_run_flag_combinations_are_refused(finished, capsys):
    assert cli.main(["--save-dir", str(finished), "--resume", "--resume-from", str(finished / "checkpoint_last.pt")]) \
        == 2
    _one_line(capsys, "give one of them")
    assert cli.main(["--init-from", str(finished / "checkpoint_last.pt"), "--resume", "--save-dir", str(finished)]) == 2
    _one_line(capsys, "--init-from starts a new run")


# ---- --grad-accum: N batches of B accumulate the gradient of one batch of N*B, exactly (float64)
@pytest.mark.parametrize("phase, objective", [("mle", "beam"), ("rl", "beam"), ("rl", "mrt")])
def test_grad_accum_equals_one_big_batch(task, tmp_path, phase, objective, monkeypatch):
    cfg = Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), hidden_size=8, embed_dim=4,
                 beam_size=3, max_len=7, rescore_chunk=4, save_dir=str(tmp_path), objective=objective,
                 mle_weight=0.3, compare_mle=False)
    tr = recipe.setup(cfg).trainer  # its steps, taken directly
    tr.model.double()
    grads = []
    for module in (steps.mle, steps.parts):  # the update, where each step calls it: the gradient, kept
        monkeypatch.setattr(module, "update", lambda p, settings, loss: grads.append(
            [q.grad.clone() for q in tr.model.parameters()]) or {"grad_norm": 0.0, "skipped": 0})
    first, second = [0, 5, 7], [2, 9, 11]  # pair indices (MLE) or source indices (RL)
    batches = "mle_batches" if phase == "mle" else "rl_batches"
    step = tr.mle if phase == "mle" else tr.rl
    for accum, plan in ((2, [first, second]), (1, [first + second])):
        step.steps.grad_accum = accum  # the step's own section
        setattr(tr.parts, batches, iter(plan))
        row = tr.mle_step() if phase == "mle" else tr.rl_step()
        assert row["skipped"] == 0
    accumulated, big = grads
    assert any(g.abs().sum() > 0 for g in big)
    for a, b in zip(accumulated, big):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_grad_accum_runs_from_the_command_line(task, tmp_path):
    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "1", "--rl-steps", "1", "--grad-accum", "2",
                          "--no-compare-mle")) == 0
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["candidates"] for r in rows if r["phase"] == "rl"] == [2 * 3 * 3]  # 2 batches of 3 sources, K = 3
    assert load(save / "checkpoint_last.pt")["mle_batches"] != load(save / "checkpoint_last.pt")["rl_batches"]


# ---- a run of twophase.fit's own parts, resumed from the command line
def _fit_config(task, save, **more):
    return Config(train=str(task / "train.tsv"), valid=str(task / "valid.tsv"), save_dir=str(save), hidden_size=8,
                  embed_dim=4, batch_size=3, mle_batch_size=4, beam_size=3, rescore_chunk=5, max_len=7, eval_beam=1,
                  **{"mle_steps": 1, "rl_steps": 1, **more})


def test_resume_of_a_fit_run_with_its_own_model_says_how_to_continue_it(task, tmp_path, capsys):
    import twophase
    from twophase import Seq2Seq
    from twophase.tasks.text import TSV

    cfg = _fit_config(task, tmp_path / "mine")
    vocab = TSV(cfg)
    vocab.load_data()  # the task's vocabularies: what a model of one's own is built for
    twophase.fit(cfg, model=Seq2Seq(len(vocab.src_vocab), len(vocab.tgt_vocab), 6, 10))
    capsys.readouterr()
    for flags in (["--resume"], ["--resume", "--eval-only"], ["--resume-from", str(tmp_path / "mine" /
                                                                                     "checkpoint_last.pt")]):
        assert cli.main(["--save-dir", str(tmp_path / "mine"), *flags]) == 2
        err = _one_line(capsys, "its parameters do not fit the model task 'tsv' builds",
                        "twophase.fit(..., model=a_fresh_copy, resume=True)")
        assert err.startswith(f"train.py: error: {flags[0]}: ") and "--hidden-size" not in err
    # its model into a run of the built-in LSTM: no LSTM size is the checkpoint's
    assert cli.main(["--init-from", str(tmp_path / "mine" / "checkpoint_last.pt"), "--save-dir", str(tmp_path / "l"),
                     "--embed-dim", "5"]) == 2
    _one_line(capsys, "--embed-dim 5: --init-from ", "holds a model other than the built-in LSTM", "leave it out")


def script_reward(hypotheses, references):
    return [float(len(h) > 0) for h in hypotheses]


def test_resume_of_a_fit_run_whose_reward_is_a_scripts_says_so(task, tmp_path, capsys, monkeypatch):
    import twophase

    monkeypatch.setattr(script_reward, "__module__", "__main__")  # defined in a script, or a notebook
    twophase.fit(_fit_config(task, tmp_path / "script"), reward=script_reward)
    capsys.readouterr()
    assert cli.main(["--save-dir", str(tmp_path / "script"), "--resume", "--rl-steps", "2"]) == 2
    err = _one_line(capsys, "--resume: ", "its reward __main__:script_reward was given to twophase.fit",
                    "twophase.fit(..., reward=script_reward, resume=True)")
    assert "--reward" not in err  # a flag not typed


def test_fit_refuses_a_lambda_reward_for_a_run_that_saves_checkpoints(task, tmp_path):
    import twophase

    with pytest.raises(ValueError, match=r"^reward test_resume:test_fit_refuses_.*<lambda>: a lambda or a function "
                                         r"defined inside another has no name"):
        twophase.fit(_fit_config(task, tmp_path / "lambda"), reward=lambda hypotheses, references: [0.0] * len(
            hypotheses))
    assert not (tmp_path / "lambda").exists()


# ---- --export last|best for a model without an export of its task's own: <save-dir>/model_final.pt
def test_an_export_that_decodes_as_another_model_is_refused(tmp_path, capsys, monkeypatch):
    """model_final.pt is read back as twophase-decode reads it (into the model the task builds): a frozen
    parameter the task draws anew is not the trained one, so the export is refused in one line and removed."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # tests/verifier_task.py
    save = tmp_path / "run"
    argv = ["--task", "verifier_task:FrozenNoise", "--hidden-size", "8", "--batch-size", "4", "--beam-size", "2",
            "--mle-steps", "0", "--rl-steps", "1", "--max-len", "5", "--save-dir", str(save), "--export", "last"]
    assert cli.main(argv) == 2
    _one_line(capsys, f"{save / 'model_final.pt'}: read back as twophase-decode reads it, its tensor noise "
                      "differs from the trained model's", f"not exported; {save / 'checkpoint_last.pt'} holds "
                      "the trained model")
    assert not (save / "model_final.pt").exists() and (save / "checkpoint_last.pt").exists()


def test_export_writes_a_file_that_decodes_as_its_checkpoint_without_the_run(task, tmp_path, capsys):
    from twophase.train import decode

    save = tmp_path / "run"
    assert cli.main(_argv(task, save, "--mle-steps", "3", "--rl-steps", "1", "--eval-every", "1")) == 0
    assert not (save / "model_final.pt").exists()  # not asked for: the checkpoints are the model
    capsys.readouterr()
    lines = [" ".join(line.split("\t")[0].split()) for line in (task / "valid.tsv").read_text().splitlines()]
    for which, checkpoint in (("best", "checkpoint_best.pt"), ("last", "checkpoint_last.pt")):
        assert cli.main(["--save-dir", str(save), "--resume", "--export", which]) == 0  # a finished run: no step
        assert f"final model: {save / 'model_final.pt'}" in capsys.readouterr().out
        moved = tmp_path / f"{which}.pt"
        (save / "model_final.pt").replace(moved)
        exported, _, _ = decode.load_model(str(moved), torch.device("cpu"))
        model, task_of, cfg = decode.load_model(str(save / checkpoint), torch.device("cpu"))
        saved = load(save / checkpoint)["model"]
        assert all(torch.equal(exported.state_dict()[k], saved[k]) for k in saved)
        assert decode.decode_lines(exported, task_of, lines, 3, cfg["max_len"], 8, torch.device("cpu"),
                                   nbest=2, scores=True)[0] == \
            decode.decode_lines(model, task_of, lines, 3, cfg["max_len"], 8, torch.device("cpu"), nbest=2,
                                scores=True)[0]
    copy = tmp_path / "alone"
    copy.mkdir()
    (tmp_path / "best.pt").replace(copy / "best.pt")
    shutil.rmtree(save)  # nothing of the run is needed
    out = tmp_path / "out.txt"
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    assert decode.main(["--checkpoint", str(copy / "best.pt"), "--input", str(tmp_path / "in.txt"), "--output",
                        str(out)]) == 0
    assert len(out.read_text().splitlines()) == len(lines)
    assert cli.main(["--save-dir", str(copy), "--resume-from", str(copy / "best.pt")]) == 2
    _one_line(capsys, "a run's exported model (its parameters alone, --export)", "--init-from starts a new run")


def test_decode_of_a_fit_run_with_its_own_model_says_how(task, tmp_path, capsys):
    import twophase
    from twophase import Seq2Seq
    from twophase.tasks.text import TSV
    from twophase.train import decode

    cfg = _fit_config(task, tmp_path / "mine", rl_steps=0)
    vocab = TSV(cfg)
    vocab.load_data()
    twophase.fit(cfg, model=Seq2Seq(len(vocab.src_vocab), len(vocab.tgt_vocab), 6, 10))
    (tmp_path / "in.txt").write_text("a b\n")
    capsys.readouterr()
    assert decode.main(["--checkpoint", str(tmp_path / "mine" / "checkpoint_last.pt"), "--input",
                        str(tmp_path / "in.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "twophase.fit(config, model=...)) decodes in Python" in err, err


def test_a_value_an_older_version_recorded_and_this_one_refuses_is_one_line(finished, tmp_path, capsys):
    """A checkpoint whose recorded config holds a value this version refuses (--dropout 1, once allowed): --resume
    and twophase-decode each say so in one line naming where it came from, exit 2, and the file is untouched."""
    from twophase.train import decode

    save = tmp_path / "run"
    save.mkdir()
    state = load(finished / "checkpoint_last.pt")
    state["config"]["dropout"] = 1.0
    save_atomic(state, save / "checkpoint_last.pt")
    before = (save / "checkpoint_last.pt").read_bytes()
    (tmp_path / "in.txt").write_text("a b\n")
    capsys.readouterr()
    assert cli.main(["--save-dir", str(save), "--resume", "--rl-steps", "3"]) == 2
    _one_line(capsys, "--resume's checkpoint: Config.dropout: must be in [0, 1), got 1")
    assert decode.main(["--checkpoint", str(save / "checkpoint_last.pt"), "--input", str(tmp_path / "in.txt")]) == 2
    _one_line(capsys, f"--checkpoint {save / 'checkpoint_last.pt'}: its recorded configuration: Config.dropout")
    assert (save / "checkpoint_last.pt").read_bytes() == before


def test_resume_after_a_kill_between_the_step_file_and_checkpoint_last_takes_the_newest(task, tmp_path, capsys,
                                                                                       monkeypatch):
    """A save writes checkpoint_stepN.pt, then checkpoint_last.pt: kill -9 during the second write leaves the
    older checkpoint_last.pt beside the complete, newer step file. --resume continues from the step file (no
    step redone; a later step file cut short is passed over) and ends with the parameters of a run never killed."""
    whole, save = tmp_path / "whole", tmp_path / "run"
    assert cli.main(_argv(task, whole, "--mle-steps", "4", "--rl-steps", "0", "--no-compare-mle")) == 0
    assert cli.main(_argv(task, save, "--mle-steps", "3", "--rl-steps", "0", "--no-compare-mle", "--save-every", "1",
                          "--keep-last", "3")) == 0
    shutil.copy(save / "checkpoint_step00000002.pt", save / "checkpoint_last.pt")  # the write of step 3 cut
    (save / "checkpoint_step00000009.pt").write_bytes((save / "checkpoint_step00000003.pt").read_bytes()[:500])
    from twophase.train.trainer import Trainer
    taken = []
    real = Trainer.mle_step
    monkeypatch.setattr(Trainer, "mle_step", lambda self: taken.append(1) or real(self))
    capsys.readouterr()
    assert cli.main(["--save-dir", str(save), "--resume", "--mle-steps", "4"]) == 0
    assert len(taken) == 1  # step 4 alone, not steps 3 and 4
    assert "note: checkpoint_step00000003.pt (step 3) is newer than checkpoint_last.pt" in capsys.readouterr().out
    a, b = load(whole / "checkpoint_last.pt")["model"], load(save / "checkpoint_last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "mle"] == [1, 2, 3, 4]
