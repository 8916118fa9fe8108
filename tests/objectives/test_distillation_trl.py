"""TRL 1.16's own `DistillationTrainer.compute_loss` as the oracle of `distillation` through `rescore_backward`
for a causal student-teacher pair (tiny random Llamas of two widths, RoPE: TRL passes no position ids, so
left-padded prompts score at shifted positions, which rotary attention does not see): prompts of unequal length,
completions cut with and without EOS, beta 0, 0.25, 0.5 and 1, temperature 1 and 0.7, chunks of 1, 5 and all
rows; the gradients agree to TRL's float32 rounding, and to 1e-9 with a float64 autograd of the divergence over
the models' full logits; TRL's micro-batches of one generation, each divided by the generation's tokens, as phase
two of each with that normaliser. A T5 pair (a wider teacher) against the same float64 autograd."""
import importlib.util
import os
import tempfile

import pytest
import torch

if importlib.util.find_spec("trl") is None:  # only a missing extra skips: a broken install fails
    pytest.skip("trl is not installed (pip install twophase[test])", allow_module_level=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL otherwise tries the network
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import hf_tiny  # noqa: E402
from conftest import take_grads  # noqa: E402
from test_distillation import BETAS, _close, _ours, _reference  # noqa: E402
from test_hf import _batch  # noqa: E402
from twophase import protocol, rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM, HFSeq2Seq  # noqa: E402
from twophase.objectives import distillation  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 6, 7, 8], [10, 11], [4, 8, 11]]
MAX_LEN, K = 6, 4


@pytest.fixture(scope="module")
def causal_pair():
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    student, teacher = hf_tiny.causal("llama", seed=0), hf_tiny.causal("llama", seed=3, width=24)
    wrapper, teacher_wrapper = HFCausalLM(student), HFCausalLM(teacher)
    source = _batch(PROMPTS, hf_tiny.PAD, left=True)
    s = sample(wrapper, source, K, MAX_LEN, generator=torch.Generator().manual_seed(0))
    ended = s.tokens.gather(1, (s.lengths - 1)[:, None]).squeeze(1) == wrapper.eos_id
    assert bool(ended.any()) and bool((~ended).any())  # completions with and without EOS
    args = DistillationConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=K,
                              max_completion_length=MAX_LEN, report_to="none", use_cpu=True, bf16=False)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": ["a b"]}),
                                  processing_class=hf_tiny.tokenizer(padding_side="left"))
    wrapper.eval()  # TRL's eval mode: no gradient-accumulation scaling (and no dropout, as phase two)
    return trainer, wrapper, teacher_wrapper, source, s


def _causal_distributions(wrapper, enc, tokens, owner, source):
    """(N, T, V) next-token log-probabilities of the completions from one forward of prompt + completion."""
    ids = torch.cat([source["input_ids"][owner], tokens], 1)
    mask = torch.cat([source["attention_mask"][owner], torch.ones_like(tokens)], 1)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    P, T = source["input_ids"].shape[1], tokens.shape[1]
    logits = wrapper.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits[:, P - 1:P + T - 1], dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_gradient_equals_trls(causal_pair, beta, temperature):
    trainer, wrapper, teacher, source, s = causal_pair
    trainer.beta, trainer.temperature = beta, temperature
    completion_mask = protocol.target_mask(s.tokens, wrapper.pad_id, wrapper.eos_id)
    inputs = {"prompt_ids": source["input_ids"][s.owner], "prompt_mask": source["attention_mask"][s.owner],
              "completion_ids": s.tokens, "completion_mask": completion_mask.long(),
              "num_items_in_batch": completion_mask.sum()}
    wrapper.zero_grad(set_to_none=True)
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl = take_grads(wrapper)

    def distributions(model, enc, tokens, owner):
        return _causal_distributions(model, enc, tokens, owner, source)

    want_loss, want = _reference(wrapper, teacher, source, s, beta, temperature, distributions=distributions)
    assert trl_loss.item() == pytest.approx(want_loss, rel=1e-5)
    for chunk in (1, 5, len(s)):
        value, got = _ours(wrapper, teacher, source, s, beta, temperature, chunk, True)
        assert value == pytest.approx(trl_loss.item(), rel=1e-5)
        _close(got, trl, rtol=1e-5, atol=1e-7)
        assert value == pytest.approx(want_loss, rel=1e-9)
        _close(got, want, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in teacher.parameters())


def test_micro_batches_divide_by_the_whole_generations_tokens_as_trls(causal_pair):
    """TRL's training path with gradient accumulation: the generation batch split in micro-batches (rows 0-4 and
    5-11, of unequal token counts), each compute_loss dividing its summed divergence by the whole generation's
    scored tokens (num_items_in_batch, in every split), backward each (loss_is_scaled_for_ga: no further
    division). The accumulated gradient equals phase two of each micro-batch with `distillation(num_items=)` that
    count, which is what train.teacher.objective hands every batch of a --grad-accum step."""
    trainer, wrapper, teacher, source, s = causal_pair
    trainer.beta, trainer.temperature = 0.5, 0.7
    assert type(trainer).loss_is_scaled_for_ga is True
    mask = protocol.target_mask(s.tokens, wrapper.pad_id, wrapper.eos_id)
    parts = [torch.arange(0, 5), torch.arange(5, len(s))]
    assert int(mask[parts[0]].sum()) != int(mask[parts[1]].sum())
    wrapper.zero_grad(set_to_none=True)
    wrapper.train()  # TRL's training mode: num_items_in_batch is read (the tiny Llama has no dropout)
    try:
        for rows in parts:
            owner = s.owner[rows]
            inputs = {"prompt_ids": source["input_ids"][owner], "prompt_mask": source["attention_mask"][owner],
                      "completion_ids": s.tokens[rows], "completion_mask": mask[rows].long(),
                      "num_items_in_batch": mask.sum()}
            trainer.compute_loss(trainer.model, inputs).backward()
    finally:
        wrapper.eval()
    trl = take_grads(wrapper)
    for rows in parts:
        rescore_backward(wrapper, source, s.select(rows), distillation(teacher, 0.5, 0.7, num_items=mask.sum()),
                         chunk_size=5)
    _close(take_grads(wrapper), trl, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in teacher.parameters())


@pytest.fixture(scope="module")
def t5_pair():
    student = HFSeq2Seq(hf_tiny.seq2seq("t5", seed=0))
    teacher = HFSeq2Seq(hf_tiny.seq2seq("t5", seed=2, width=24, layers=2))
    assert student.head is not None and teacher.head is not None  # the streamed output layer
    rows = [[5, 6, 7, hf_tiny.EOS], [9, 10, hf_tiny.EOS], [4, 8, 11, 6, 5, hf_tiny.EOS]]
    source = _batch(rows, hf_tiny.PAD)  # right-padded, as a T5 tokenizer pads
    s = sample(student, source, K, 5, generator=torch.Generator().manual_seed(1))
    return student, teacher, source, s


def _seq2seq_distributions(model, tokens, owner, source):
    """(N, T, V) from one forward of the whole model over each row's source (not the wrapper's decoder path)."""
    out = model.model(input_ids=source["input_ids"][owner], attention_mask=source["attention_mask"][owner],
                      decoder_input_ids=protocol.teacher_forced_inputs(tokens, model.bos_id))
    return torch.log_softmax(out.logits, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_t5_pair_equals_float64_autograd(t5_pair, beta, temperature):
    student, teacher, source, s = t5_pair
    def distributions(model, enc, tokens, owner):
        return _seq2seq_distributions(model, tokens, owner, source)

    want_loss, want = _reference(student, teacher, source, s, beta, temperature, distributions=distributions)
    assert want_loss > 1e-3
    for chunk in (1, 5, len(s)):
        value, got = _ours(student, teacher, source, s, beta, temperature, chunk, True)
        assert value == pytest.approx(want_loss, rel=1e-9)
        _close(got, want, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in teacher.parameters())
