"""TRL 1.16's own `GRPOTrainer.compute_loss` as the oracle of `policy_loss` through `rescore_backward`: the same
tiny random Llama (RoPE: TRL passes no position ids, so left-padded prompts score at shifted positions, which
rotary attention does not see), the same completions, advantages, old and reference per-token log-probs; the
gradients agree to TRL's float32 rounding for the four loss types, beta 0 and 0.04, eps_high 0.2 and 0.28, with
the parameters moved away from the old policy so that tokens are clipped on both sides."""
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
from test_policy_rescoring import _moved  # noqa: E402
from twophase import protocol, rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM  # noqa: E402
from twophase.policy import policy_loss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 6, 7, 8], [10, 11], [4, 8, 11]]
MAX_LEN, K = 6, 4


@pytest.fixture(scope="module")
def setup():
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = hf_tiny.causal("llama", seed=0)
    wrapper = HFCausalLM(model)
    P = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), P), hf_tiny.PAD)
    mask = torch.zeros(len(PROMPTS), P, dtype=torch.long)
    for i, r in enumerate(PROMPTS):  # left-padded, as TRL's prompts
        ids[i, P - len(r):], mask[i, P - len(r):] = torch.tensor(r), 1
    source = {"input_ids": ids, "attention_mask": mask}
    s = sample(wrapper, source, K, MAX_LEN, generator=torch.Generator().manual_seed(0))
    _moved(wrapper, scale=1.5)  # the current policy, away from phase one's
    # beta 0 at construction: TRL would otherwise load a reference model by name; compute_loss reads self.beta
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=K, num_generations=K,
                      max_completion_length=MAX_LEN, beta=0.0, report_to="none", use_cpu=True, temperature=1.0,
                      gradient_checkpointing=False, bf16=False)  # TRL defaults to bf16 autocast
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["a b"]}),
                          processing_class=hf_tiny.tokenizer(padding_side="left"))
    wrapper.eval()  # TRL's "eval" mode: no gradient-accumulation scaling (and no dropout, as phase two)
    return trainer, wrapper, source, s


def _inputs(wrapper, source, s, g):
    completion_mask = protocol.target_mask(s.tokens, wrapper.pad_id, wrapper.eos_id)  # (N, T)
    adv = torch.randn(len(s), generator=g, dtype=torch.float64)
    ref = s.token_scores + 0.3 * torch.randn(s.tokens.shape, generator=g, dtype=torch.float64)
    ref = torch.where(completion_mask, ref, torch.zeros_like(ref))
    return {"prompt_ids": source["input_ids"][s.owner], "prompt_mask": source["attention_mask"][s.owner],
            "completion_ids": s.tokens, "completion_mask": completion_mask.long(), "advantages": adv,
            "old_per_token_logps": s.token_scores, "ref_per_token_logps": ref,
            "num_items_in_batch": completion_mask.sum()}


@pytest.mark.parametrize("beta,eps_high", [(0.0, 0.2), (0.04, 0.28)])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_gradient_equals_trls(setup, loss_type, beta, eps_high):
    trainer, wrapper, source, s = setup
    trainer.loss_type, trainer.beta, trainer.epsilon_low, trainer.epsilon_high = loss_type, beta, 0.2, eps_high
    inputs = _inputs(wrapper, source, s, torch.Generator().manual_seed(1))
    wrapper.zero_grad(set_to_none=True)
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    want = take_grads(wrapper)

    obj = policy_loss(inputs["advantages"], s.token_scores, lengths=s.lengths, loss_type=loss_type, epsilon=0.2,
                      epsilon_high=eps_high, beta=beta, ref_token_logps=inputs["ref_per_token_logps"],
                      max_len=MAX_LEN, num_items=float(inputs["num_items_in_batch"]))
    stats = {}
    loss = rescore_backward(wrapper, source, s, obj, chunk_size=5, stats=stats)
    got = take_grads(wrapper)
    assert stats["clip_low"] >= 0.1 * stats["tokens"] and stats["clip_high"] >= 0.1 * stats["tokens"]
    assert loss == pytest.approx(trl_loss.item(), rel=1e-5)
    scale = max(float(w.abs().max()) for w in want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale)
    metrics = trainer._metrics["eval"]  # TRL's clip ratios are the share of clipped tokens, as ours
    assert metrics["clip_ratio/low_mean"][-1] == pytest.approx(stats["clip_low"] / stats["tokens"])
    assert metrics["clip_ratio/high_mean"][-1] == pytest.approx(stats["clip_high"] / stats["tokens"])
