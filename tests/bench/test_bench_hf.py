"""benchmarks.hf on toy sizes: every method's worker reports its fields, and the TRL recipe (one forward of
the whole input per row) gives the two-phase gradient, so the benchmark compares equal work."""
import importlib.util

import pytest
import torch

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import rescore_backward, sample  # noqa: E402
from benchmarks import hf, peers  # noqa: E402

TOY = dict(hf.DEFAULTS, batch=2, samples=3, prompt=6, completion=4, width=16, layers=1, heads=2, vocab=40, chunk=4,
           warmup=1, steps=1)


@pytest.mark.parametrize("model", hf.MODELS)
def test_every_method_reports_its_figures(model, one_thread):
    cells = [hf.run_cell(dict(TOY, model=model, method=m, threads=1)) for m in hf.METHODS]
    for c in cells:
        for key in ("phase1_s", "phase2_s", "step_s", "phase1_mb", "phase2_mb", "tensors_mb", "rss_mb"):
            assert c[key] >= 0, key
        assert c["tensors_mb"] >= max(c["phase1_mb"], c["phase2_mb"]) > 0
        assert 1 <= c["mean_len"] <= TOY["completion"]
    text = hf.table(cells)
    assert "two-phase / trl" in text and "two-phase / one-phase" in text


@pytest.mark.parametrize("model", hf.MODELS)
def test_trl_recipe_gives_the_two_phase_gradient(model, one_thread):
    wrapper, source = hf.build(dict(TOY, model=model))
    wrapper.double()
    s = sample(wrapper, source, TOY["samples"], TOY["completion"], generator=torch.Generator().manual_seed(0))
    c = hf.coefficients(s, TOY["batch"], 0)
    rescore_backward(wrapper, source, s, c, chunk_size=4)
    two = [p.grad.clone() for p in wrapper.parameters()]
    wrapper.zero_grad(set_to_none=True)
    peers.trl_backward(wrapper, source, s, c, micro=4)
    diff = torch.stack([(g - p.grad).norm() for g, p in zip(two, wrapper.parameters())]).norm()
    assert float(diff) <= 1e-6 * float(torch.stack([g.norm() for g in two]).norm())  # float32 norms inside


def test_bad_flags_are_one_line_errors(capsys):
    for argv in (["--config", "batch=x"], ["--models", "gpt9"], ["--methods", "two-phase,nope"]):
        with pytest.raises(SystemExit) as exit_:
            hf.parse_args(argv)
        assert exit_.value.code == 2
        assert "error: --" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")
def test_the_real_grpo_trainer_gives_the_two_phase_gradient(one_thread):
    """The bench's grpo-trainer method (TRL 1.16's own compute_loss, dr_grpo, advantages scaled to the REINFORCE
    coefficients) computes the gradient two-phase computes, so the two are timed on equal work."""
    cell = dict(TOY, model="causal", method="grpo-trainer", threads=1)
    wrapper, source = hf.build(cell)
    wrapper.double()
    trainer = peers.grpo_trainer(wrapper, cell)
    s = sample(wrapper, source, TOY["samples"], TOY["completion"], generator=torch.Generator().manual_seed(0))
    c = hf.coefficients(s, TOY["batch"], 0)
    rescore_backward(wrapper, source, s, c, chunk_size=4)
    two = [p.grad.clone() for p in wrapper.parameters()]
    wrapper.zero_grad(set_to_none=True)
    peers.grpo_trainer_backward(trainer, wrapper, source, s, c, micro=4)
    diff = torch.stack([(g - p.grad).norm() for g, p in zip(two, wrapper.parameters())]).norm()
    assert float(diff) <= 1e-5 * float(torch.stack([g.norm() for g in two]).norm())  # TRL's float32 logits
    figures = hf.run_cell(dict(cell))
    assert figures["step_s"] > 0 and figures["tensors_mb"] > 0 and "_trainer" not in figures
@pytest.mark.parametrize("model", hf.MODELS)
@pytest.mark.parametrize("search", ["sample", "beam"])
def test_phase_one_against_generate_reports_whole_and_per_step(model, search, one_thread):
    from benchmarks import decode
    wrapper, source = hf.build(dict(TOY, model=model))
    K, T = TOY["samples"], 6
    with torch.inference_mode():  # the same work: B*K rows of T new tokens each (eos after the first is rare)
        ours = decode.twophase(wrapper, source, K, T, 0, search)
        theirs = decode.generate(wrapper, source, K, T, 0, search)
    assert ours.tokens.shape[0] == TOY["batch"] * K == theirs.shape[0]
    assert theirs.shape[1] - (source["input_ids"].shape[1] if model == "causal" else 1) == T
    out = decode.compare(dict(TOY, model=model, completion=T), rounds=1, search=search)
    for name in decode.METHODS:
        assert out[name]["whole_s"] > 0
    assert set(out["ratio"]) == {"whole_s", "step_ms"}
    assert f"| {model} | {search} | twophase / generate |" in decode.table([out], dict(TOY, completion=T))
