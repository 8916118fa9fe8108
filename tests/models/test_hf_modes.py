"""The Hugging Face wrappers never change the user's model's mode: search and phase two compute in evaluation mode
(no dropout) and hand every module back in the mode it had, whichever that was; the wrapper reports the model's
mode. Tiny GPT-2 and T5 with dropout, so that a pass in training mode would give other numbers."""
import importlib.util

import pytest
import torch

if importlib.util.find_spec("transformers") is None:  # only a missing extra skips: a broken install fails
    pytest.skip("transformers is not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import beam_search, protocol, rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM, HFSeq2Seq  # noqa: E402

import hf_tiny  # noqa: E402

PROMPTS = {"input_ids": torch.tensor([[5, 6, 7, 8], [10, 11, 9, 4]]), "attention_mask": torch.ones(2, 4).long()}


def _with_dropout(kind: str):
    """The tiny model with dropout 0.3 everywhere (hf_tiny's have none)."""
    model = hf_tiny.seq2seq("t5", seed=1) if kind == "t5" else hf_tiny.causal("gpt2")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    return model


def _wrap(model):
    return HFSeq2Seq(model) if model.config.is_encoder_decoder else HFCausalLM(model)


def _modes(module):
    return {name: m.training for name, m in module.named_modules()}


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
@pytest.mark.parametrize("mode", ["eval", "train", "mixed"])
def test_search_and_phase_two_leave_every_modules_mode_as_it_was(kind, mode, one_thread):
    model = _with_dropout(kind).train(mode == "train")
    if mode == "mixed":  # a training model with a frozen part the user keeps in evaluation mode
        model.train()
        next(m for m in model.modules() if isinstance(m, torch.nn.Dropout)).eval()
    want = _modes(model)
    wrapper = _wrap(model)
    assert wrapper.training == model.training and _modes(model) == want  # wrapping changed nothing
    g = torch.Generator().manual_seed(0)
    for name, run in (("sample", lambda: sample(wrapper, PROMPTS, 3, 5, generator=g)),
                      ("beam_search", lambda: beam_search(wrapper, PROMPTS, 3, 5))):
        s = run()
        assert _modes(model) == want and wrapper.training == model.training, name
    c = torch.linspace(-1, 1, len(s), dtype=torch.float64)
    rescore_backward(wrapper, PROMPTS, s, c, chunk_size=2)
    assert _modes(model) == want and wrapper.training == model.training, "rescore_backward"


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_generation_scores_are_phase_twos_whatever_the_models_mode(kind, one_thread):
    """A model in training mode (dropout on) samples and beam-searches with evaluation mode's log-probabilities,
    the ones phase two differentiates: checked against the model's teacher-forced scores in evaluation mode."""
    model = _with_dropout(kind)
    wrapper = _wrap(model)
    for start in ("eval", "train", "eval"):  # eval -> train -> eval: nothing is left behind by a pass
        model.train(start == "train")
        found = [sample(wrapper, PROMPTS, 4, 5, generator=torch.Generator().manual_seed(1)),
                 beam_search(wrapper, PROMPTS, 3, 5)]
        c = torch.linspace(-1, 1, len(found[0]), dtype=torch.float64)
        rescore_backward(wrapper, PROMPTS, found[0], c, chunk_size=3)
        assert model.training == (start == "train")
        was = model.training
        model.eval()
        with torch.no_grad():
            for s in found:
                want = protocol.score(wrapper, wrapper.encode(PROMPTS), s.tokens, s.owner)
                torch.testing.assert_close(s.scores, want, rtol=0, atol=1e-10)
        model.train(was)
