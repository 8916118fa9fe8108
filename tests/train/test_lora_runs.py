"""A --lora-r run's lineage (docs/runs.md): its checkpoints record the base model (folder and fingerprint) and a
different base is refused in one line on --resume, --init-from and decoding; --init-from continues its adapters
(another rank: one line saying how to start new ones); --export best|last, with or without --merge-lora, also
after the run (--resume --export on a finished run); a merged hf_final is a plain model folder. Tiny GPT-2."""
import importlib.util
import json
import shutil

import pytest
import torch

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None:
    pytest.skip("transformers and peft are not installed (pip install twophase[hf])", allow_module_level=True)

from twophase.train import cli, decode, recipe, runstate  # noqa: E402
from twophase.train.checkpoint import load, save_atomic  # noqa: E402

import hf_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PAIRS = [("a b c", "c"), ("d e", "e"), ("f", "f"), ("g h a", "a"), ("b d", "d"), ("c e g", "g")]
FLAGS = ["--batch-size", "3", "--mle-batch-size", "3", "--beam-size", "2", "--max-len", "5", "--max-src-len", "10",
         "--eval-every", "1", "--lora-r", "4", "--mle-steps", "2", "--rl-steps", "0", "--lr", "0.05"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A base model, data, and a finished LoRA run (2 MLE steps) whose checkpoint_best.pt holds other adapters
    than checkpoint_last.pt (shifted: the two exports must differ)."""
    d = tmp_path_factory.mktemp("lora_runs")
    hf_tiny.save(d / "base", "gpt2")
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS))
    assert cli.main(_argv(d, "run")) == 0
    best = load(d / "run" / "checkpoint_best.pt")
    best["model"] = {k: v + 0.25 for k, v in best["model"].items()}
    save_atomic(best, d / "run" / "checkpoint_best.pt")
    return d


def _argv(d, save, *extra, base="base"):
    return ["--train", str(d / "train.jsonl"), "--valid", str(d / "train.jsonl"), "--hf-model", str(d / base),
            "--save-dir", str(d / save), *FLAGS, *extra]


def _fails_with_one_line(argv, capsys, *needles):
    capsys.readouterr()  # what came before (transformers' progress bars)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), err


def _adapters(path):
    return load(path)["model"]


def _close(a, b, tol=1e-6):
    return a.keys() == b.keys() and all(torch.allclose(a[k].double(), b[k].double(), rtol=tol, atol=tol) for k in a)


def test_checkpoints_record_the_base_model(folder):
    state = load(folder / "run" / "checkpoint_last.pt")
    base = state["base_model"]
    assert base["path"] == str(folder / "base") and len(base["weights"]) == 64 and len(base["config"]) == 64
    assert load(folder / "run" / "checkpoint_best.pt")["base_model"] == base
    assert all("lora_" in k for k in state["model"])  # still the adapters alone


def test_init_from_a_lora_checkpoint_continues_its_adapters(folder, capsys):
    cfg, start = cli.parse(["--init-from", str(folder / "run" / "checkpoint_best.pt"), "--save-dir",
                            str(folder / "init"), "--mle-steps", "1"])
    assert cfg.lora_r == 4  # taken from the checkpoint, as --hf-model
    tr = recipe.setup(cfg, start)
    own = {k: v for k, v in tr.trainer.model.state_dict().items() if "lora_" in k}
    assert _close(own, _adapters(folder / "run" / "checkpoint_best.pt"), 0)
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(folder / "base", dtype=torch.float32).state_dict()
    frozen = {k.removeprefix("model.").replace(".base_layer", ""): v for k, v in tr.trainer.model.state_dict().items()
              if "lora_" not in k}  # the rest: the folder's model
    assert base.keys() <= frozen.keys() and all(torch.equal(frozen[k], base[k]) for k in base)
    assert tr.state.step == 0
    _fails_with_one_line(["--init-from", str(folder / "run" / "checkpoint_best.pt"), "--save-dir",
                          str(folder / "init8"), "--lora-r", "8"], capsys,
                         "its model was built with --lora-r 4, not 8", "--merge-lora", "hf_final")


def test_export_best_and_last_after_the_run_with_and_without_merge(folder):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    run, F32 = folder / "run", torch.float32  # as the run loads the base
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    logits = {}
    for which in ("best", "last"):
        assert cli.main(["--save-dir", str(run), "--resume", "--export", which]) == 0  # a finished run: no step
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder / "base", dtype=F32),
                                            run / "hf_final")
        saved = {"model." + k.replace(".default", ""): v for k, v in adapted.base_model.model.state_dict().items()
                 if "lora_" in k}
        want = {k.replace(".default", ""): v for k, v in _adapters(run / f"checkpoint_{which}.pt").items()}
        assert _close(saved, want, 0)
        logits[which] = adapted.eval()(input_ids=ids).logits
        assert cli.main(["--save-dir", str(run), "--resume", "--export", which, "--merge-lora"]) == 0
        merged = AutoModelForCausalLM.from_pretrained(run / "hf_final", dtype=F32).eval()  # a plain folder: config.json
        assert not any("lora" in k for k in merged.state_dict())
        torch.testing.assert_close(merged(input_ids=ids).logits, logits[which], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits["best"], logits["last"], rtol=1e-3, atol=1e-3)
    assert load(run / "checkpoint_last.pt")["step"] == 2  # --resume on the finished run took no step


def test_a_different_base_is_refused_on_resume_init_from_and_decode(folder, tmp_path, capsys):
    shutil.copytree(folder / "run", tmp_path / "run")  # its config names folder/base
    shutil.copytree(folder / "base", tmp_path / "moved")
    hf_tiny.save(tmp_path / "other", "gpt2", seed=7)
    weights = folder / "base" / "model.safetensors"
    last = str(tmp_path / "run" / "checkpoint_last.pt")
    why = "trained on another base model than --hf-model"
    (tmp_path / "in.txt").write_text("a b\n")
    try:
        shutil.copy(tmp_path / "other" / "model.safetensors", weights)  # the same folder, other weights
        _fails_with_one_line(["--save-dir", str(tmp_path / "run"), "--resume", "--rl-steps", "1"], capsys,
                             f"--resume: {last}", why, "its weights differ")
        _fails_with_one_line(["--init-from", last, "--save-dir", str(tmp_path / "new")], capsys, "--init-from", why)
        assert decode.main(["--checkpoint", last, "--input", str(tmp_path / "in.txt")]) == 2
        assert why in capsys.readouterr().err
        shutil.copy(tmp_path / "moved" / "model.safetensors", weights)
        config = json.loads((folder / "base" / "config.json").read_text())
        (folder / "base" / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-3}))
        _fails_with_one_line(["--save-dir", str(tmp_path / "run"), "--resume", "--rl-steps", "1"], capsys, why,
                             "its config differs")  # the same weights, computing otherwise
    finally:
        shutil.copy(tmp_path / "moved" / "model.safetensors", weights)
        shutil.copy(tmp_path / "moved" / "config.json", folder / "base" / "config.json")
    assert decode.main(["--checkpoint", last, "--input", str(tmp_path / "in.txt"), "--hf-model",
                        str(tmp_path / "moved")]) == 0  # the base, moved: recognised by its fingerprint
    capsys.readouterr()


def test_decode_names_an_adapter_folder_given_as_the_model(folder, tmp_path, capsys):
    assert cli.main(["--save-dir", str(folder / "run"), "--resume"]) == 0  # hf_final: the adapters
    capsys.readouterr()
    (tmp_path / "in.txt").write_text("a b\n")
    assert decode.main(["--checkpoint", str(folder / "run" / "checkpoint_last.pt"), "--input",
                        str(tmp_path / "in.txt"), "--hf-model", str(folder / "run" / "hf_final")]) == 2
    err = capsys.readouterr().err
    assert "LoRA adapters" in err and "base model" in err and len(err.strip().splitlines()) == 1
    assert decode.main(["--checkpoint", str(folder / "run"), "--input", str(tmp_path / "in.txt")]) == 2
    err = capsys.readouterr().err
    assert "a directory" in err and "checkpoint_best.pt" in err and len(err.strip().splitlines()) == 1


def test_the_compare_snapshot_of_a_lora_model_holds_the_adapters_alone(folder):
    """--compare-mle's snapshot of the end of MLE, held through the RL phase: the adapters (and their optimizer
    state), in host memory; the frozen base does not change, so it is not copied."""
    cfg, start = cli.parse(["--save-dir", str(folder / "run"), "--resume"])
    tr = recipe.setup(cfg, start)
    snap = tr.trainer.snapshot()
    assert snap["model"] and all("lora_" in k for k in snap["model"])
    tr.trainer.restore(snap)
    assert _close({k: v for k, v in tr.trainer.model.state_dict().items() if "lora_" in k}, snap["model"], 0)


def test_the_fingerprint_samples_within_any_tensor_and_sees_a_changed_value():
    from twophase.train import resume
    model = torch.nn.Linear(1, 2**24 + 3, bias=False, dtype=torch.float16).requires_grad_(False)  # past float32's ints
    torch.nn.init.zeros_(model.weight)
    first = resume.fingerprint(model)["weights"]
    with torch.no_grad():
        model.weight[-1] = 1.0  # the last element is sampled
    assert resume.fingerprint(model)["weights"] != first
    assert resume.fingerprint(torch.nn.Linear(2, 2)) is None  # every parameter trains: nothing to record
