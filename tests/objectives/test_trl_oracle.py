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
from test_hf import _batch  # noqa: E402
from test_policy_rescoring import _moved  # noqa: E402
from twophase import protocol, rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM  # noqa: E402
from twophase.objectives.policy import policy_loss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 6, 7, 8], [10, 11], [4, 8, 11]]
MAX_LEN, K = 6, 4


@pytest.fixture(scope="module")
def setup():
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = hf_tiny.causal("llama", seed=0)
    wrapper = HFCausalLM(model)
    source = _batch(PROMPTS, hf_tiny.PAD, left=True)  # left-padded, as TRL's prompts
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
    _assert_equals_trls(loss, got, trl_loss, want)
    metrics = trainer._metrics["eval"]  # TRL's clip ratios are the share of clipped tokens, as ours
    assert metrics["clip_ratio/low_mean"][-1] == pytest.approx(stats["clip_low"] / stats["tokens"])
    assert metrics["clip_ratio/high_mean"][-1] == pytest.approx(stats["clip_high"] / stats["tokens"])


# TRL's other loss types and options, each with the parameters moved so that its clipping, cap or mask bites:
# (name, TRL attributes, twophase's policy_loss arguments).
OPTIONS = {
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.2}, {"loss_type": "cispo", "epsilon_high": 1.2}),
    "sapo": ({"loss_type": "sapo", "args.sapo_temperature_pos": 0.8, "args.sapo_temperature_neg": 1.3},
             {"loss_type": "sapo", "sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.3}),
    "delta": ({"loss_type": "dapo", "args.delta": 1.5}, {"loss_type": "dapo", "delta": 1.5}),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"},
             {"loss_type": "grpo", "importance_sampling_level": "sequence"}),
    "gspo-dapo-delta": ({"loss_type": "dapo", "importance_sampling_level": "sequence", "args.delta": 1.3},
                        {"loss_type": "dapo", "importance_sampling_level": "sequence", "delta": 1.3}),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"},
              {"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    "luspo-token": ({"loss_type": "luspo"}, {"loss_type": "luspo"}),
    "vespo": ({"loss_type": "vespo"}, {"loss_type": "vespo"}),
    "sapo-sequence": ({"loss_type": "sapo", "importance_sampling_level": "sequence"},
                      {"loss_type": "sapo", "importance_sampling_level": "sequence"}),
    "cispo-sequence": ({"loss_type": "cispo", "epsilon_high": 1.1, "importance_sampling_level": "sequence"},
                       {"loss_type": "cispo", "epsilon_high": 1.1, "importance_sampling_level": "sequence"}),
}


def _set(trainer, attrs: dict) -> dict:
    """Set TRL's attributes (`args.x`: its config's), returning the old values to put back."""
    saved = {}
    for key, value in attrs.items():
        owner, name = (trainer.args, key[5:]) if key.startswith("args.") else (trainer, key)
        saved[key] = getattr(owner, name)
        setattr(owner, name, value)
    return saved


def _trls(trainer, wrapper, inputs: dict, attrs: dict):
    """(TRL's loss, its gradient): its own compute_loss on `inputs` under its attributes `attrs` (put back)."""
    saved = _set(trainer, attrs)
    try:
        wrapper.zero_grad(set_to_none=True)
        trl_loss = trainer.compute_loss(trainer.model, inputs)
        trl_loss.backward()
    finally:
        _set(trainer, saved)
    return trl_loss, take_grads(wrapper)


def _assert_equals_trls(loss: float, got, trl_loss, want) -> None:
    """twophase's loss and gradient equal TRL's to 1e-5 (the gradient relative to its largest entry)."""
    assert loss == pytest.approx(trl_loss.item(), rel=1e-5)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale)



@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_other_losses_equal_trls(setup, name, beta, mask_truncated):
    """Each of TRL's other loss types and options at a moved policy, with and without the KL term, and with
    TRL's mask_truncated_completions (its zeroed completion mask of rows ending without EOS): TRL's own
    compute_loss gradient and value to 1e-5."""
    from twophase.objectives.policy import truncated_rows
    trainer, wrapper, source, s = setup
    trl_attrs, ours = OPTIONS[name]
    inputs = _inputs(wrapper, source, s, torch.Generator().manual_seed(1))
    truncated = truncated_rows(s.tokens, s.lengths, wrapper.eos_id)
    assert truncated.any() and not truncated.all()
    if mask_truncated:  # what TRL's _generate_and_score_completions does with the flag
        inputs["completion_mask"] = inputs["completion_mask"] * (~truncated).long()[:, None]
        inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trl_loss, want = _trls(trainer, wrapper, inputs, {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": beta, **trl_attrs})
    kw = {"epsilon": 0.2, "epsilon_high": 0.28, **ours}
    obj = policy_loss(inputs["advantages"], s.token_scores, lengths=s.lengths, beta=beta,
                      ref_token_logps=inputs["ref_per_token_logps"], max_len=MAX_LEN,
                      truncated=truncated if mask_truncated else None, **kw)
    stats = {}
    loss = rescore_backward(wrapper, source, s, obj, chunk_size=5, stats=stats)
    got = take_grads(wrapper)
    _assert_equals_trls(loss, got, trl_loss, want)
    metrics = trainer._metrics["eval"]
    if ours["loss_type"] == "cispo" and "importance_sampling_level" not in ours:
        assert stats["clip_high"] > 0  # the cap bites
        assert metrics["cispo_clip_ratio"][-1] == pytest.approx(stats["clip_high"] / stats["tokens"])
    elif name == "delta":
        assert metrics["clip_ratio/high_mean"][-1] == pytest.approx(stats["clip_high"] / stats["tokens"])


@pytest.mark.parametrize("loss_type,level,mode", [
    *((t, lv, m) for lv in ("token", "sequence")
      for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask") for t in ("grpo",)),
    ("vespo", "token", "token_truncate"), ("vespo", "token", "token_mask")])  # VESPO: the ratio inside phi
def test_engine_mismatch_correction_equals_trls(setup, loss_type, mode, level):
    """Completions of another engine: TRL's compute_loss with use_vllm and its importance_sampling_ratio (its
    formula, `test_mismatch._trl_ratio`) against policy_loss's sampling_token_logps and correction_mode."""
    from test_mismatch import _trl_ratio
    trainer, wrapper, source, s = setup
    inputs = _inputs(wrapper, source, s, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    mask = inputs["completion_mask"].double()
    engine = ((s.token_scores + 0.2 * torch.randn(s.token_scores.shape, generator=g, dtype=torch.float64))
              .clamp(max=-1e-4) * mask)
    clip_min, clip_max = 0.6, 1.5
    ratio = _trl_ratio(s.token_scores, engine, mask, mode, clip_min, clip_max)
    assert ((ratio * mask) != mask).any()
    inputs.update(importance_sampling_ratio=ratio, sampling_per_token_logps=engine)
    trl_loss, want = _trls(trainer, wrapper, inputs, {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04, "loss_type": loss_type,
                           "importance_sampling_level": level, "use_vllm": True,
                           "vllm_importance_sampling_correction": True})
    obj = policy_loss(inputs["advantages"], s.token_scores, lengths=s.lengths, loss_type=loss_type, epsilon=0.2,
                      epsilon_high=0.28, beta=0.04, ref_token_logps=inputs["ref_per_token_logps"],
                      num_items=float(inputs["num_items_in_batch"]),
                      importance_sampling_level=level, sampling_token_logps=engine, correction_mode=mode,
                      correction_clip_min=clip_min, correction_clip_max=clip_max)
    loss = rescore_backward(wrapper, source, s, obj, chunk_size=5)
    _assert_equals_trls(loss, take_grads(wrapper), trl_loss, want)


@pytest.mark.parametrize("engine", [False, True])
@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence")])
def test_off_policy_mask_equals_trls(setup, loss_type, level, engine):
    """DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold), its KL against the old
    policy or, with an engine's log-probabilities, against the engine's (with TRL's correction on too)."""
    from test_mismatch import _trl_ratio
    trainer, wrapper, source, s = setup
    inputs = _inputs(wrapper, source, s, torch.Generator().manual_seed(1))
    mask = inputs["completion_mask"].double()
    attrs = {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04, "loss_type": loss_type,
             "importance_sampling_level": level, "off_policy_mask_threshold": 0.3}
    ours = {}
    if engine:
        g = torch.Generator().manual_seed(2)
        sampling = ((s.token_scores + 0.2 * torch.randn(s.token_scores.shape, generator=g, dtype=torch.float64))
                    .clamp(max=-1e-4) * mask)
        inputs.update(sampling_per_token_logps=sampling,
                      importance_sampling_ratio=_trl_ratio(s.token_scores, sampling, mask, "token_truncate", None, 3.0))
        attrs.update(use_vllm=True, vllm_importance_sampling_correction=True)
        ours = {"sampling_token_logps": sampling, "correction_mode": "token_truncate"}
    trl_loss, want = _trls(trainer, wrapper, inputs, attrs)
    obj = policy_loss(inputs["advantages"], s.token_scores, lengths=s.lengths, loss_type=loss_type, epsilon=0.2,
                      epsilon_high=0.28, beta=0.04, ref_token_logps=inputs["ref_per_token_logps"],
                      importance_sampling_level=level, off_policy_mask_threshold=0.3,
                      num_items=float(inputs["num_items_in_batch"]), **ours)
    loss = rescore_backward(wrapper, source, s, obj, chunk_size=5)
    with torch.no_grad(), protocol.scoring_mode(wrapper):  # the mask bites: it drops some rows, not all
        tok = protocol.token_scores(wrapper, wrapper.encode(source), s.tokens, s.owner)
    kl = ((inputs.get("sampling_per_token_logps", s.token_scores) - tok) * mask).sum(1) / mask.sum(1)
    negative = inputs["advantages"] < 0
    assert (negative & (kl > 0.3)).any() and (negative & (kl <= 0.3)).any()
    _assert_equals_trls(loss, take_grads(wrapper), trl_loss, want)


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence")])
def test_entropy_bonus_equals_trls(setup, loss_type, level):
    """TRL's entropy bonus (entropy_coef, static): the causal LM's first positions by autograd over their
    distributions, the others through the by-hand output layer a block at a time."""
    trainer, wrapper, source, s = setup
    inputs = _inputs(wrapper, source, s, torch.Generator().manual_seed(1))
    trl_loss, want = _trls(trainer, wrapper, inputs, {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04, "loss_type": loss_type,
                           "importance_sampling_level": level, "_entropy_bonus_enabled": True,
                           "entropy_coef": 0.5, "use_adaptive_entropy": False})
    obj = policy_loss(inputs["advantages"], s.token_scores, lengths=s.lengths, loss_type=loss_type, epsilon=0.2,
                      epsilon_high=0.28, beta=0.04, ref_token_logps=inputs["ref_per_token_logps"],
                      importance_sampling_level=level, entropy_coef=0.5)
    loss = rescore_backward(wrapper, source, s, obj, chunk_size=5)
    _assert_equals_trls(loss, take_grads(wrapper), trl_loss, want)


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_top_entropy_quantile_equals_trls(setup, coef):
    """TRL's high-entropy mask (top_entropy_quantile 0.3), alone and with the entropy bonus on the same tokens."""
    trainer, wrapper, source, s = setup
    inputs = _inputs(wrapper, source, s, torch.Generator().manual_seed(1))
    trl_loss, want = _trls(trainer, wrapper, inputs, {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04, "loss_type": "dapo",
                           "top_entropy_quantile": 0.3, "_entropy_bonus_enabled": coef != 0, "entropy_coef": coef,
                           "use_adaptive_entropy": False})
    obj = policy_loss(inputs["advantages"], s.token_scores, lengths=s.lengths, loss_type="dapo", epsilon=0.2,
                      epsilon_high=0.28, beta=0.04, ref_token_logps=inputs["ref_per_token_logps"],
                      num_items=float(inputs["num_items_in_batch"]), entropy_coef=coef, top_entropy_quantile=0.3)
    loss = rescore_backward(wrapper, source, s, obj, chunk_size=5)
    _assert_equals_trls(loss, take_grads(wrapper), trl_loss, want)
